"""The bundle: pytest-megacache's own object format, and the typed entries it carries.

An object in a store is::

    b"PMCB" | format version (1 byte) | header length (uint32 BE) | header (JSON) | payload

The header records the fingerprint, the payload's size, its raw (decompressed) size and its SHA-256.
The payload is a zstd frame holding a flat list of typed entries::

    b"PMCE" | count (uint32) | count x (kind length u8, kind, name length u16, name,
                                        mode u32, data length u64, data)

An entry's kind says what it is and where it goes: ``torch/<type>`` for a torch mega-cache artifact (its
name is torch's key), ``file/<root>`` for a file below a cache directory (its name is a relative POSIX
path). Entries are identified by ``(kind, name)``; merging is a union on that pair. :func:`decode`
checks the header, the size limits, the digest and every entry's name *before* anything is returned,
and decompresses with a hard output limit, so a decompression bomb or a path escape never gets further.

An object may be signed: the header then carries ``"sig": {"alg": "hmac-sha256", "kid": ..., "mac": ...}``,
an HMAC-SHA256 over the canonical header (without ``sig``) and the payload's SHA-256 (see :func:`signature_input`).
With verification keys, :func:`decode` checks the signature right after parsing the header JSON, before any
other header field is interpreted and before the payload is decompressed: an unsigned or wrongly signed object
is never interpreted, let alone decompressed.

Whatever the bytes, :func:`decode` and :func:`decode_header` raise :class:`BundleError` (or its subclass
:class:`SignatureError`) and nothing else. The header JSON is parsed strictly: ``NaN``/``Infinity``, integers
outside the signed 64-bit range, floats that overflow to infinity, nesting deeper than ``MAX_HEADER_DEPTH``
and strings that are not valid Unicode (lone surrogates) are refused. So every number anywhere in a decoded
header, :attr:`Header.extra` included, is a finite ``float`` or an ``int`` that ``float()`` converts without
overflow; ranges beyond that are the consumer's to check (see :func:`number`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zstandard

from . import torchfmt
from .errors import BundleError, redact_cut

MAGIC = b"PMCB"
FORMAT_VERSION = 1
PAYLOAD_MAGIC = b"PMCE"
MAX_HEADER_BYTES = 64 * 1024
# The strict header parser's bounds: nesting (the top-level object is depth 1), integers (signed 64-bit, so any
# header integer converts to a float), and the ``created`` time (POSIX seconds, at most 9999-12-31T23:59:59Z).
MAX_HEADER_DEPTH = 16
MAX_HEADER_INT = (1 << 63) - 1
MAX_CREATED = 253_402_300_799.0
ZSTD_LEVEL = 3
# Decompression reads the payload in chunks of this size (never more than the declared raw size + 1 in all).
DECOMPRESS_CHUNK = 1 << 20
# zstd's own default limit on the window a frame may ask for (2**27 = 128 MiB), stated explicitly: it bounds the
# decompressor's working memory whatever a hostile frame header says. Objects this plugin writes use far less.
MAX_WINDOW_BYTES = 1 << 27

SIG_ALG = "hmac-sha256"
SIG_DOMAIN = b"pytest-megacache/v1\0"
# Header fields the format defines; ``extra`` may not use these names.
RESERVED_HEADER_FIELDS = frozenset(
    {"format", "fingerprint", "payload_size", "raw_size", "payload_sha256", "entries", "created", "sig"}
)

TORCH_PREFIX = "torch/"
FILE_PREFIX = "file/"
FILE_ROOTS = frozenset({"inductor", "pch", "triton"})
# Artifacts that change under the same key (a dynamic-shape profile grows): the newest copy wins.
MUTABLE_KINDS = frozenset({TORCH_PREFIX + "pgo"})

_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+\-]{0,254}")
_MAX_PATH_PARTS = 16


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a restore accepts (hostile-input limits)."""

    max_object_bytes: int = 512 << 20  # compressed, per object
    max_raw_bytes: int = 2 << 30  # decompressed, per object
    max_entries: int = 1_000_000


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    data: bytes = field(repr=False)
    mode: int = 0o644

    @property
    def ident(self) -> tuple[str, str]:
        return (self.kind, self.name)


