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
With verification keys, :func:`decode` checks the signature right after parsing the header and before the
payload is decompressed: an unsigned or wrongly signed object is never decompressed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import zstandard

from . import torchfmt
from .errors import BundleError
from .keys import MIN_KEY_CHARS, SIGNING_KEY_ENV, parse_signing_keys  # noqa: F401 - re-exported

MAGIC = b"PMCB"
FORMAT_VERSION = 1
PAYLOAD_MAGIC = b"PMCE"
MAX_HEADER_BYTES = 64 * 1024
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
FILE_ROOTS = frozenset({"inductor", "triton"})
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

    def idents(self) -> set[tuple[str, str]]:
        return set(self._items)

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


def entries_from_torch(container: bytes) -> Entries:
    """Entries from a torch mega-cache container (as ``save_cache_artifacts`` returns), validated.

    torch records an artifact again when it changes under the same key (a dynamic-shape profile, ``pgo``,
    is rewritten once a second shape is seen): the last record is the current one."""
    latest: dict[tuple[str, str], Entry] = {}
    for t, k, c in torchfmt.parse(container):
        entry = Entry(TORCH_PREFIX + t, k, c)
        latest[entry.ident] = entry
    return Entries(latest.values())


def _encode_payload(entries: Entries) -> bytes:
    out = bytearray(PAYLOAD_MAGIC)
    out += len(entries).to_bytes(4, "big")
    for e in entries:
        validate_entry(e.kind, e.name)
        kind, name = e.kind.encode(), e.name.encode()
        out += len(kind).to_bytes(1, "big") + kind
        out += len(name).to_bytes(2, "big") + name
        out += (e.mode & 0o777).to_bytes(4, "big")
        out += len(e.data).to_bytes(8, "big") + e.data
    return bytes(out)


def _decode_payload(raw: bytes | bytearray, limits: Limits) -> Entries:
    view = memoryview(raw)
    if bytes(view[:4]) != PAYLOAD_MAGIC or len(raw) < 8:
        raise BundleError("payload magic missing")
    count = int.from_bytes(view[4:8], "big")
    if count > limits.max_entries:
        raise BundleError(f"payload declares {count} entries, over the limit of {limits.max_entries}")
    pos = 8

    def take(n: int, what: str) -> memoryview:
        nonlocal pos
        if n > len(raw) - pos:
            raise BundleError(f"payload truncated in {what}")
        chunk = view[pos : pos + n]
        pos += n
        return chunk

    entries = Entries()
    for _ in range(count):
        kind_len = take(1, "kind length")[0]
        kind = bytes(take(kind_len, "kind")).decode("ascii", errors="replace")
        name_len = int.from_bytes(take(2, "name length"), "big")
        try:
            name = bytes(take(name_len, "name")).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError("entry name is not UTF-8") from exc
        mode = int.from_bytes(take(4, "mode"), "big") & 0o755
        data_len = int.from_bytes(take(8, "data length"), "big")
        validate_entry(kind, name)
        data = bytes(take(data_len, f"data of {name[:60]!r}"))
        if not entries.add(Entry(kind, name, data, mode)):
            raise BundleError(f"duplicate entry {kind}:{name[:60]}")
    if pos != len(raw):
        raise BundleError(f"{len(raw) - pos} trailing bytes after the last entry")
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


def encode(
    entries: Entries,
    fingerprint: str,
    extra: Mapping[str, object] | None = None,
    signing_key: bytes | None = None,
) -> bytes:
    """Serialize and compress ``entries`` into one object, signed with ``signing_key`` when one is given."""
    extra = dict(extra or {})
    clash = sorted(RESERVED_HEADER_FIELDS & set(extra))
    if clash:
        raise ValueError(f"extra header fields may not use reserved names: {', '.join(clash)}")
    if signing_key is not None and not signing_key:
        raise ValueError("empty signing key")
    raw = _encode_payload(entries)
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    digest = hashlib.sha256(payload).digest()
    header = Header(
        fingerprint=fingerprint,
        payload_size=len(payload),
        raw_size=len(raw),
        payload_sha256=digest.hex(),
        entries=len(entries),
        created=round(time.time(), 3),
        extra=extra,
    )
    if signing_key is not None:
        # The MAC is computed over the header as a decoder will parse it back (a JSON round trip), so that
        # values JSON cannot tell apart (a tuple and a list, say) sign and verify the same way.
        unsigned = json.loads(canonical_json(header.to_doc(with_signature=False)))
        sig = Signature(SIG_ALG, key_id(signing_key), _mac(signing_key, unsigned, digest))
        header = dataclasses.replace(header, signature=sig)
    header_json = header.to_json()
    if len(header_json) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header_json)} bytes is over the limit of {MAX_HEADER_BYTES}")
    return MAGIC + bytes([FORMAT_VERSION]) + len(header_json).to_bytes(4, "big") + header_json + payload


def _int_field(doc: Mapping[str, object], name: str, upper: int) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise BundleError(f"header field {name!r} is missing or out of range")
    return value


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


