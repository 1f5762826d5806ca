"""The object format: what a stored object is, validated before torch sees a byte. This module, the family's front
door, is the bundle (header, signature, checks); :mod:`.entries` are what it carries, :mod:`.payload` how they are
framed and compressed, :mod:`.pgo` how two versions of a dynamic-shape profile entry are merged.

The bundle: pytest-megacache's own object format.

An object in a store is::

    b"PMCB" | format version (1 byte) | header length (uint32 BE) | header (JSON) | payload

The header records the fingerprint, the payload's size, its raw (decompressed) size and its SHA-256, and (format
2) the size of the payload's index. The payload holds typed entries (:mod:`.entries`), compressed
(:mod:`.payload`): format 2, written, has a zstd frame per group of entries and an index, so a reader decompresses
only what it lacks and writes compiled files to disk as it decompresses them; format 1, still read, is one zstd
frame. :func:`decode` and :func:`read_object` check the header, the size limits, the digest and every entry's name
*before* anything is returned, and decompress with a hard output limit, so a decompression bomb or a path escape
never gets further.

An object may be signed: the header then carries ``"sig": {"alg": "hmac-sha256", "kid": ..., "mac": ...}``,
an HMAC-SHA256 over the canonical header (without ``sig``) and the payload's SHA-256 (see :func:`signature_input`).
With verification keys, the signature is checked right after parsing the header JSON, before any other header
field is interpreted and before the payload is decompressed: an unsigned or wrongly signed object is never
interpreted, let alone decompressed.

Whatever the bytes, :func:`decode`, :func:`read_object` and :func:`decode_header` raise :class:`BundleError` (or
its subclass :class:`SignatureError`) and nothing else. The header JSON is parsed strictly: ``NaN``/``Infinity``,
integers outside the signed 64-bit range, floats that overflow to infinity, nesting deeper than
``MAX_HEADER_DEPTH`` and strings that are not valid Unicode (lone surrogates) are refused. So every number anywhere
in a decoded header, :attr:`Header.extra` included, is a finite ``float`` or an ``int`` that ``float()`` converts
without overflow; ranges beyond that are the consumer's to check (see :func:`number`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from ..errors import BundleError, redact_cut
from . import payload as payloadmod
from .entries import (
    CHUNK,
    DEFAULT_LIMITS,
    FILE_PREFIX,
    FILE_ROOTS,
    MUTABLE_KINDS,
    NEWEST_WINS,
    PRECOMPILE_KIND,
    TORCH_PREFIX,
    Entries,
    Entry,
    Limits,
    encoded_size,
    entries_from_torch,
    validate_entry,
    validate_file_path,
)
from .payload import MAX_WINDOW_BYTES, PAYLOAD_MAGIC, ZSTD_LEVEL, Decoded, Source
from .pgo import MERGE_TIMEOUT, ProfileMergeError, merge_profiles

# The entries' names, the payload's and the profiles' merge are the bundle's too: the rest of the package imports
# the family from here.
__all__ = [
    "CHUNK", "DEFAULT_LIMITS", "FILE_PREFIX", "FILE_ROOTS", "MAX_WINDOW_BYTES", "MERGE_TIMEOUT", "MUTABLE_KINDS",
    "NEWEST_WINS", "PAYLOAD_MAGIC", "PRECOMPILE_KIND", "TORCH_PREFIX", "ZSTD_LEVEL", "BundleError", "Decoded", "Entries",
    "Entry", "Header", "Limits", "ProfileMergeError", "SignatureError", "decode", "decode_header", "encode",
    "encoded_size", "entries_from_torch", "merge_profiles", "peek_header", "read_object", "validate_entry",
    "validate_file_path", "write_object",
]

MAGIC = b"PMCB"
FORMAT_VERSION = 1  # one zstd frame: read, no longer written
FORMAT_FRAMED = 2  # frames and an index: what :func:`encode` and :func:`write_object` write
FORMATS = (FORMAT_VERSION, FORMAT_FRAMED)
MAX_HEADER_BYTES = 64 * 1024
# The strict header parser's bounds: nesting (the top-level object is depth 1), integers (signed 64-bit, so any
# header integer converts to a float), and the ``created`` time (POSIX seconds, at most 9999-12-31T23:59:59Z).
MAX_HEADER_DEPTH = 16
MAX_HEADER_INT = (1 << 63) - 1
MAX_CREATED = 253_402_300_799.0
# Decompression reads the payload in chunks of this size (never more than the declared raw size + 1 in all).
DECOMPRESS_CHUNK = CHUNK

SIG_ALG = "hmac-sha256"
SIG_DOMAIN = b"pytest-megacache/v1\0"
# Header fields the format defines; ``extra`` may not use these names.
RESERVED_HEADER_FIELDS = frozenset(
    {"format", "fingerprint", "payload_size", "raw_size", "payload_sha256", "entries", "created", "sig",
     "index_size"}
)

class SignatureError(BundleError):
    """An object failed signature verification (unsigned, unknown key, or a MAC that does not match)."""


@dataclass(frozen=True)
class Signature:
    alg: str
    # The first 8 hex digits of the signing key's SHA-256: it names the key. Like any MAC it lets someone who
    # reads the store test guesses offline, so keys must be random (e.g. 32 random bytes, hex), not passwords.
    kid: str
    mac: str  # hex HMAC-SHA256


@dataclass(frozen=True)
class Header:
    """A validated header. ``created`` is POSIX seconds in ``[0, MAX_CREATED]`` (0.0 when the field is absent).

    ``extra`` is the writer's own data (every field the format does not reserve), passed through as parsed: its
    values are JSON values of any shape, so a consumer must check each one's type (``isinstance``) and range
    before using it. The strict parser guarantees only that numbers are finite (``float()`` of one never raises)
    and that nesting is at most ``MAX_HEADER_DEPTH``; :func:`number` checks a value that should be a number.
    """

    fingerprint: str
    payload_size: int
    raw_size: int
    payload_sha256: str
    entries: int
    created: float
    extra: Mapping[str, object] = field(default_factory=dict)
    signature: Signature | None = None
    version: int = FORMAT_VERSION
    index_size: int = 0  # format 2: the index's bytes, at the payload's end

    def to_doc(self, with_signature: bool = True) -> dict[str, object]:
        doc: dict[str, object] = {
            **self.extra,
            **({"index_size": self.index_size} if self.version == FORMAT_FRAMED else {}),
            "format": self.version,
            "fingerprint": self.fingerprint,
            "payload_size": self.payload_size,
            "raw_size": self.raw_size,
            "payload_sha256": self.payload_sha256,
            "entries": self.entries,
            "created": self.created,
        }
        if with_signature and self.signature is not None:
            doc["sig"] = {"alg": self.signature.alg, "kid": self.signature.kid, "mac": self.signature.mac}
        return doc

    def to_json(self) -> bytes:
        return canonical_json(self.to_doc())


def canonical_json(doc: Mapping[str, object]) -> bytes:
    """The one serialization of a header that is signed: sorted keys, no whitespace, ASCII only.

    Verification re-serializes the *parsed* header this way, so what is verified is exactly what the decoder
    uses: reordered keys, whitespace, escapes or a duplicated key in the stored bytes cannot make a header
    mean something other than what was signed, and a field cannot move into or out of another one.
    """
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode("ascii")


def key_id(key: bytes) -> str:
    """The short, public name of a key: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:8]


