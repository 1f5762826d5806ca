"""What a bundle carries: typed entries, keyed by ``(kind, name)``, and the limits a restore puts on them.

An entry's kind says what it is and where it goes: ``torch/<type>`` for a torch mega-cache artifact (its name is
torch's key), ``file/<root>`` for a file below a cache directory (its name is a relative POSIX path). Entries are
identified by ``(kind, name)``; merging is a union on that pair. An entry's bytes are in memory, or in a file of the
session's scratch directory (:meth:`Entry.in_file`): compiled files are never all held in memory at once.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .. import torchfmt
from ..errors import BundleError

# Entries' bytes are read, copied and decompressed in chunks of this size.
CHUNK = 1 << 20

TORCH_PREFIX = "torch/"
FILE_PREFIX = "file/"
FILE_ROOTS = frozenset({"inductor", "pch", "triton"})
# Artifacts that change under the same key (a dynamic-shape profile grows): the newest copy wins.
MUTABLE_KINDS = frozenset({TORCH_PREFIX + "pgo"})
# Dynamo's stored entries: traced again under the same key where the stored one was refused (torch failed to load
# it, or a check refused it), the fresh trace replaces it: the newest copy wins too (they are not merged as profiles).
PRECOMPILE_KIND = TORCH_PREFIX + "precompile"
NEWEST_WINS = MUTABLE_KINDS | {PRECOMPILE_KIND}

_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+\-]{0,254}")
_MAX_PATH_PARTS = 16


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a restore accepts (hostile-input limits)."""

    max_object_bytes: int = 512 << 20  # compressed, per object
    max_raw_bytes: int = 2 << 30  # decompressed, per object
    max_entries: int = 1_000_000


DEFAULT_LIMITS = Limits()


