"""An object's payload: its entries, compressed, written and read a chunk at a time.

Format 2 (what this plugin writes) is a zstd frame per group of entries, then the index, a zstd frame of::

    b"PMCI" | frame count (u32) | entry count (u32) | frames x (compressed size u64, raw size u64)
            | entries x (kind length u8, kind, name length u16, name, mode u32, frame u32, length u64)

A frame holds its entries' bytes back to back, in the index's order. Entries share a frame up to
:data:`FRAME_BYTES` in all (small compiled files compress far better together); an entry larger than that has a
frame of its own. So a reader that already holds some entries (the same graph stored by two shards) decompresses
only the frames holding one it lacks, and writes each file entry (and each entry of :data:`IN_FILE_BYTES` or more) to a
scratch file as it decompresses it: neither the payload nor the compiled files are ever all in memory.

Format 1 (read, never written) is one zstd frame of::

    b"PMCE" | count (u32) | count x (kind length u8, kind, name length u16, name, mode u32, data length u64, data)

Every read is bounded: a frame never produces more than its declared raw size + 1 bytes (the overflow of a bomb is
read and dropped a chunk at a time, never kept), the decompressor's window is at most :data:`MAX_WINDOW_BYTES`, the
index at most :data:`MAX_INDEX_BYTES`, and every size in the index must add up to what the (verified) header says.
Whatever the bytes, the readers raise :class:`.BundleError` for a defect (``zstandard.ZstdError`` is left to the
caller, which reports it as one).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import zstandard

from ..errors import BundleError, note_free
from .entries import CHUNK, FILE_PREFIX, MUTABLE_KINDS, Entries, Entry, Limits, validate_entry

ZSTD_LEVEL = 3
PAYLOAD_MAGIC = b"PMCE"
INDEX_MAGIC = b"PMCI"
# Entries share a frame up to this many raw bytes in all; a larger entry has a frame of its own.
FRAME_BYTES = 1 << 20
MAX_INDEX_BYTES = 64 << 20
# zstd's own default limit on the window a frame may ask for (2**27 = 128 MiB), stated explicitly: it bounds the
# decompressor's working memory whatever a hostile frame header says. Objects this plugin writes use far less.
MAX_WINDOW_BYTES = 1 << 27
_FRAME_HEADER_MAX = 18  # ZSTD_FRAMEHEADERSIZE_MAX
# With a scratch directory, an entry goes to a file of its own as it is decompressed where it is a file, or this
# large (a Dynamo entry: a session that held them all in memory held their bytes for its whole life, once torch had
# them too); smaller torch entries stay in memory.
IN_FILE_BYTES = 256 << 10


def _in_file(kind: str, length: int) -> bool:
    return kind.startswith(FILE_PREFIX) or length >= IN_FILE_BYTES


class Source:
    """An object's bytes, read by position: in memory, or in a file (never read whole)."""

    def __init__(self, size: int, read_at: Callable[[int, int], bytes]) -> None:
        self.size = size
        self.read_at = read_at

    @classmethod
    def of_bytes(cls, blob: bytes) -> Source:
        view = memoryview(blob)
        return cls(len(blob), lambda offset, n: bytes(view[offset:offset + n]))

    @classmethod
    def of_file(cls, fh: BinaryIO) -> Source:
        def read_at(offset: int, n: int) -> bytes:
            fh.seek(offset)
            return fh.read(n)

        return cls(fh.seek(0, os.SEEK_END), read_at)

    def digest(self, offset: int) -> bytes:
        """The SHA-256 of everything from ``offset`` on."""
        sha = hashlib.sha256()
        for chunk in self.region(offset, self.size - offset):
            sha.update(chunk)
        return sha.digest()

    def region(self, offset: int, length: int) -> _Region:
        return _Region(self, offset, min(length, max(0, self.size - offset)))