def _parse_header(blob: bytes, limits: Limits) -> tuple[Header, int, dict[str, object]]:
    if len(blob) > limits.max_object_bytes:
        raise BundleError(f"object of {len(blob)} bytes is over the limit of {limits.max_object_bytes}")
    if blob[:4] != MAGIC or len(blob) < 9:
        raise BundleError("not a pytest-megacache bundle (bad magic)")
    if blob[4] != FORMAT_VERSION:
        raise BundleError(f"bundle format {blob[4]} is not supported (this plugin reads {FORMAT_VERSION})")
    header_len = int.from_bytes(blob[5:9], "big")
    if header_len > MAX_HEADER_BYTES or 9 + header_len > len(blob):
        raise BundleError("bundle header length out of range")
    try:
        doc = json.loads(blob[9 : 9 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise BundleError("bundle header is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
        raise BundleError("bundle header is not a format-1 object")
    fingerprint = doc.get("fingerprint")
    sha = doc.get("payload_sha256")
    created = doc.get("created")
    if not isinstance(fingerprint, str) or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise BundleError("bundle header lacks a fingerprint or a SHA-256")
    header = Header(
        fingerprint=fingerprint,
        payload_size=_int_field(doc, "payload_size", limits.max_object_bytes),
        raw_size=_int_field(doc, "raw_size", limits.max_raw_bytes),
        payload_sha256=sha,
        entries=_int_field(doc, "entries", limits.max_entries),
        created=float(created) if isinstance(created, (int, float)) else 0.0,
        extra={k: v for k, v in doc.items() if k not in RESERVED_HEADER_FIELDS},
        signature=_signature_field(doc),
    )
    offset = 9 + header_len
    if len(blob) - offset != header.payload_size:
        raise BundleError(f"payload is {len(blob) - offset} bytes, header says {header.payload_size} (truncated?)")
    return header, offset, doc


def _require_signature(header: Header) -> Signature:
    if header.signature is None:
        raise SignatureError("unsigned object (a signing key is configured, so only signed objects are accepted)")
    return header.signature


def _verify(header: Header, doc: Mapping[str, object], payload_digest: bytes, verify_keys: Sequence[bytes]) -> None:
    """Pass if any key verifies the MAC; raise :class:`SignatureError` saying why not otherwise."""
    sig = _require_signature(header)
    unsigned = {k: v for k, v in doc.items() if k != "sig"}
    # Every key is tried, whatever the kid says (the kid is a hint for the message, not part of the MAC).
    if any(hmac.compare_digest(_mac(key, unsigned, payload_digest), sig.mac) for key in verify_keys):
        return
    if sig.kid not in {key_id(key) for key in verify_keys}:
        raise SignatureError(f"signed with an unknown key (kid {sig.kid})")
    raise SignatureError(f"signature mismatch (tampered?) for key kid {sig.kid}")


def decode_header(
    blob: bytes,
    limits: Limits = DEFAULT_LIMITS,
    verify_keys: Sequence[bytes] = (),
) -> tuple[Header, int]:
    """Parse and validate the header (the signature field's shape included); return it and the payload's offset.

    With ``verify_keys``, the signature is verified too (which hashes the payload, but decompresses nothing).
    """
    header, offset, doc = _parse_header(blob, limits)
    if verify_keys:
        _require_signature(header)  # an unsigned object is refused before its payload is even hashed
        _verify(header, doc, hashlib.sha256(memoryview(blob)[offset:]).digest(), verify_keys)
    return header, offset


def _decompress(payload: bytes | memoryview, raw_size: int) -> bytearray:
    """Decompress ``payload``, producing at most ``raw_size + 1`` bytes whatever the frame claims.

    The output is read in chunks and refused as soon as it passes the declared raw size (itself at most
    ``Limits.max_raw_bytes``), so the overflow of a bomb is never produced, let alone kept; the decompressor's
    window is bounded by ``MAX_WINDOW_BYTES``. Memory is therefore bounded by the declared size (plus the
    buffer's growth slack and one chunk), which the limits cap. A compression-ratio guard would add nothing:
    the absolute cap is what protects memory, and legitimate bundles (runs of zeros) can compress very well.
    """
    out = bytearray()
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(payload, read_across_frames=True)
    with reader:
        while True:
            chunk = reader.read(min(DECOMPRESS_CHUNK, raw_size + 1 - len(out)))
            if not chunk:
                return out
            out += chunk
            if len(out) > raw_size:
                raise BundleError(f"payload does not decompress: it expands past its declared raw size of {raw_size} bytes")


def decode(
    blob: bytes,
    expected_fingerprint: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    verify_keys: Sequence[bytes] = (),
) -> tuple[Header, Entries]:
    """Validate and decode one object. Raises :class:`BundleError` on any defect.

    With ``verify_keys`` (non-empty), the object must carry a signature that one of them verifies
    (:class:`SignatureError` otherwise), checked before the payload is decompressed. Without keys, a signature
    is checked for its shape only.
    """
    header, offset, doc = _parse_header(blob, limits)
    if verify_keys:
        _require_signature(header)  # an unsigned object is refused before its payload is hashed or decompressed
    payload = memoryview(blob)[offset:]  # no copy of what may be hundreds of MiB
    digest = hashlib.sha256(payload).digest()
    if verify_keys:
        _verify(header, doc, digest, verify_keys)
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise BundleError(f"bundle is for fingerprint {header.fingerprint[:120]!r}, not this environment's")
    if not hmac.compare_digest(digest.hex(), header.payload_sha256):
        raise BundleError("payload SHA-256 mismatch (corrupt or tampered)")
    try:
        params = zstandard.get_frame_parameters(payload)
        if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, header.raw_size):
            raise BundleError("zstd frame size disagrees with the header")
        raw = _decompress(payload, header.raw_size)
    except zstandard.ZstdError as exc:
        raise BundleError(f"payload does not decompress: {exc}") from exc
    if len(raw) != header.raw_size:
        raise BundleError("decompressed size disagrees with the header")
    entries = _decode_payload(raw, limits)
    if len(entries) != header.entries:
        raise BundleError("entry count disagrees with the header")
    return header, entries