class Entry:
    """One stored thing: its kind, name, permission bits and bytes. The bytes are held in memory, or in a file of
    the session's scratch directory (a file entry a restore or a collect wrote there, so that compiled files are
    never all in memory at once), read when asked for. Immutable: what may change is where a file entry's bytes
    are read from (:meth:`moved`: a restore wrote them into place), never the bytes."""

    __slots__ = ("_data", "_digest", "_path", "kind", "mode", "name", "size")

    def __init__(self, kind: str, name: str, data: bytes = b"", mode: int = 0o644) -> None:
        self.kind = kind
        self.name = name
        self.mode = mode
        self.size = len(data)
        self._data: bytes | None = bytes(data)
        self._path: str | None = None
        self._digest: bytes | None = None

    @classmethod
    def in_file(cls, kind: str, name: str, path: str, size: int, mode: int = 0o644,
                digest: bytes | None = None) -> Entry:
        """An entry whose ``size`` bytes are the file ``path`` (which nothing else writes to); ``digest``: their
        SHA-256, where it is known (checked at every read then)."""
        entry = cls(kind, name, b"", mode)
        entry._data, entry._path, entry.size, entry._digest = None, path, size, digest
        return entry

    def moved(self, path: str) -> str:
        """The bytes are now the file ``path`` (a restore wrote them into place, or read them back): read from there
        from now on, checked against their digest (a file in a cache directory is not this session's alone: a
        changed copy is refused, never read as this entry). Returns the file they were read from until now (the
        caller removes it)."""
        if self._path is None or self._digest is None:
            raise ValueError("only a file entry whose digest is known can move")
        old, self._path = self._path, path
        return old

    @property
    def ident(self) -> tuple[str, str]:
        return (self.kind, self.name)

    @property
    def path(self) -> str | None:
        """The file holding the bytes, or None when they are in memory."""
        return self._path

    @property
    def digest(self) -> bytes | None:
        """The SHA-256 of the bytes of a file entry, where it was taken as they were written (else None)."""
        return self._digest

    @property
    def data(self) -> bytes:
        """The bytes (read from the file each time for an entry in a file)."""
        if self._data is not None:
            return self._data
        return b"".join(self.chunks())

    def chunks(self) -> Iterator[bytes]:
        """The bytes, a chunk at a time; raises BundleError when an entry's file no longer holds them (``size`` bytes,
        of its digest where that is known), before the last chunk."""
        if self._data is not None:
            yield self._data
            return
        assert self._path is not None
        left = self.size
        sha = hashlib.sha256() if self._digest is not None else None
        try:
            with open(self._path, "rb") as fh:
                while True:
                    chunk = fh.read(min(left, CHUNK)) if left > 0 else b""
                    left -= len(chunk)
                    if sha is not None:
                        sha.update(chunk)
                    if left == 0 or not chunk:  # the last chunk is given only once the whole file is checked
                        if left or fh.read(1) or (sha is not None and sha.digest() != self._digest):
                            raise BundleError(f"the copy of {self.name[:60]!r} at {self._path[-120:]} changed")
                        if chunk:
                            yield chunk
                        return
                    yield chunk
        except OSError as exc:
            raise BundleError(f"the copy of {self.name[:60]!r} at {self._path[-120:]} is unreadable: "
                              f"{exc.strerror or exc}") from exc

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes (fewer when there are fewer)."""
        if self._data is not None:
            return self._data[:n]
        out = b""
        for chunk in self.chunks():
            out += chunk[: n - len(out)]
            if len(out) >= n:
                break
        return out

    def with_data(self, data: bytes) -> Entry:
        return Entry(self.kind, self.name, data, self.mode)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return (self.ident, self.mode, self.size) == (other.ident, other.mode, other.size) and self.data == other.data

    def __hash__(self) -> int:
        return hash((self.kind, self.name, self.size))

    def __repr__(self) -> str:
        where = f", in {self._path!r}" if self._path is not None else ""
        return f"Entry(kind={self.kind!r}, name={self.name!r}, size={self.size}, mode={self.mode:#o}{where})"


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
        """Add ``items`` as :meth:`update` does, except that an entry of a kind whose newest copy wins (a
        dynamic-shape profile, a Dynamo entry: :data:`NEWEST_WINS`) replaces the one present: merge older sources
        first and the newest copy wins."""
        for entry in items:
            if entry.kind in NEWEST_WINS:
                self._items[entry.ident] = entry
            else:
                self.add(entry)

    def __eq__(self, other: object) -> bool:
        """The same entries (by ``(kind, name)``, then bytes), in any order."""
        if not isinstance(other, Entries):
            return NotImplemented
        return self._items == other._items

    __hash__ = None  # type: ignore[assignment]

    def __contains__(self, ident: object) -> bool:
        return ident in self._items

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def get(self, ident: tuple[str, str]) -> Entry | None:
        return self._items.get(ident)

    def minus(self, idents: Iterable[tuple[str, str]] | Entries) -> Entries:
        """The entries not in ``idents``. Against another :class:`Entries`, an entry of a kind whose newest copy
        wins (:data:`NEWEST_WINS`) whose data changed under its ident counts as new too (a grown profile, a Dynamo
        entry traced again where the stored one was refused, must be uploaded)."""
        if isinstance(idents, Entries):
            other = idents._items
            return Entries(e for e in self if e.ident not in other
                           or (e.kind in NEWEST_WINS and other[e.ident].data != e.data))
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
        return sum(e.size for e in self)

    def torch_container(self) -> bytes | None:
        """The torch entries as one torch container (one section per type), or None if there are none. Dynamo's
        stored entries are left out: they are files of torch's Dynamo cache as they are (:func:`.files.place_dynamo`),
        which a container would have held in memory three times over while torch loaded it."""
        torch_entries = [(e.kind[len(TORCH_PREFIX) :], e.name, e.data) for e in self.of_kind_prefix(TORCH_PREFIX)
                         if e.kind != PRECOMPILE_KIND]
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


def encoded_size(entry: Entry) -> int:
    """The bytes ``entry`` takes in a payload before compression."""
    return 15 + len(entry.kind.encode()) + len(entry.name.encode()) + entry.size
