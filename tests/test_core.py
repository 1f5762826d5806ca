"""The cache flow without torch: merge, upload only what is new, compaction, concurrent writers.

torch is replaced here by a recorder that returns torch-format containers (the integration tests use
the real thing); the store is the in-memory reference store or a real local directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache import torchfmt
from pytest_megacache.core import CacheSession
from pytest_megacache.files import FileRoot
from pytest_megacache.stores import LocalDirStore, MemoryStore, Store

FP = "torch-2.13.0/cpu-avx2-t2/py3.11-linux-x86_64/0123456789ab"
FOLDER = f"pytest-megacache/{FP}"


class FakeTorch:
    """Stands in for TorchAdapter: 'compiles' the given keys, records loads."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.loaded: list[list[tuple[str, str, bytes]]] = []
        self.compiles = len(keys)
        self.compile_seconds = 0.5 * len(keys)

    def save(self) -> bytes | None:
        if not self.keys:
            return None
        return torchfmt.serialize([("inductor", k, f"graph {k}".encode()) for k in self.keys])

    def compiled_anything(self) -> bool:
        return bool(self.keys)

    def counters(self) -> dict[str, int]:
        return {"fxgraph_cache_miss": len(self.keys)}

    def load(self, container: bytes) -> Any:
        from pytest_megacache.torch_adapter import LoadResult

        parsed = torchfmt.parse(container)
        self.loaded.append(parsed)
        return LoadResult(True, {"inductor": len(parsed)})


def session(store: Store, tmp_path: Path, name: str, compact_after: int = 8, mode: str = "readwrite") -> CacheSession:
    return CacheSession(
        store_factory=lambda: store,
        folder=FOLDER,
        fingerprint=FP,
        roots=[FileRoot("inductor", tmp_path / name / "inductor")],
        reads=mode in ("readwrite", "read"),
        writes=mode in ("readwrite", "write"),
        compact_after=compact_after,
    )


def run(store: Store, tmp_path: Path, name: str, keys: list[str], **kw: Any) -> tuple[CacheSession, FakeTorch]:
    s = session(store, tmp_path, name, **kw)
    torch = FakeTorch(keys)
    s.start_restore(background=False)
    s.load_into_torch(5, loader=torch.load)
    s.finish(torch, 5)  # type: ignore[arg-type]
    return s, torch


def stored_keys(store: MemoryStore) -> set[str]:
    keys: set[str] = set()
    for (_folder, _name), (blob, _t) in store.objects.items():
        _header, entries = bundlemod.decode(blob, FP)
        keys |= {e.name for e in entries}
    return keys


KEY_A, KEY_B, KEY_C = "fa" + "a" * 50, "fb" + "b" * 50, "fc" + "c" * 50


def test_two_writers_in_sequence_keep_both(tmp_path: Path) -> None:
    store = MemoryStore()
    first, _ = run(store, tmp_path, "one", [KEY_A])
    assert first.upload_stats.new_entries == {"torch/inductor": 1}
    second, torch2 = run(store, tmp_path, "two", [KEY_A, KEY_B])
    # The second restored A, so it uploads only B, as a second immutable object.
    assert [k for _t, k, _c in torch2.loaded[0]] == [KEY_A]
    assert second.upload_stats.new_entries == {"torch/inductor": 1}
    assert len(store.objects) == 2
    assert stored_keys(store) == {KEY_A, KEY_B}


def test_a_subset_session_uploads_nothing_and_shrinks_nothing(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "full", [KEY_A, KEY_B])
    before = dict(store.objects)
    subset, torch = run(store, tmp_path, "subset", [KEY_A])
    assert len(torch.loaded[0]) == 2  # everything restored is offered to torch
    assert subset.upload_stats.reason == "nothing new"
    assert store.objects == before


def test_concurrent_writers_never_overwrite_each_other(tmp_path: Path) -> None:
    """Two sessions restore the same (empty) state, then both upload: both objects survive."""
    store = MemoryStore()
    s1, s2 = session(store, tmp_path, "a"), session(store, tmp_path, "b")
    for s in (s1, s2):
        s.start_restore(background=False)
    s1.finish(FakeTorch([KEY_A]), 5)  # type: ignore[arg-type]
    s2.finish(FakeTorch([KEY_B]), 5)  # type: ignore[arg-type]
    assert len(store.objects) == 2
    assert stored_keys(store) == {KEY_A, KEY_B}