def signature_input(unsigned_header: Mapping[str, object], payload_digest: bytes) -> bytes:
    """What the MAC covers: a domain tag, the canonical header without ``sig``, and the payload's SHA-256."""
    if "sig" in unsigned_header:
        raise ValueError("the signed header must not contain 'sig'")
    return SIG_DOMAIN + canonical_json(unsigned_header) + b"\0" + payload_digest


def _mac(key: bytes, unsigned_header: Mapping[str, object], payload_digest: bytes) -> str:
    return hmac.new(key, signature_input(unsigned_header, payload_digest), hashlib.sha256).hexdigest()


def _header_bytes(entries: int, fingerprint: str, extra: Mapping[str, object] | None, signing_key: bytes | None,
                  written: payloadmod.Written) -> tuple[Header, bytes]:
    """The header, and the object's bytes before its payload: magic, version, header length and the header (signed
    with ``signing_key`` when one is given). Raises ValueError for a header a decoder would refuse."""
    extra = dict(extra or {})
    clash = sorted(RESERVED_HEADER_FIELDS & set(extra))
    if clash:
        raise ValueError(f"extra header fields may not use reserved names: {', '.join(clash)}")
    if signing_key is not None and not signing_key:
        raise ValueError("empty signing key")
    header = Header(
        fingerprint=fingerprint,
        payload_size=written.size,
        raw_size=written.raw_size,
        payload_sha256=written.sha256.hex(),
        entries=entries,
        created=round(time.time(), 3),
        extra=extra,
        version=FORMAT_FRAMED,
        index_size=written.index_size,
    )
    # The header as a decoder will parse it back (a JSON round trip, through the same strict parser): an
    # ``extra`` the decoder would refuse (NaN, a huge integer, deep nesting) is refused here, and the MAC is
    # computed over what will be verified, so that values JSON cannot tell apart (a tuple and a list, say) sign
    # and verify the same way.
    try:
        unsigned = _load_header_json(canonical_json(header.to_doc(with_signature=False)))
    except BundleError as exc:
        raise ValueError(f"extra header fields would not decode: {exc}") from None
    if signing_key is not None:
        sig = Signature(SIG_ALG, key_id(signing_key), _mac(signing_key, unsigned, written.sha256))
        header = dataclasses.replace(header, signature=sig)
    header_json = header.to_json()
    if len(header_json) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header_json)} bytes is over the limit of {MAX_HEADER_BYTES}")
    return header, MAGIC + bytes([FORMAT_FRAMED]) + len(header_json).to_bytes(4, "big") + header_json