def validate_file_path(name: str) -> None:
    """A relative POSIX path of plain, non-hidden parts: it cannot escape the directory it lands in."""
    parts = name.split("/")
    if not name or len(parts) > _MAX_PATH_PARTS or not all(_PATH_PART.fullmatch(p) for p in parts):
        raise BundleError(f"unsafe file path {name[:80]!r}")
    if any(p in (".", "..") or ".." in p for p in parts):
        raise BundleError(f"unsafe file path {name[:80]!r}")


def validate_entry(kind: str, name: str) -> None:
    if kind.startswith(TORCH_PREFIX):
        torchfmt.validate_key(kind[len(TORCH_PREFIX) :], name)
    elif kind.startswith(FILE_PREFIX):
        if kind[len(FILE_PREFIX) :] not in FILE_ROOTS:
            raise BundleError(f"unknown file root in kind {kind[:40]!r}")
        validate_file_path(name)
    else:
        raise BundleError(f"unknown entry kind {kind[:40]!r}")


class Entries:
    """An ordered set of entries keyed by ``(kind, name)``; the first one added wins."""

    def __init__(self, items: Iterable[Entry] = ()) -> None:
        self._items: dict[tuple[str, str], Entry] = {}
        self.update(items)

    def add(self, entry: Entry) -> bool:
        """Add ``entry`` unless its ``(kind, name)`` is present; return whether it was added."""
        if entry.ident in self._items:
            return False
        self._items[entry.ident] = entry
        return True

    def update(self, items: Iterable[Entry]) -> int:
        return sum(self.add(e) for e in items)

    def merge(self, items: Iterable[Entry]) -> None:
        """Add ``items`` as :meth:`update` does, except that a mutable kind's entry (a dynamic-shape
        profile) replaces the one present: merge older sources first and the newest copy wins."""
        for entry in items:
            if entry.kind in MUTABLE_KINDS:
                self._items[entry.ident] = entry
            else:
                self.add(entry)

    def __contains__(self, ident: object) -> bool:
        return ident in self._items

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def get(self, ident: tuple[str, str]) -> Entry | None:
        return self._items.get(ident)

    def minus(self, idents: Iterable[tuple[str, str]] | Entries) -> Entries:
        """The entries not in ``idents``. Against another :class:`Entries`, a mutable kind's entry whose
        data changed under its ident counts as new too (a grown profile must be uploaded)."""
        if isinstance(idents, Entries):
            other = idents._items
            return Entries(e for e in self if e.ident not in other
                           or (e.kind in MUTABLE_KINDS and other[e.ident].data != e.data))
        known = set(idents)
        return Entries(e for e in self if e.ident not in known)

    def of_kind_prefix(self, prefix: str) -> list[Entry]:
        return [e for e in self if e.kind.startswith(prefix)]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self:
            out[e.kind] = out.get(e.kind, 0) + 1
        return dict(sorted(out.items()))

    def raw_bytes(self) -> int:
        return sum(len(e.data) for e in self)

    def torch_container(self) -> bytes | None:
        """The torch entries as one torch container (one section per type), or None if there are none."""
        torch_entries = [(e.kind[len(TORCH_PREFIX) :], e.name, e.data) for e in self.of_kind_prefix(TORCH_PREFIX)]
        return torchfmt.serialize(torch_entries) if torch_entries else None


