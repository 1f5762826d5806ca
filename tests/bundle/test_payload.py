"""Format 2: frames and an index, written and read a chunk at a time; entries already held are not decompressed
again; compiled files go to scratch files; whatever the index says, a reader refuses what does not add up."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import zstandard

from pytest_megacache import bundle
from pytest_megacache.bundle import Entries, Entry, payload
from pytest_megacache.errors import BundleError

FP = "torch-2.13.0/cpu-avx2-t4/py3.11-linux-x86_64"
BIG = payload.FRAME_BYTES + 1


def noise(n: int, seed: int) -> bytes:
    """``n`` bytes zstd cannot shrink (so sizes on disk say what was written)."""
    return random.Random(seed).randbytes(n)


def sample() -> Entries:
    return Entries([
        Entry("torch/inductor", "fabc0123456789", b"graph" * 40),
        Entry("file/inductor", "ab/cabc123def.so", b"\x7fELF" + noise(5000, 1), 0o755),
        Entry("file/pch", "0123456789abcdef.h.gch", b"gpch" + noise(BIG, 2)),
        Entry("file/triton", "deadbeef/kernel.cubin", b"cubin", 0o644),
    ])


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    size = int.from_bytes(blob[5:9], "big")
    return json.loads(blob[9:9 + size]), blob[9 + size:]


def join(doc: dict[str, Any], body: bytes) -> bytes:
    """An object from a header and a payload, the digest and sizes made to match (what a writer without a key,
    or a buggy one, could store)."""
    doc = {**doc, "payload_size": len(body), "payload_sha256": hashlib.sha256(body).hexdigest()}
    header = json.dumps(doc).encode()
    return bundle.MAGIC + bytes([doc["format"]]) + len(header).to_bytes(4, "big") + header + body


def rebuild(frames: list[bytes], table: list[tuple[int, int]], items: list[tuple[str, str, int, int, int]],
            doc: dict[str, Any], raw_extra: int = 0) -> bytes:
    """A format-2 object from frames and an index given piece by piece."""
    index = (payload.INDEX_MAGIC + len(table).to_bytes(4, "big") + len(items).to_bytes(4, "big")
             + b"".join(c.to_bytes(8, "big") + r.to_bytes(8, "big") for c, r in table)
             + b"".join(payload._entry_head(k, n, m) + f.to_bytes(4, "big") + ln.to_bytes(8, "big")
                        for k, n, m, f, ln in items))
    packed = zstandard.ZstdCompressor().compress(index)
    raw = sum(r for _c, r in table) + len(index) + raw_extra
    return join({**doc, "index_size": len(packed), "raw_size": raw, "entries": len(items)},
                b"".join(frames) + packed)


def read(blob: bytes, **kw: Any) -> tuple[bundle.Header, payload.Decoded]:
    return bundle.read_object(io.BytesIO(blob), FP, **kw)  # type: ignore[arg-type]


# --- writing ---------------------------------------------------------------------------------------------

def test_small_entries_share_a_frame_and_a_large_one_has_its_own() -> None:
    frames = payload.frames_of(sample())
    assert [[e.name for e in f] for f in frames] == [
        ["fabc0123456789", "ab/cabc123def.so"], ["0123456789abcdef.h.gch"], ["deadbeef/kernel.cubin"]]


def test_memory_and_file_writers_make_the_same_payload(tmp_path: Path) -> None:
    entries = sample()
    blob = bundle.encode(entries, FP, extra={"run": "x"})
    header, size = bundle.write_object(tmp_path / "o.mcb", entries, FP, extra={"run": "x"})
    on_disk = (tmp_path / "o.mcb").read_bytes()
    assert size == len(on_disk) and header.version == bundle.FORMAT_FRAMED
    assert split(on_disk)[1] == split(blob)[1]  # the headers differ only by their time
    assert bundle.decode(on_disk, FP)[1] == entries == bundle.decode(blob, FP)[1]
    assert sorted(os.listdir(tmp_path)) == ["o.mcb"]  # the payload's own file is gone


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    gone = Entry.in_file("file/inductor", "ab/x.so", str(tmp_path / "missing"), 10)
    with pytest.raises(BundleError, match="unreadable"):
        bundle.write_object(tmp_path / "o.mcb", Entries([gone]), FP)
    assert os.listdir(tmp_path) == []


def test_an_entry_whose_scratch_file_changed_size_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "e"
    path.write_bytes(b"12345")
    entry = Entry.in_file("file/inductor", "ab/x.so", str(path), 4)
    with pytest.raises(BundleError, match="changed"):
        bundle.encode(Entries([entry]), FP)


def test_an_entry_whose_file_changed_in_place_is_refused_by_its_digest_before_its_last_chunk(tmp_path: Path) -> None:
    path = tmp_path / "e"
    data = b"k" * (payload.CHUNK + 10)
    path.write_bytes(data)
    entry = Entry.in_file("file/inductor", "ab/x.so", str(path), len(data), digest=hashlib.sha256(data).digest())
    assert entry.data == data
    path.write_bytes(data[:-1] + b"j")  # the same size
    got: list[bytes] = []
    with pytest.raises(BundleError, match="changed"):
        got.extend(entry.chunks())
    assert got == [data[:payload.CHUNK]]  # what was given before the check is never the whole
    with pytest.raises(BundleError, match="changed"):
        bundle.encode(Entries([entry]), FP)


# --- reading ---------------------------------------------------------------------------------------------

def test_file_entries_go_to_scratch_files_and_torch_entries_stay_in_memory(tmp_path: Path) -> None:
    entries = sample()
    header, decoded = read(bundle.encode(entries, FP), scratch_dir=str(tmp_path))
    assert decoded.entries == entries
    paths = {e.kind: e.path for e in decoded.entries}
    assert paths["torch/inductor"] is None
    assert all(Path(str(paths[k])).parent == tmp_path for k in ("file/inductor", "file/pch", "file/triton"))
    assert len(os.listdir(tmp_path)) == 3
    assert decoded.decompressed == entries.raw_bytes() and header.entries == 4
    assert all(e.digest == hashlib.sha256(e.data).digest() for e in decoded.entries if e.path is not None)



def test_a_large_torch_entry_goes_to_a_scratch_file_too(tmp_path: Path) -> None:
    """A Dynamo entry is MBs: held in memory, a session held every one it restored for its whole life (about 150 MB on
    a tensor-container suite), once torch had them too."""
    big = Entry("torch/precompile", "p" * 64, random.Random(1).randbytes(payload.IN_FILE_BYTES))
    small = Entry("torch/inductor", "fa" + "a" * 50, b"graph")
    _header, decoded = read(bundle.encode(Entries([big, small]), FP), scratch_dir=str(tmp_path))
    got_big, got_small = decoded.entries.get(big.ident), decoded.entries.get(small.ident)
    assert got_big is not None and got_big.path is not None and Path(got_big.path).parent == tmp_path
    assert got_big.data == big.data and got_big.digest == hashlib.sha256(big.data).digest()
    assert got_small is not None and got_small.path is None and got_small.data == b"graph"

def test_a_format_1_object_is_still_read_and_its_files_go_to_scratch(tmp_path: Path) -> None:
    entries = sample()
    raw = payload.PAYLOAD_MAGIC + len(entries).to_bytes(4, "big") + b"".join(
        payload._entry_head(e.kind, e.name, e.mode) + e.size.to_bytes(8, "big") + e.data for e in entries)
    body = zstandard.ZstdCompressor().compress(raw)
    blob = join({"format": 1, "fingerprint": FP, "raw_size": len(raw), "entries": 4, "created": 1.0}, body)
    header, decoded = read(blob, scratch_dir=str(tmp_path))
    assert header.version == 1 and decoded.entries == entries
    assert sum(e.path is not None for e in decoded.entries) == 3


def test_held_entries_are_not_decompressed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = sample()
    blob = bundle.encode(entries, FP)
    pch = entries.get(("file/pch", "0123456789abcdef.h.gch"))
    assert pch is not None
    held = Entries([pch, Entry("torch/inductor", "fabc0123456789", b"graph" * 40)])
    opened: list[int] = []
    real = payload._decompressor

    def counting(source: Any) -> Any:
        opened.append(getattr(source, "end", 0) - getattr(source, "pos", 0))
        return real(source)

    monkeypatch.setattr(payload, "_decompressor", counting)
    _header, decoded = read(blob, scratch_dir=str(tmp_path), held=held)
    assert decoded.entries == entries
    assert decoded.entries.get(pch.ident) is pch  # the held copy stands for this one
    # The index and the two frames not wholly held: the large entry's frame was never opened.
    assert len(opened) == 3
    assert decoded.decompressed == entries.raw_bytes() - pch.size
    # A frame partly held is decompressed; its held entry is skipped, not copied again.
    assert sorted(e.name for e in decoded.entries if e.path is not None and Path(e.path).parent == tmp_path) == [
        "ab/cabc123def.so", "deadbeef/kernel.cubin"]


def test_a_held_profile_does_not_stand_for_a_newer_one() -> None:
    mine = Entries([Entry("torch/pgo", "code_state_x", b"new")])
    held = Entries([Entry("torch/pgo", "code_state_x", b"old")])
    _header, decoded = read(bundle.encode(mine, FP), held=held)
    assert decoded.entries.get(("torch/pgo", "code_state_x")) == Entry("torch/pgo", "code_state_x", b"new")


# --- hostile indexes and frames ---------------------------------------------------------------------------

def pieces() -> tuple[dict[str, Any], list[bytes], list[tuple[int, int]], list[tuple[str, str, int, int, int]]]:
    a, b = noise(300, 3), noise(200, 4)
    frames = [zstandard.ZstdCompressor().compress(a), zstandard.ZstdCompressor().compress(b)]
    table = [(len(frames[0]), len(a)), (len(frames[1]), len(b))]
    items = [("file/inductor", "ab/a.so", 0o644, 0, 300), ("file/triton", "cd/b.cubin", 0o644, 1, 200)]
    return {"format": 2, "fingerprint": FP, "created": 1.0}, frames, table, items


def test_a_hand_built_object_reads() -> None:
    doc, frames, table, items = pieces()
    _header, decoded = read(rebuild(frames, table, items, doc))
    assert [e.size for e in decoded.entries] == [300, 200]


@pytest.mark.parametrize(("change", "message"), [
    ("entries out of frame order", "out of frame order"),
    ("frame not filled", "do not fill it"),
    ("frame sizes", "frames' sizes disagree"),
    ("raw size", "decompressed size disagrees"),
    ("frame expands", "expands past its declared raw size"),
    ("empty frame", "more frames than entries"),
    ("unsafe name", "unsafe file path"),
    ("duplicate", "duplicate entry"),
])
def test_an_index_that_does_not_add_up_is_refused(change: str, message: str) -> None:
    doc, frames, table, items = pieces()
    extra = 0
    if change == "entries out of frame order":
        items = [items[1], items[0]]
    elif change == "frame not filled":
        items[0] = (*items[0][:4], 299)
    elif change == "frame sizes":
        table[0] = (table[0][0] - 1, table[0][1])
    elif change == "raw size":
        extra = 1
    elif change == "frame expands":  # the frame says less than it holds
        items[0] = (*items[0][:4], 100)
        table[0] = (table[0][0], 100)
    elif change == "empty frame":
        table.append((0, 0))
    elif change == "unsafe name":
        items[0] = ("file/inductor", "../a.so", 0o644, 0, 300)
    elif change == "duplicate":
        items[1] = ("file/inductor", "ab/a.so", 0o644, 1, 200)
    with pytest.raises(BundleError, match=message):
        read(rebuild(frames, table, items, doc, extra))


def test_an_index_bomb_is_refused_without_being_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "MAX_INDEX_BYTES", 1000)
    doc, frames, table, items = pieces()
    blob = rebuild(frames, table, items * 40, doc)
    with pytest.raises(BundleError, match="index expands past 1000 bytes"):
        read(blob)


def test_an_index_size_past_the_payload_is_refused() -> None:
    doc, frames, table, items = pieces()
    head, body = split(rebuild(frames, table, items, doc))
    with pytest.raises(BundleError, match="index size out of range"):
        read(join({**head, "index_size": len(body) + 1}, body))


def test_signed_format_2_objects_verify_before_the_index_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    key = b"k" * 32
    blob = bundle.encode(sample(), FP, signing_key=key)
    assert bundle.decode(blob, FP, verify_keys=[key])[1] == sample()

    def never(*_a: object, **_k: object) -> object:
        raise AssertionError("the payload was read before the signature was checked")

    head, body = split(blob)
    forged = join({**head, "index_size": head["index_size"]}, body[:-1] + bytes([body[-1] ^ 1]))
    monkeypatch.setattr(payload, "read_framed", never)
    with pytest.raises(bundle.SignatureError):
        bundle.decode(forged, FP, verify_keys=[key])