def test_compaction_deletes_only_what_it_merged(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "one", [KEY_A])
    run(store, tmp_path, "two", [KEY_B])
    compactor = session(store, tmp_path, "three", compact_after=2)
    compactor.start_restore(background=False)
    # Another writer's object lands after the compactor listed the folder.
    late, _ = run(store, tmp_path, "late", [KEY_C])
    compactor.finish(FakeTorch([KEY_A, KEY_B, "fd" + "d" * 50]), 5)  # type: ignore[arg-type]
    assert compactor.upload_stats.compacted == 2
    assert len(store.objects) == 2  # the merged whole + the late writer's object
    assert stored_keys(store) == {KEY_A, KEY_B, KEY_C, "fd" + "d" * 50}
    assert late.upload_stats.objects == 1


def test_restore_is_bounded_as_objects_pile_up(tmp_path: Path) -> None:
    store = MemoryStore()
    for i in range(12):
        run(store, tmp_path, f"w{i}", [f"f{i:02d}" + "x" * 48], compact_after=4)
    assert len(store.objects) <= 4
    assert len(stored_keys(store)) == 12


def test_read_mode_and_failed_uploads(tmp_path: Path) -> None:
    store = MemoryStore()
    reader, _ = run(store, tmp_path, "r", [KEY_A], mode="read")
    assert reader.upload_stats.reason == "read-only mode" and not store.objects

    class FullDisk(LocalDirStore):
        def put(self, folder: str, name: str, data: bytes) -> None:
            raise __import__("pytest_megacache.errors").errors.StoreError("No space left on device", "io")

    broken, _ = run(FullDisk(tmp_path / "store"), tmp_path, "w", [KEY_A])
    assert broken.upload_stats.reason == "upload failed"
    assert broken.problems == ["upload: No space left on device"]


def test_invalid_torch_output_is_not_uploaded(tmp_path: Path) -> None:
    class Hostile(FakeTorch):
        def save(self) -> bytes | None:
            return torchfmt.serialize([("inductor", KEY_A, b"x")])[:-2]  # truncated, CRC now wrong

    s = session(MemoryStore(), tmp_path, "h")
    s.start_restore(background=False)
    s.finish(Hostile([KEY_A]), 5)  # type: ignore[arg-type]
    assert any("failed validation" in p for p in s.problems)
    assert s.upload_stats.reason == "nothing new"


def test_files_travel_and_restore_without_overwriting(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    cold = session(store, tmp_path, "cold")
    cold.start_restore(background=False)
    kernel = tmp_path / "cold" / "inductor" / "ab" / "cabc.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF")
    (tmp_path / "cold" / "inductor" / "locks").mkdir()
    (tmp_path / "cold" / "inductor" / "locks" / "cabc.lock").write_text("")
    cold.finish(FakeTorch([KEY_A]), 5)  # type: ignore[arg-type]
    assert cold.upload_stats.new_entries == {"file/inductor": 1, "torch/inductor": 1}

    existing = tmp_path / "warm" / "inductor" / "ab" / "cabc.so"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"mine")
    warm = session(store, tmp_path, "warm")
    warm.start_restore(background=False)
    assert (warm.restore_stats.files_written, warm.restore_stats.files_present) == (0, 1)
    assert existing.read_bytes() == b"mine"


@pytest.mark.parametrize("background", [True, False])
def test_restore_thread_reports_problems_once(tmp_path: Path, background: bool) -> None:
    store = MemoryStore()
    store.objects[(FOLDER, "20260101T000000-1-aaaaaa.mcb")] = (b"junk", 0.0)
    s = session(store, tmp_path, "x")
    s.start_restore(background=background)
    assert s.wait_restore(5)
    assert s.new_problems() == [f"refused {FOLDER}/20260101T000000-1-aaaaaa.mcb: not a pytest-megacache bundle (bad magic)"]
    assert s.new_problems() == []