def entries_from_torch(container: bytes, skipped: list[str] | None = None) -> Entries:
    """Entries from a torch mega-cache container (as ``save_cache_artifacts`` returns), validated.

    torch records an artifact again when it changes under the same key (a dynamic-shape profile, ``pgo``,
    is rewritten once a second shape is seen): the last record is the current one. With ``skipped``, an
    artifact whose key is unsafe is left out and named there instead of refusing the whole container."""
    latest: dict[tuple[str, str], Entry] = {}
    for t, k, c in torchfmt.parse(container, skipped):
        # (What torch copies of the environment into a graph's repro script is blanked before anything is stored,
        # with every other entry: CacheSession.scrubbed.)
        entry = Entry(TORCH_PREFIX + t, k, c)
        latest[entry.ident] = entry
    return Entries(latest.values())


def _compress_payload(entries: Entries) -> tuple[bytes, int]:
    """The payload compressed, and its raw size: fed to the compressor entry by entry, so the raw payload is never
    built in memory beside the entries (the frame states its size, as a one-shot compression would)."""
    raw_size = 8 + sum(encoded_size(e) for e in entries)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=raw_size)
    out = [compressor.compress(PAYLOAD_MAGIC + len(entries).to_bytes(4, "big"))]
    for e in entries:
        validate_entry(e.kind, e.name)
        kind, name = e.kind.encode(), e.name.encode()
        out.append(compressor.compress(len(kind).to_bytes(1, "big") + kind + len(name).to_bytes(2, "big") + name
                                       + (e.mode & 0o777).to_bytes(4, "big") + len(e.data).to_bytes(8, "big")))
        out.append(compressor.compress(e.data))
    out.append(compressor.flush())
    return b"".join(out), raw_size


class _RawStream:
    """The decompressed payload as a stream of exactly ``raw_size`` bytes (the header's declaration): entries are
    read from it one at a time, so a restore never holds the whole decompressed payload beside the entries."""

    def __init__(self, reader: Any, raw_size: int) -> None:
        self.reader = reader
        self.raw_size = raw_size
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n > self.raw_size - self.pos:
            raise BundleError(f"payload truncated in {what}")
        chunks: list[bytes] = []
        left = n
        while left:
            chunk: bytes = self.reader.read(min(left, DECOMPRESS_CHUNK))
            if not chunk:
                raise BundleError(f"payload truncated in {what}")
            chunks.append(chunk)
            left -= len(chunk)
        self.pos += n
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def produced(self) -> int:
        """How many bytes the frame decompresses to, counted up to ``raw_size + 1`` at most (the rest is read and
        dropped, a chunk at a time)."""
        total = self.pos
        while total <= self.raw_size:
            chunk = self.reader.read(min(DECOMPRESS_CHUNK, self.raw_size + 1 - total))
            if not chunk:
                break
            total += len(chunk)
        return total

    def refusal(self, defect: BundleError) -> BundleError:
        """What to say about a payload whose entries do not parse: that it expands past its declared size, or falls
        short of it, when it does (checked first, as those say more), else ``defect``."""
        total = self.produced()
        if total > self.raw_size:
            return BundleError(f"payload does not decompress: it expands past its declared raw size of {self.raw_size} "
                               "bytes")
        if total != self.raw_size:
            return BundleError("decompressed size disagrees with the header")
        return defect


def _decode_payload(raw: _RawStream, limits: Limits) -> Entries:
    """The entries, read from the decompressed payload one at a time; the stream must end right after the last."""
    try:
        entries = _decode_entries(raw, limits)
        if raw.pos != raw.raw_size:
            raise BundleError(f"{raw.raw_size - raw.pos} trailing bytes after the last entry")
    except BundleError as exc:
        raise raw.refusal(exc) from None
    if raw.produced() != raw.raw_size:
        raise raw.refusal(BundleError("decompressed size disagrees with the header"))
    return entries


