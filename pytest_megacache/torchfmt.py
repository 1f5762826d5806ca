"""torch's mega-cache container, parsed and written without importing torch.

torch 2.8 and later (``torch/utils/_appending_byte_serializer.py`` and ``torch/compiler/_cache.py``), the
``sections`` layout::

    crc32(rest) : 4 bytes, big endian
    version     : uint64 (1)
    repeated section:
        type    : uint64 length + base64(utf-8 type name)
        count   : uint64
        count x (key: uint64 length + base64(utf-8 key), content: uint64 length + bytes)

torch 2.7, the ``records`` layout (no checksum, no sections; the type is the number of torch's
``CacheArtifactType``: 0 inductor, 1 autotune, 2 aot_autograd, 3 pgo)::

    version     : uint64 (1)
    repeated record:
        type    : uint64
        key     : uint64 length + utf-8 key
        content : uint64 length + bytes

The first eight bytes tell them apart: a ``records`` container starts with the version, a ``sections`` one
with its checksum followed by the version's four high (zero) bytes, so a valid container of either layout
never reads as the other.

torch's own reader trusts this input: a CRC-valid but truncated structure makes it loop forever, and
keys become file paths unchecked. :func:`parse` validates every length against what is left, every type
against the known set and every key against a strict per-type pattern, and :func:`serialize` writes
exactly one section per type (torch keeps only the last section of a type), or one record per key.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from collections.abc import Iterable

from .errors import BundleError

ENCODING_VERSION = 1

# Key patterns per artifact type. Keys become file names below torch's cache directories, so nothing
# that could name a parent, an absolute path or a hidden file is accepted.
_SAFE_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,254}"
KEY_PATTERNS: dict[str, re.Pattern[str]] = {
    # FX graph and AOTAutograd keys: a type letter and a base32 digest.
    "inductor": re.compile(r"[a-z0-9]{8,128}"),
    "aot_autograd": re.compile(r"[a-z0-9]{8,128}"),
    # Autotune keys are "<kernel dir>/<digest>.best_config", relative to Inductor's cache dir.
    "autotune": re.compile(r"[A-Za-z0-9_]{1,64}/[A-Za-z0-9_\-]{1,200}\.best_config"),
    # PGO keys are "<job id>:<rank>:<tag>" with the user's TORCH_COMPILE_JOB_ID, which may hold '/' and other
    # punctuation: torch turns them into '_' before the key names a file (pgo.code_state_path). No control
    # characters, no leading '.', and (below) no '..' anywhere. Precompile keys are source ids.
    "pgo": re.compile(r"[A-Za-z0-9_][^\x00-\x1f\x7f\\]{0,254}"),
    "precompile": re.compile(_SAFE_NAME),
}
KNOWN_TYPES = frozenset(KEY_PATTERNS)

SECTIONS = "sections"  # torch 2.8 and later
RECORDS = "records"  # torch 2.7
LAYOUTS = (SECTIONS, RECORDS)
# torch 2.7's CacheArtifactType: the number a record's type is written as (it has no precompile artifacts)
RECORD_TYPE_CODES: dict[str, int] = {"inductor": 0, "autotune": 1, "aot_autograd": 2, "pgo": 3}
_RECORD_TYPES = {code: name for name, code in RECORD_TYPE_CODES.items()}

# An artifact needs at least two uint64 length fields.
_MIN_ARTIFACT_BYTES = 16


def validate_key(artifact_type: str, key: str) -> None:
    """Raise :class:`BundleError` unless ``key`` is acceptable for ``artifact_type``."""
    pattern = KEY_PATTERNS.get(artifact_type)
    if pattern is None:
        raise BundleError(f"unknown torch artifact type {artifact_type!r}")
    if not pattern.fullmatch(key) or ".." in key:
        raise BundleError(f"unsafe {artifact_type} key {key[:80]!r}")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def uint64(self, what: str) -> int:
        if self.left < 8:
            raise BundleError(f"torch container truncated in {what}")
        value = int.from_bytes(self.data[self.pos : self.pos + 8], "big")
        self.pos += 8
        return value

    def blob(self, what: str) -> bytes:
        size = self.uint64(f"{what} length")
        if size > self.left:
            raise BundleError(f"torch container: {what} length {size} exceeds the {self.left} bytes left")
        out = bytes(self.data[self.pos : self.pos + size])
        self.pos += size
        return out

    def text(self, what: str) -> str:
        raw = self.blob(what)
        try:
            return base64.b64decode(raw, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise BundleError(f"torch container: {what} is not base64 UTF-8") from exc


def layout_of(data: bytes) -> str:
    """The layout of a container: :data:`RECORDS` when it starts with the version, else :data:`SECTIONS`."""
    return RECORDS if data[:8] == ENCODING_VERSION.to_bytes(8, "big") else SECTIONS


def _checked(artifact_type: str, key: str, content: bytes, out: list[tuple[str, str, bytes]],
             skipped: list[str] | None) -> None:
    try:
        validate_key(artifact_type, key)
    except BundleError as exc:
        if skipped is None:
            raise
        skipped.append(str(exc))
        return
    out.append((artifact_type, key, content))


def _parse_records(data: bytes, skipped: list[str] | None) -> list[tuple[str, str, bytes]]:
    """torch 2.7's layout: the version, then one record per artifact (type number, utf-8 key, content)."""
    reader = _Reader(data)
    reader.pos = 8
    out: list[tuple[str, str, bytes]] = []
    while reader.left:
        code = reader.uint64("artifact type")
        artifact_type = _RECORD_TYPES.get(code)
        if artifact_type is None:
            raise BundleError(f"unknown torch artifact type number {code}")
        raw = reader.blob(f"{artifact_type} key")
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"torch container: {artifact_type} key is not UTF-8") from exc
        _checked(artifact_type, key, reader.blob(f"{artifact_type} content"), out, skipped)
    return out