def encode(
    entries: Entries,
    fingerprint: str,
    extra: Mapping[str, object] | None = None,
    signing_key: bytes | None = None,
) -> bytes:
    """Serialize and compress ``entries`` into one object, in memory, signed with ``signing_key`` when one is
    given. Raises ValueError (:class:`BundleError` for an unsafe entry) for what a decoder would refuse."""
    body = io.BytesIO()
    written = payloadmod.write(body, entries)
    return _header_bytes(len(entries), fingerprint, extra, signing_key, written)[1] + body.getvalue()


def write_object(
    path: str | os.PathLike[str],
    entries: Entries,
    fingerprint: str,
    extra: Mapping[str, object] | None = None,
    signing_key: bytes | None = None,
) -> tuple[Header, int]:
    """Write ``entries`` as one object into the new file ``path`` (as :func:`encode` would make it), an entry a
    chunk at a time: what is held in memory is one chunk, not the object. Returns its header and size. The payload
    is written first, to a file beside ``path`` (removed whatever happens), as the header records its digest."""
    target = os.fspath(path)
    spare = target + ".payload"
    try:
        with open(spare, "w+b") as body:
            written = payloadmod.write(body, entries)
            header, head = _header_bytes(len(entries), fingerprint, extra, signing_key, written)
            body.seek(0)
            with open(target, "xb") as out:
                try:
                    out.write(head)
                    for chunk in iter(lambda: body.read(CHUNK), b""):
                        out.write(chunk)
                except BaseException:
                    os.unlink(target)
                    raise
        return header, len(head) + written.size
    finally:
        try:
            os.unlink(spare)
        except OSError:
            pass