class _Region:
    """``length`` bytes of a source from ``offset``, as a readable stream (what zstd's stream reader reads)."""

    def __init__(self, source: Source, offset: int, length: int) -> None:
        self.source, self.pos, self.end = source, offset, offset + length

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        if n <= 0:
            return b""
        data = self.source.read_at(self.pos, n)
        self.pos += len(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        return iter(lambda: self.read(CHUNK), b"")


class _RawStream:
    """A frame decompressed, as a stream of exactly ``raw_size`` bytes (its declaration): entries are read from it
    one at a time, into memory or into a file."""

    def __init__(self, reader: Any, raw_size: int) -> None:
        self.reader = reader
        self.raw_size = raw_size
        self.pos = 0

    def _chunks(self, n: int, what: str) -> Iterator[bytes]:
        if n > self.raw_size - self.pos:
            raise BundleError(f"payload truncated in {what}")
        left = n
        while left:
            chunk: bytes = self.reader.read(min(left, CHUNK))
            if not chunk:
                raise BundleError(f"payload truncated in {what}")
            left -= len(chunk)
            self.pos += len(chunk)
            yield chunk

    def take(self, n: int, what: str) -> bytes:
        chunks = list(self._chunks(n, what))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def skip(self, n: int, what: str) -> None:
        for _chunk in self._chunks(n, what):
            pass

    def to_file(self, kind: str, name: str, mode: int, n: int, what: str, scratch_dir: str) -> Entry:
        """The next ``n`` bytes as a new file of ``scratch_dir``: the entry it holds (with its digest, so that a
        restore may move it into place and read it from there)."""
        fd, path = tempfile.mkstemp(dir=scratch_dir, suffix=".entry")
        sha = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in self._chunks(n, what):
                    sha.update(chunk)
                    fh.write(chunk)
        except BaseException as exc:  # a full disk, a defect found: no part of it stays
            note_free(exc, path)
            os.unlink(path)
            raise
        return Entry.in_file(kind, name, path, n, mode, sha.digest())

    def produced(self) -> int:
        """How many bytes the frame decompresses to, counted up to ``raw_size + 1`` at most (the rest is read and
        dropped, a chunk at a time)."""
        total = self.pos
        while total <= self.raw_size:
            chunk = self.reader.read(min(CHUNK, self.raw_size + 1 - total))
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

    def finish(self) -> None:
        """Refuse a frame that holds more or less than its entries."""
        if self.pos != self.raw_size:
            raise self.refusal(BundleError(f"{self.raw_size - self.pos} trailing bytes after the last entry"))
        if self.produced() != self.raw_size:
            raise self.refusal(BundleError("decompressed size disagrees with the header"))


def _decompressor(source: Any) -> Any:
    return zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(source, read_across_frames=False)


def _entry_head(kind: str, name: str, mode: int) -> bytes:
    k, n = kind.encode(), name.encode()
    return len(k).to_bytes(1, "big") + k + len(n).to_bytes(2, "big") + n + (mode & 0o777).to_bytes(4, "big")


@dataclass(frozen=True)
class Written:
    """What :func:`write` wrote: the payload's SHA-256 and size, its raw size (frames and index decompressed) and
    the size of its index (the payload's last bytes)."""

    sha256: bytes
    size: int
    raw_size: int
    index_size: int


class _Hashing:
    def __init__(self, out: BinaryIO) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        if data:
            self.out.write(data)
            self.sha.update(data)
            self.size += len(data)


def frames_of(entries: Entries) -> list[list[Entry]]:
    """Entries in frames: consecutive ones up to :data:`FRAME_BYTES` together, a larger one alone."""
    frames: list[list[Entry]] = []
    frame: list[Entry] = []
    size = 0
    for entry in entries:
        if frame and size + entry.size > FRAME_BYTES:
            frames.append(frame)
            frame, size = [], 0
        frame.append(entry)
        size += entry.size
    if frame:
        frames.append(frame)
    return frames


def write(out: BinaryIO, entries: Entries) -> Written:
    """Write ``entries`` as a format-2 payload to ``out``, an entry a chunk at a time."""
    sink = _Hashing(out)
    table: list[tuple[int, int]] = []
    index: list[bytes] = []
    frames = frames_of(entries)
    for number, frame in enumerate(frames):
        raw = sum(e.size for e in frame)
        start = sink.size
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=raw)
        for entry in frame:
            validate_entry(entry.kind, entry.name)
            index.append(_entry_head(entry.kind, entry.name, entry.mode) + number.to_bytes(4, "big")
                         + entry.size.to_bytes(8, "big"))
            for chunk in entry.chunks():
                sink.write(compressor.compress(chunk))
        sink.write(compressor.flush())
        table.append((sink.size - start, raw))
    body = (INDEX_MAGIC + len(frames).to_bytes(4, "big") + len(entries).to_bytes(4, "big")
            + b"".join(c.to_bytes(8, "big") + r.to_bytes(8, "big") for c, r in table) + b"".join(index))
    if len(body) > MAX_INDEX_BYTES:
        raise ValueError(f"an index of {len(body)} bytes is over the limit of {MAX_INDEX_BYTES}")
    before = sink.size
    sink.write(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(body))
    return Written(sink.sha.digest(), sink.size, sum(r for _c, r in table) + len(body), sink.size - before)