def _decode_entries(raw: _RawStream, limits: Limits) -> Entries:
    take = raw.take
    head = take(8, "payload magic") if raw.raw_size >= 8 else b""
    if head[:4] != PAYLOAD_MAGIC:
        raise BundleError("payload magic missing")
    count = int.from_bytes(head[4:8], "big")
    if count > limits.max_entries:
        raise BundleError(f"payload declares {count} entries, over the limit of {limits.max_entries}")
    entries = Entries()
    for _ in range(count):
        kind_len = take(1, "kind length")[0]
        kind = take(kind_len, "kind").decode("ascii", errors="replace")
        name_len = int.from_bytes(take(2, "name length"), "big")
        try:
            name = take(name_len, "name").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError("entry name is not UTF-8") from exc
        mode = int.from_bytes(take(4, "mode"), "big") & 0o755
        data_len = int.from_bytes(take(8, "data length"), "big")
        validate_entry(kind, name)
        data = take(data_len, f"data of {name[:60]!r}")
        if not entries.add(Entry(kind, name, data, mode)):
            raise BundleError(f"duplicate entry {kind}:{name[:60]}")
    return entries


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

    def to_doc(self, with_signature: bool = True) -> dict[str, object]:
        doc: dict[str, object] = {
            **self.extra,
            "format": FORMAT_VERSION,
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


def encoded_size(entry: Entry) -> int:
    """The bytes ``entry`` takes in a payload before compression."""
    return 15 + len(entry.kind.encode()) + len(entry.name.encode()) + len(entry.data)


def encode(
    entries: Entries,
    fingerprint: str,
    extra: Mapping[str, object] | None = None,
    signing_key: bytes | None = None,
    reuse: bytes | None = None,
) -> bytes:
    """Serialize and compress ``entries`` into one object, signed with ``signing_key`` when one is given. With
    ``reuse`` (an object this function made of the same ``entries``), its compressed payload is taken as it is and
    only the header is made anew.

    Raises ValueError (:class:`BundleError` for an unsafe entry) for what a decoder would refuse."""
    extra = dict(extra or {})
    clash = sorted(RESERVED_HEADER_FIELDS & set(extra))
    if clash:
        raise ValueError(f"extra header fields may not use reserved names: {', '.join(clash)}")
    if signing_key is not None and not signing_key:
        raise ValueError("empty signing key")
    if reuse is not None:
        old, offset = decode_header(reuse, Limits(len(reuse), 1 << 62, 1 << 62))
        payload, raw_size = reuse[offset:], old.raw_size
    else:
        payload, raw_size = _compress_payload(entries)
    digest = hashlib.sha256(payload).digest()
    header = Header(
        fingerprint=fingerprint,
        payload_size=len(payload),
        raw_size=raw_size,
        payload_sha256=digest.hex(),
        entries=len(entries),
        created=round(time.time(), 3),
        extra=extra,
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
        sig = Signature(SIG_ALG, key_id(signing_key), _mac(signing_key, unsigned, digest))
        header = dataclasses.replace(header, signature=sig)
    header_json = header.to_json()
    if len(header_json) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header_json)} bytes is over the limit of {MAX_HEADER_BYTES}")
    return MAGIC + bytes([FORMAT_VERSION]) + len(header_json).to_bytes(4, "big") + header_json + payload


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
    blob: bytes, limits: Limits, verify_keys: Sequence[bytes]
) -> tuple[Header, int, bytes | None]:
    """Parse and validate the header; with ``verify_keys``, verify the signature before any field but ``sig`` is
    read. Returns the header, the payload's offset and (when it was computed for verification) its SHA-256."""
    if len(blob) > limits.max_object_bytes:
        raise BundleError(f"object of {len(blob)} bytes is over the limit of {limits.max_object_bytes}")
    if blob[:4] != MAGIC or len(blob) < 9:
        raise BundleError("not a pytest-megacache bundle (bad magic)")
    if blob[4] != FORMAT_VERSION:
        raise BundleError(f"bundle format {blob[4]} is not supported (this plugin reads {FORMAT_VERSION})")
    header_len = int.from_bytes(blob[5:9], "big")
    if header_len > MAX_HEADER_BYTES or 9 + header_len > len(blob):
        raise BundleError("bundle header length out of range")
    offset = 9 + header_len
    doc = _load_header_json(blob[9:offset])
    signature = _signature_field(doc)
    digest = None
    if verify_keys:
        # Nothing else in the header is interpreted before the MAC over all of it (and the payload) is checked.
        if signature is None:  # refused before the payload is even hashed
            raise SignatureError("unsigned object (a signing key is configured, so only signed objects are accepted)")
        digest = hashlib.sha256(memoryview(blob)[offset:]).digest()  # no copy of what may be hundreds of MiB
        _verify(signature, doc, digest, verify_keys)
    if doc.get("format") != FORMAT_VERSION or isinstance(doc.get("format"), bool):
        raise BundleError("bundle header is not a format-1 object")
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
    )
    if len(blob) - offset != header.payload_size:
        raise BundleError(f"payload is {len(blob) - offset} bytes, header says {header.payload_size} (truncated?)")
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
        header, offset, _digest = _parse_header(blob, limits, verify_keys)
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
    """Validate and decode one object. Raises :class:`BundleError`, and nothing else, on any defect.

    With ``verify_keys`` (non-empty), the object must carry a signature that one of them verifies
    (:class:`SignatureError` otherwise), checked before any other header field is interpreted and before the
    payload is decompressed. Without keys, a signature is checked for its shape only.
    """
    try:
        return _decode(blob, expected_fingerprint, limits, verify_keys)
    except BundleError:
        raise
    except Exception as exc:
        raise _unexpected(exc) from exc