def number(value: object, lower: float = 0.0, upper: float = float(MAX_HEADER_INT)) -> float | None:
    """``value`` as a float when it is a JSON number (an int or a float, not a bool) within ``[lower, upper]``,
    else None: the safe way to read a number out of :attr:`Header.extra`, which holds whatever a writer put there.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        result = float(value)
    except (OverflowError, ValueError):  # an int built outside the strict parser
        return None
    return result if math.isfinite(result) and lower <= result <= upper else None


def _refuse_constant(name: str) -> object:
    raise BundleError(f"bundle header holds {name}, which JSON does not allow")


def _strict_int(text: str) -> int:
    # Checked on the text first: int() of thousands of digits is slow, and past 4300 digits it raises ValueError.
    if len(text.lstrip("-")) > len(str(MAX_HEADER_INT)):
        raise BundleError("bundle header holds an integer out of range")
    value = int(text)
    if not -MAX_HEADER_INT - 1 <= value <= MAX_HEADER_INT:
        raise BundleError("bundle header holds an integer out of range")
    return value


def _strict_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise BundleError("bundle header holds a number out of range")
    return value


def _check_tree(doc: object) -> None:
    """Refuse nesting deeper than ``MAX_HEADER_DEPTH`` and strings that are not valid Unicode (JSON's ``\\ud800``
    escapes parse into lone surrogates, which no UTF-8 stream can write). Iterative: no recursion to exhaust."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        strings: list[object] = []
        if isinstance(value, (dict, list)):
            if depth > MAX_HEADER_DEPTH:
                raise BundleError(f"bundle header nests deeper than {MAX_HEADER_DEPTH} levels")
            items = list(value.values()) if isinstance(value, dict) else value
            strings = list(value) if isinstance(value, dict) else []
            stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, str):
            strings = [value]
        for text in strings:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise BundleError("bundle header holds a string that is not valid Unicode") from None