@dataclass(frozen=True)
class _Item:
    kind: str
    name: str
    mode: int
    frame: int
    length: int


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise BundleError(f"index truncated in {what}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def number(self, n: int, what: str) -> int:
        return int.from_bytes(self.take(n, what), "big")


def _parse_index(body: bytes, limits: Limits) -> tuple[list[tuple[int, int]], list[_Item]]:
    cur = _Cursor(body)
    if cur.take(4, "magic") != INDEX_MAGIC:
        raise BundleError("index magic missing")
    frames, count = cur.number(4, "frame count"), cur.number(4, "entry count")
    if count > limits.max_entries:
        raise BundleError(f"index declares {count} entries, over the limit of {limits.max_entries}")
    if frames > count:
        raise BundleError("index declares more frames than entries")
    table = [(cur.number(8, "frame table"), cur.number(8, "frame table")) for _ in range(frames)]
    items: list[_Item] = []
    for _ in range(count):
        kind = cur.take(cur.number(1, "kind length"), "kind").decode("ascii", errors="replace")
        try:
            name = cur.take(cur.number(2, "name length"), "name").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError("entry name is not UTF-8") from exc
        validate_entry(kind, name)
        items.append(_Item(kind, name, cur.number(4, "mode") & 0o755, cur.number(4, "frame"), cur.number(8, "length")))
    if cur.pos != len(body):
        raise BundleError(f"{len(body) - cur.pos} trailing bytes after the index")
    return table, items


def _members(table: Sequence[tuple[int, int]], items: Sequence[_Item]) -> list[list[_Item]]:
    """The index's entries per frame; refused unless every frame holds entries, in order, that fill it exactly."""
    members: list[list[_Item]] = [[] for _ in table]
    last = 0
    for item in items:
        if not last <= item.frame < len(table):
            raise BundleError("index lists entries out of frame order")
        members[item.frame].append(item)
        last = item.frame
    for (_size, raw), group in zip(table, members, strict=True):
        if not group or sum(item.length for item in group) != raw:
            raise BundleError("a frame's entries do not fill it")
    return members


@dataclass
class Decoded:
    """What a reader returns: the entries and how many of their bytes it decompressed (those of the frames it
    skipped are not; the index is not counted)."""

    entries: Entries
    decompressed: int


def read_framed(src: Source, offset: int, payload_size: int, raw_size: int, index_size: int, count: int,
                limits: Limits, scratch_dir: str | None = None, held: Entries | None = None) -> Decoded:
    """The entries of a format-2 payload at ``offset`` (its SHA-256 checked by the caller). With ``scratch_dir``, file
    entries (and large ones: :data:`IN_FILE_BYTES`) are written there, each as it is decompressed. With ``held``, an
    entry of the same ``(kind, name)`` there (not a mutable one: a profile is read anew) stands for this one's copy,
    and a frame all of whose entries are held is not decompressed at all."""
    if not 0 < index_size <= payload_size:
        raise BundleError("index size out of range")
    reader = _decompressor(src.region(offset + payload_size - index_size, index_size))
    with reader:
        body = reader.read(MAX_INDEX_BYTES + 1)
    if len(body) > MAX_INDEX_BYTES:
        raise BundleError(f"index expands past {MAX_INDEX_BYTES} bytes")
    table, items = _parse_index(body, limits)
    if len(items) != count:
        raise BundleError("entry count disagrees with the header")
    if sum(c for c, _r in table) != payload_size - index_size:
        raise BundleError("the frames' sizes disagree with the header")
    if sum(r for _c, r in table) + len(body) != raw_size:
        raise BundleError("decompressed size disagrees with the header")
    entries = Entries()
    decompressed = 0
    start = offset
    for (size, raw), group in zip(table, _members(table, items), strict=True):
        have = [held.get((i.kind, i.name)) if held is not None and i.kind not in MUTABLE_KINDS else None for i in group]
        frame_at, start = start, start + size
        if all(h is not None for h in have):
            for entry in have:
                assert entry is not None
                if not entries.add(entry):
                    raise BundleError(f"duplicate entry {entry.kind}:{entry.name[:60]}")
            continue
        decompressed += raw
        with _decompressor(src.region(frame_at, size)) as frame_reader:
            stream = _RawStream(frame_reader, raw)
            try:
                for item, mine in zip(group, have, strict=True):
                    what = f"data of {item.name[:60]!r}"
                    if mine is not None:
                        stream.skip(item.length, what)
                        entry = mine
                    elif scratch_dir is not None and _in_file(item.kind, item.length):
                        entry = stream.to_file(item.kind, item.name, item.mode, item.length, what, scratch_dir)
                    else:
                        entry = Entry(item.kind, item.name, stream.take(item.length, what), item.mode)
                    if not entries.add(entry):
                        raise BundleError(f"duplicate entry {item.kind}:{item.name[:60]}")
            except BundleError as exc:
                raise stream.refusal(exc) from None
            stream.finish()
    return Decoded(entries, decompressed)


def read_v1(src: Source, offset: int, raw_size: int, limits: Limits, scratch_dir: str | None = None) -> Decoded:
    """The entries of a format-1 payload (one zstd frame) at ``offset``; with ``scratch_dir``, file entries (and
    large ones: :data:`IN_FILE_BYTES`) are written there as they are decompressed."""
    payload = src.region(offset, src.size - offset)
    params = zstandard.get_frame_parameters(src.read_at(offset, _FRAME_HEADER_MAX))
    if params.content_size not in (zstandard.CONTENTSIZE_UNKNOWN, raw_size):
        raise BundleError("zstd frame size disagrees with the header")
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(cast(Any, payload),
                                                                                     read_across_frames=True)
    with reader:
        raw = _RawStream(reader, raw_size)
        try:
            entries = _v1_entries(raw, limits, scratch_dir)
        except BundleError as exc:
            raise raw.refusal(exc) from None
        raw.finish()
    return Decoded(entries, entries.raw_bytes())


def _v1_entries(raw: _RawStream, limits: Limits, scratch_dir: str | None) -> Entries:
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
        what = f"data of {name[:60]!r}"
        if scratch_dir is not None and _in_file(kind, data_len):
            entry = raw.to_file(kind, name, mode, data_len, what, scratch_dir)
        else:
            entry = Entry(kind, name, take(data_len, what), mode)
        if not entries.add(entry):
            raise BundleError(f"duplicate entry {kind}:{name[:60]}")
    return entries