def parse(data: bytes, skipped: list[str] | None = None) -> list[tuple[str, str, bytes]]:
    """Decode a torch mega-cache container (either layout) into ``(type, key, content)`` triples, validating
    all of it.

    An unsafe key raises :class:`BundleError`, unless ``skipped`` is given: then that artifact alone is left
    out and named there (the container's structure must still be whole)."""
    if layout_of(data) == RECORDS:
        return _parse_records(data, skipped)
    if len(data) < 12:
        raise BundleError("torch container too short")
    crc = int.from_bytes(data[:4], "big")
    if zlib.crc32(data[4:]) != crc:
        raise BundleError("torch container CRC mismatch")
    reader = _Reader(data)
    reader.pos = 4
    version = reader.uint64("version")
    if version != ENCODING_VERSION:
        raise BundleError(f"torch container version {version} is not {ENCODING_VERSION}")
    out: list[tuple[str, str, bytes]] = []
    while reader.left:
        artifact_type = reader.text("type name")
        if artifact_type not in KNOWN_TYPES:
            raise BundleError(f"unknown torch artifact type {artifact_type[:40]!r}")
        count = reader.uint64("artifact count")
        if count * _MIN_ARTIFACT_BYTES > reader.left:
            raise BundleError(f"torch container: {count} {artifact_type} artifacts cannot fit in {reader.left} bytes")
        for _ in range(count):
            key = reader.text(f"{artifact_type} key")
            _checked(artifact_type, key, reader.blob(f"{artifact_type} content"), out, skipped)
    return out


def _put_blob(buf: bytearray, blob: bytes) -> None:
    buf += len(blob).to_bytes(8, "big")
    buf += blob


def serialize(artifacts: Iterable[tuple[str, str, bytes]], layout: str = SECTIONS) -> bytes:
    """Write ``(type, key, content)`` triples as one torch container: in the :data:`SECTIONS` layout one
    section per type, in the :data:`RECORDS` layout (torch 2.7) one record per key.

    Keys are validated here too, so nothing unsafe is ever handed to torch, whatever its source. A type the
    layout cannot express (``precompile`` in torch 2.7's) raises :class:`BundleError`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown torch container layout {layout!r}")
    sections: dict[str, dict[str, bytes]] = {}
    for artifact_type, key, content in artifacts:
        validate_key(artifact_type, key)
        if layout == RECORDS and artifact_type not in RECORD_TYPE_CODES:
            raise BundleError(f"torch 2.7's container has no {artifact_type} artifacts")
        sections.setdefault(artifact_type, {})[key] = content  # torch semantics: the last record is current
    body = bytearray(ENCODING_VERSION.to_bytes(8, "big"))
    if layout == RECORDS:
        for artifact_type, items in sections.items():
            for key, content in items.items():
                body += RECORD_TYPE_CODES[artifact_type].to_bytes(8, "big")
                _put_blob(body, key.encode())
                _put_blob(body, content)
        return bytes(body)
    for artifact_type, items in sections.items():
        _put_blob(body, base64.b64encode(artifact_type.encode()))
        body += len(items).to_bytes(8, "big")
        for key, content in items.items():
            _put_blob(body, base64.b64encode(key.encode()))
            _put_blob(body, content)
    return zlib.crc32(body).to_bytes(4, "big") + bytes(body)