def _load_header_json(text: bytes) -> dict[str, object]:
    """The header's JSON object, parsed strictly (see the module docstring); raises only :class:`BundleError`."""
    try:
        doc = json.loads(text, parse_int=_strict_int, parse_float=_strict_float, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BundleError("bundle header is not JSON") from exc
    if not isinstance(doc, dict):
        raise BundleError("bundle header is not a format-1 object")
    _check_tree(doc)
    return doc


def _int_field(doc: Mapping[str, object], name: str, upper: int) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise BundleError(f"header field {name!r} is missing or out of range")
    return value


def _created_field(doc: Mapping[str, object]) -> float:
    """``created``: 0.0 when absent (it orders objects only), else a number of seconds in ``[0, MAX_CREATED]``."""
    if "created" not in doc:
        return 0.0
    created = number(doc["created"], 0.0, MAX_CREATED)
    if created is None:
        raise BundleError("header field 'created' is not a time (a number of seconds since 1970, up to the year 9999)")
    return created


def _signature_field(doc: Mapping[str, object]) -> Signature | None:
    if "sig" not in doc:
        return None
    sig = doc["sig"]
    if (
        not isinstance(sig, dict)
        or set(sig) != {"alg", "kid", "mac"}
        or sig["alg"] != SIG_ALG
        or not isinstance(sig["kid"], str)
        or not isinstance(sig["mac"], str)
        or not re.fullmatch(r"[0-9a-f]{8}", sig["kid"])
        or not re.fullmatch(r"[0-9a-f]{64}", sig["mac"])
    ):
        raise SignatureError(f"malformed signature field (expected {{alg: {SIG_ALG}, kid: 8 hex, mac: 64 hex}})")
    return Signature(sig["alg"], sig["kid"], sig["mac"])


def _parse_header(
    src: Source, limits: Limits, verify_keys: Sequence[bytes]
) -> tuple[Header, int, bytes | None]:
    """Parse and validate the header; with ``verify_keys``, verify the signature before any field but ``sig`` is
    read. Returns the header, the payload's offset and (when it was computed for verification) its SHA-256."""
    if src.size > limits.max_object_bytes:
        raise BundleError(f"object of {src.size} bytes is over the limit of {limits.max_object_bytes}")
    blob = src.read_at(0, 9 + MAX_HEADER_BYTES)
    if blob[:4] != MAGIC or len(blob) < 9:
        raise BundleError("not a pytest-megacache bundle (bad magic)")
    version = blob[4]
    if version not in FORMATS:
        raise BundleError(f"bundle format {version} is not supported (this plugin reads formats 1 and 2)")
    header_len = int.from_bytes(blob[5:9], "big")
    if header_len > MAX_HEADER_BYTES or 9 + header_len > src.size:
        raise BundleError("bundle header length out of range")
    offset = 9 + header_len
    doc = _load_header_json(blob[9:offset])
    signature = _signature_field(doc)
    digest = None
    if verify_keys:
        # Nothing else in the header is interpreted before the MAC over all of it (and the payload) is checked.
        if signature is None:  # refused before the payload is even hashed
            raise SignatureError("unsigned object (a signing key is configured, so only signed objects are accepted)")
        digest = src.digest(offset)  # a chunk at a time: no copy of what may be hundreds of MiB
        _verify(signature, doc, digest, verify_keys)
    if doc.get("format") != version or isinstance(doc.get("format"), bool):
        raise BundleError(f"bundle header is not a format-{version} object")
    fingerprint = doc.get("fingerprint")
    sha = doc.get("payload_sha256")
    if not isinstance(fingerprint, str) or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise BundleError("bundle header lacks a fingerprint or a SHA-256")
    header = Header(
        fingerprint=fingerprint,
        payload_size=_int_field(doc, "payload_size", limits.max_object_bytes),
        raw_size=_int_field(doc, "raw_size", limits.max_raw_bytes),
        payload_sha256=sha,
        entries=_int_field(doc, "entries", limits.max_entries),
        created=_created_field(doc),
        extra={k: v for k, v in doc.items() if k not in RESERVED_HEADER_FIELDS},
        signature=signature,
        version=version,
        index_size=_int_field(doc, "index_size", limits.max_object_bytes) if version == FORMAT_FRAMED else 0,
    )
    if src.size - offset != header.payload_size:
        raise BundleError(f"payload is {src.size - offset} bytes, header says {header.payload_size} (truncated?)")
    return header, offset, digest


def _verify(signature: Signature, doc: Mapping[str, object], payload_digest: bytes, verify_keys: Sequence[bytes]) -> None:
    """Pass if any key verifies the MAC; raise :class:`SignatureError` saying why not otherwise."""
    unsigned = {k: v for k, v in doc.items() if k != "sig"}
    # Every key is tried, whatever the kid says (the kid is a hint for the message, not part of the MAC).
    if any(hmac.compare_digest(_mac(key, unsigned, payload_digest), signature.mac) for key in verify_keys):
        return
    if signature.kid not in {key_id(key) for key in verify_keys}:
        raise SignatureError(f"signed with an unknown key (kid {signature.kid})")
    raise SignatureError(f"signature mismatch (tampered?) for key kid {signature.kid}")


def _unexpected(exc: Exception) -> BundleError:
    """The last line of defence of the public entry points: whatever escaped the checks becomes a refusal."""
    return BundleError(f"malformed bundle ({type(exc).__name__}: {redact_cut(str(exc), 200)})")


def decode_header(
    blob: bytes,
    limits: Limits = DEFAULT_LIMITS,
    verify_keys: Sequence[bytes] = (),
) -> tuple[Header, int]:
    """Parse and validate the header (the signature field's shape included); return it and the payload's offset.

    With ``verify_keys``, the signature is verified too (which hashes the payload, but decompresses nothing),
    before any other header field is interpreted. Raises :class:`BundleError` (or :class:`SignatureError`), and
    nothing else, on any defect.
    """
    try:
        header, offset, _digest = _parse_header(Source.of_bytes(blob), limits, verify_keys)
    except BundleError:
        raise
    except Exception as exc:
        raise _unexpected(exc) from exc
    return header, offset


def decode(
    blob: bytes,
    expected_fingerprint: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    verify_keys: Sequence[bytes] = (),
) -> tuple[Header, Entries]:
    """Validate and decode one object held in memory. Raises :class:`BundleError`, and nothing else, on any defect.

    With ``verify_keys`` (non-empty), the object must carry a signature that one of them verifies
    (:class:`SignatureError` otherwise), checked before any other header field is interpreted and before the
    payload is decompressed. Without keys, a signature is checked for its shape only.
    """
    header, decoded = _read(Source.of_bytes(blob), expected_fingerprint, limits, verify_keys, None, None)
    return header, decoded.entries


def read_object(
    fh: BinaryIO,
    expected_fingerprint: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    verify_keys: Sequence[bytes] = (),
    scratch_dir: str | None = None,
    held: Entries | None = None,
) -> tuple[Header, Decoded]:
    """Validate and decode the object in the open file ``fh``, as :func:`decode` does, reading it a chunk at a
    time. With ``scratch_dir``, file entries (and large ones) are written there as they are decompressed (the
    object's digest and signature were checked first). With ``held``, an entry of the same ``(kind, name)`` there stands for this
    object's copy, whose frame is not decompressed when all of it is held (:func:`.payload.read_framed`)."""
    return _read(Source.of_file(fh), expected_fingerprint, limits, verify_keys, scratch_dir, held)


def _read(src: Source, expected_fingerprint: str | None, limits: Limits, verify_keys: Sequence[bytes],
          scratch_dir: str | None, held: Entries | None) -> tuple[Header, Decoded]:
    try:
        return _decode(src, expected_fingerprint, limits, verify_keys, scratch_dir, held)
    except BundleError:
        raise
    except Exception as exc:
        raise _unexpected(exc) from exc


def _decode(src: Source, expected_fingerprint: str | None, limits: Limits, verify_keys: Sequence[bytes],
            scratch_dir: str | None, held: Entries | None) -> tuple[Header, Decoded]:
    header, offset, digest = _parse_header(src, limits, verify_keys)
    if digest is None:
        digest = src.digest(offset)
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise BundleError(f"bundle is for fingerprint {header.fingerprint[:120]!r}, not this environment's")
    if not hmac.compare_digest(digest.hex(), header.payload_sha256):
        raise BundleError("payload SHA-256 mismatch (corrupt or tampered)")
    # Decompression is streamed, a chunk at a time, and never produces more than the declared raw size (itself at
    # most ``Limits.max_raw_bytes``) + 1 bytes: the overflow of a bomb is never produced, let alone kept; the
    # decompressor's window is bounded by ``MAX_WINDOW_BYTES``. So memory is bounded by the entries held in memory
    # (at most the declared size) plus one chunk. A compression-ratio guard would add nothing: the absolute cap is
    # what protects memory, and legitimate bundles (runs of zeros) can compress very well.
    try:
        if header.version == FORMAT_FRAMED:
            decoded = payloadmod.read_framed(src, offset, header.payload_size, header.raw_size, header.index_size,
                                             header.entries, limits, scratch_dir, held)
        else:
            decoded = payloadmod.read_v1(src, offset, header.raw_size, limits, scratch_dir)
    except zstandard.ZstdError as exc:
        raise BundleError(f"payload does not decompress: {exc}") from exc
    if len(decoded.entries) != header.entries:
        raise BundleError("entry count disagrees with the header")
    return header, decoded


# Enough leading bytes of an object to hold its header (a ranged read for the why-miss diagnosis).
HEADER_PREFIX_BYTES = 9 + MAX_HEADER_BYTES


def peek_header(head: bytes) -> dict[str, object] | None:
    """The header document from an object's first bytes, or None. Unverified (no payload, no signature): for
    showing what another run recorded, never for deciding anything."""
    if head[:4] != MAGIC or len(head) < 9 or head[4] not in FORMATS:
        return None
    size = int.from_bytes(head[5:9], "big")
    if size > MAX_HEADER_BYTES or 9 + size > len(head):
        return None
    try:
        doc = _load_header_json(head[9 : 9 + size])  # strict: no NaN, huge integer or deep nesting reaches the caller
    except Exception:  # noqa: BLE001 - whatever hostile JSON provokes
        return None
    return doc if isinstance(doc, dict) else None
