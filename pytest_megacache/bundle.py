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
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import zstandard

from . import torchfmt
from .errors import BundleError

MAGIC = b"PMCB"
FORMAT_VERSION = 1
PAYLOAD_MAGIC = b"PMCE"
MAX_HEADER_BYTES = 64 * 1024
ZSTD_LEVEL = 3

TORCH_PREFIX = "torch/"
FILE_PREFIX = "file/"
FILE_ROOTS = frozenset({"inductor", "triton"})

_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+\-]{0,254}")
_MAX_PATH_PARTS = 16


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a restore accepts (hostile-input limits)."""

    max_object_bytes: int = 1 << 30  # compressed, per object
    max_raw_bytes: int = 4 << 30  # decompressed, per object
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

    def __contains__(self, ident: object) -> bool:
        return ident in self._items

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def idents(self) -> set[tuple[str, str]]:
        return set(self._items)

    def minus(self, idents: Iterable[tuple[str, str]] | Entries) -> Entries:
        known = idents.idents() if isinstance(idents, Entries) else set(idents)
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
    """Entries from a torch mega-cache container (as ``save_cache_artifacts`` returns), validated."""
    return Entries(Entry(TORCH_PREFIX + t, k, c) for t, k, c in torchfmt.parse(container))


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


def _decode_payload(raw: bytes, limits: Limits) -> Entries:
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


@dataclass(frozen=True)
class Header:
    fingerprint: str
    payload_size: int
    raw_size: int
    payload_sha256: str
    entries: int
    created: float
    extra: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "payload_size": self.payload_size,
            "raw_size": self.raw_size,
            "payload_sha256": self.payload_sha256,
            "entries": self.entries,
            "created": self.created,
            **self.extra,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def encode(entries: Entries, fingerprint: str, extra: Mapping[str, object] | None = None) -> bytes:
    """Serialize and compress ``entries`` into one object."""
    raw = _encode_payload(entries)
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    header = Header(
        fingerprint=fingerprint,
        payload_size=len(payload),
        raw_size=len(raw),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        entries=len(entries),
        created=round(time.time(), 3),
        extra=dict(extra or {}),
    ).to_json()
    return MAGIC + bytes([FORMAT_VERSION]) + len(header).to_bytes(4, "big") + header + payload


def _int_field(doc: Mapping[str, object], name: str, upper: int) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise BundleError(f"header field {name!r} is missing or out of range")
    return value


def decode_header(blob: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[Header, int]:
    """Parse and validate the header; return it and the payload's offset."""
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
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError("bundle header is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
        raise BundleError("bundle header is not a format-1 object")
    fingerprint = doc.get("fingerprint")
    sha = doc.get("payload_sha256")
    created = doc.get("created")
    if not isinstance(fingerprint, str) or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise BundleError("bundle header lacks a fingerprint or a SHA-256")
    known = {"format", "fingerprint", "payload_size", "raw_size", "payload_sha256", "entries", "created"}
    header = Header(
        fingerprint=fingerprint,
        payload_size=_int_field(doc, "payload_size", limits.max_object_bytes),
        raw_size=_int_field(doc, "raw_size", limits.max_raw_bytes),
        payload_sha256=sha,
        entries=_int_field(doc, "entries", limits.max_entries),
        created=float(created) if isinstance(created, (int, float)) else 0.0,
        extra={k: v for k, v in doc.items() if k not in known},
    )
    offset = 9 + header_len
    if len(blob) - offset != header.payload_size:
        raise BundleError(f"payload is {len(blob) - offset} bytes, header says {header.payload_size} (truncated?)")
    return header, offset


def decode(blob: bytes, expected_fingerprint: str | None = None, limits: Limits = DEFAULT_LIMITS) -> tuple[Header, Entries]:
    """Validate and decode one object. Raises :class:`BundleError` on any defect."""
    header, offset = decode_header(blob, limits)
    if expected_fingerprint is not None and header.fingerprint != expected_fingerprint:
        raise BundleError(f"bundle is for fingerprint {header.fingerprint[:120]!r}, not this environment's")
    payload = blob[offset:]
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise BundleError("payload SHA-256 mismatch (corrupt or tampered)")
    try:
        params = zstandard.get_frame_parameters(payload)
        if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, header.raw_size):
            raise BundleError("zstd frame size disagrees with the header")
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_size)
    except zstandard.ZstdError as exc:
        raise BundleError(f"payload does not decompress: {exc}") from exc
    if len(raw) != header.raw_size:
        raise BundleError("decompressed size disagrees with the header")
    entries = _decode_payload(raw, limits)
    if len(entries) != header.entries:
        raise BundleError("entry count disagrees with the header")
    return header, entries