def _decode(
    blob: bytes, expected_fingerprint: str | None, limits: Limits, verify_keys: Sequence[bytes]
) -> tuple[Header, Entries]:
    header, offset, digest = _parse_header(blob, limits, verify_keys)
    payload = memoryview(blob)[offset:]  # no copy of what may be hundreds of MiB
    if digest is None:
        digest = hashlib.sha256(payload).digest()
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise BundleError(f"bundle is for fingerprint {header.fingerprint[:120]!r}, not this environment's")
    if not hmac.compare_digest(digest.hex(), header.payload_sha256):
        raise BundleError("payload SHA-256 mismatch (corrupt or tampered)")
    # Decompression is streamed, a chunk at a time, and never produces more than the declared raw size (itself at
    # most ``Limits.max_raw_bytes``) + 1 bytes: the overflow of a bomb is never produced, let alone kept; the
    # decompressor's window is bounded by ``MAX_WINDOW_BYTES``. So memory is bounded by the entries themselves (at
    # most the declared size) plus one chunk. A compression-ratio guard would add nothing: the absolute cap is what
    # protects memory, and legitimate bundles (runs of zeros) can compress very well.
    try:
        params = zstandard.get_frame_parameters(payload)
        if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, header.raw_size):
            raise BundleError("zstd frame size disagrees with the header")
        reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(payload,
                                                                                         read_across_frames=True)
        with reader:
            entries = _decode_payload(_RawStream(reader, header.raw_size), limits)
    except zstandard.ZstdError as exc:
        raise BundleError(f"payload does not decompress: {exc}") from exc
    if len(entries) != header.entries:
        raise BundleError("entry count disagrees with the header")
    return header, entries


# Enough leading bytes of an object to hold its header (a ranged read for the why-miss diagnosis).
HEADER_PREFIX_BYTES = 9 + MAX_HEADER_BYTES


def peek_header(head: bytes) -> dict[str, object] | None:
    """The header document from an object's first bytes, or None. Unverified (no payload, no signature): for
    showing what another run recorded, never for deciding anything."""
    if head[:4] != MAGIC or len(head) < 9 or head[4] != FORMAT_VERSION:
        return None
    size = int.from_bytes(head[5:9], "big")
    if size > MAX_HEADER_BYTES or 9 + size > len(head):
        return None
    try:
        doc = _load_header_json(head[9 : 9 + size])  # strict: no NaN, huge integer or deep nesting reaches the caller
    except Exception:  # noqa: BLE001 - whatever hostile JSON provokes
        return None
    return doc if isinstance(doc, dict) else None
