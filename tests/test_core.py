"""The cache flow without torch: merge, upload only what is new, compaction, concurrent writers.

torch is replaced here by a recorder that returns torch-format containers (the integration tests use
the real thing); the store is the in-memory reference store or a real local directory.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache import torchfmt, upload
from pytest_megacache.core import CacheSession, nearest_fingerprint
from pytest_megacache.files import FileRoot
from pytest_megacache.stores import LocalDirStore, MemoryStore, Store
from pytest_megacache.torch_adapter import CompileRecord

from .conftest import fake_elf

FP = "torch-2.13.0/cpu-avx2-t2/py3.11-linux-x86_64/0123456789ab"
FOLDER = f"pytest-megacache/{FP}"


class FakeTorch:
    """Stands in for TorchAdapter: 'compiles' the given keys, records loads."""

    spared_before = cost_before = tracing_before = completing_before = 0.0  # no Dynamo reuse here

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.loaded: list[list[tuple[str, str, bytes]]] = []
        self.compiles = len(keys)
        self.compile_seconds = 0.5 * len(keys)
        self.per_test = {"test_all": CompileRecord(self.compile_seconds, len(keys), self.counters(),
                                                 [("inductor", k) for k in keys])} if keys else {}

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


def session(store: Store, tmp_path: Path, name: str, compact_after: int = 8, mode: str = "readwrite",
            scope: str | None = None, meta: dict[str, Any] | None = None) -> CacheSession:
    return CacheSession(
        store_factory=lambda: store,
        folder=f"pytest-megacache/{scope}/{FP}" if scope else FOLDER,
        read_folders=[f"pytest-megacache/{scope}/{FP}", f"pytest-megacache/main/{FP}"] if scope else None,
        meta=meta,
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
    s.load_into_torch(loader=torch.load)
    s.finish(torch)  # type: ignore[arg-type]
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


class PutTogether:
    """A session's view of a shared store whose first put waits until the other session's reaches the store too."""

    def __init__(self, inner: Store, barrier: threading.Barrier) -> None:
        self.inner, self.label, self.barrier = inner, inner.label, barrier

    def put_file(self, folder: str, name: str, path: str) -> None:
        self.barrier.wait()
        self.inner.put_file(folder, name, path)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


def finish_at_once(store: Store, tmp_path: Path, keys: list[list[str]]) -> list[CacheSession]:
    """Sessions that restored the same (empty) state, then upload at one moment, each from a thread of its own."""
    barrier = threading.Barrier(len(keys), timeout=30)
    sessions = [session(PutTogether(store, barrier), tmp_path, f"s{i}") for i in range(len(keys))]  # type: ignore[arg-type]
    for s in sessions:
        s.start_restore(background=False)
    threads = [threading.Thread(target=s.finish, args=(FakeTorch(k),)) for s, k in zip(sessions, keys, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads) and not barrier.broken
    return sessions


def stored_in(store: Store) -> dict[str, set[str]]:
    out = {}
    for info in store.list(FOLDER):
        blob = store.get(FOLDER, info.name, 1 << 30)
        assert blob is not None
        out[info.name] = {e.name for e in bundlemod.decode(blob, FP)[1]}
    return out


def test_concurrent_writers_never_overwrite_each_other(shared: Store, tmp_path: Path) -> None:
    """Two sessions upload at one moment to a real store (a directory, S3): each object is stored whole."""
    sessions = finish_at_once(shared, tmp_path, [[KEY_A], [KEY_B]])
    assert all(not s.problems for s in sessions)
    assert sorted(stored_in(shared).values(), key=sorted) == [{KEY_A}, {KEY_B}]


def test_concurrent_writers_of_one_name_never_overwrite_each_other(shared: Store, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Were two sessions to draw the same object name, at one moment: one object is stored and stays, and the other
    session says its upload failed (it does not believe it stored what another replaced)."""
    monkeypatch.setattr(upload, "new_object_name", lambda: "20260101T000000000-1-000000000000.mcb")
    sessions = finish_at_once(shared, tmp_path, [[KEY_A], [KEY_B]])
    [(stored, keys)] = stored_in(shared).items()
    assert stored == "20260101T000000000-1-000000000000.mcb"
    [winner] = [s for s in sessions if not s.problems]
    [loser] = [s for s in sessions if s.problems]
    assert keys == ({KEY_A} if winner is sessions[0] else {KEY_B})
    assert loser.upload_stats.reason == "upload failed" and "already exists" in loser.problems[0], loser.problems


def test_compaction_deletes_only_what_it_merged(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "one", [KEY_A])
    run(store, tmp_path, "two", [KEY_B])
    compactor = session(store, tmp_path, "three", compact_after=2)
    compactor.start_restore(background=False)
    # Another writer's object lands after the compactor listed the folder.
    late, _ = run(store, tmp_path, "late", [KEY_C])
    compactor.finish(FakeTorch([KEY_A, KEY_B, "fd" + "d" * 50]))  # type: ignore[arg-type]
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

        def put_file(self, folder: str, name: str, path: str) -> None:
            self.put(folder, name, b"")

    broken, _ = run(FullDisk(tmp_path / "store"), tmp_path, "w", [KEY_A])
    assert broken.upload_stats.reason == "upload failed"
    assert broken.problems == ["upload: No space left on device"]


def test_invalid_torch_output_is_not_uploaded(tmp_path: Path) -> None:
    class Hostile(FakeTorch):
        def save(self) -> bytes | None:
            return torchfmt.serialize([("inductor", KEY_A, b"x")])[:-2]  # truncated, CRC now wrong

    s = session(MemoryStore(), tmp_path, "h")
    s.start_restore(background=False)
    s.finish(Hostile([KEY_A]))  # type: ignore[arg-type]
    assert any("failed validation" in p for p in s.problems)
    assert s.upload_stats.reason == "nothing new"


def test_files_travel_and_restore_without_overwriting(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    cold = session(store, tmp_path, "cold")
    cold.start_restore(background=False)
    kernel = tmp_path / "cold" / "inductor" / "ab" / "cabc.so"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(fake_elf())
    (tmp_path / "cold" / "inductor" / "locks").mkdir()
    (tmp_path / "cold" / "inductor" / "locks" / "cabc.lock").write_text("")
    cold.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
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
    assert s.wait_restore()
    assert s.new_problems() == [f"refused {FOLDER}/20260101T000000-1-aaaaaa.mcb: not a pytest-megacache bundle (bad magic)"]
    assert s.new_problems() == []


def folder_of(scope: str) -> str:
    return f"pytest-megacache/{scope}/{FP}"


def test_a_branch_reads_main_and_writes_only_its_own_scope(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "main", [KEY_A, KEY_B], scope="main")
    feature, torch = run(store, tmp_path, "feature", [KEY_A, KEY_B, KEY_C], scope="feature+x")
    assert torch.loaded and {k for _t, k, _c in torch.loaded[0]} == {KEY_A, KEY_B}  # main's cache, read
    assert feature.restore_stats.folders == {folder_of("main"): 1}
    assert len(store.list(folder_of("main"))) == 1  # main untouched
    [own] = store.list(folder_of("feature+x"))
    blob = store.get(folder_of("feature+x"), own.name, 1 << 20)
    assert blob is not None
    assert [e.name for e in bundlemod.decode(blob)[1]] == [KEY_C]  # only what main lacks
    # main never reads a branch's scope.
    _main_again, torch_main = run(store, tmp_path, "main2", [], scope="main")
    assert {k for _t, k, _c in torch_main.loaded[0]} == {KEY_A, KEY_B}


def test_compaction_in_a_branch_scope_never_swallows_main(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "main", [KEY_A], scope="main")
    run(store, tmp_path, "f1", [KEY_B], scope="f", compact_after=1)
    run(store, tmp_path, "f2", [KEY_C], scope="f", compact_after=1)  # compacts f's objects only
    assert len(store.list(folder_of("main"))) == 1
    [only] = store.list(folder_of("f"))
    blob = store.get(folder_of("f"), only.name, 1 << 20)
    assert blob is not None
    assert sorted(e.name for e in bundlemod.decode(blob)[1]) == [KEY_B, KEY_C]


def test_cold_seconds_are_recorded_and_warm_hits_count_as_saved(tmp_path: Path) -> None:
    store = MemoryStore()
    cold, _ = run(store, tmp_path, "cold", [KEY_A, KEY_B])
    [obj] = store.list(FOLDER)
    blob = store.get(FOLDER, obj.name, 1 << 20)
    assert blob is not None
    header = bundlemod.decode(blob)[0]
    assert header.extra["cold_seconds"] == {f"inductor:{KEY_A}": 0.5, f"inductor:{KEY_B}": 0.5}
    assert cold.torch_stats.seconds_saved == 0
    warm, _ = run(store, tmp_path, "warm", [KEY_A, KEY_B])  # records both again, as torch does on a hit
    assert warm.torch_stats.seconds_saved == 1.0
    assert warm.torch_stats.per_test["test_all"]["seconds_saved"] == 1.0
    assert warm.torch_stats.layers["inductor"] == {"restored": 2, "used": 2}


def test_a_hit_counts_the_backend_seconds_it_spares_where_torch_kept_them(tmp_path: Path) -> None:
    """A hit on a cached graph spares its backend's seconds (AOTAutograd, Inductor), not Dynamo's, which trace the
    frame again: where torch's metrics split a test's compile seconds, its artifacts share the backend's part."""
    store = MemoryStore()
    torch = FakeTorch([KEY_A, KEY_B])
    torch.per_test["test_all"].backend = 0.4  # of its 1.0 s
    assert cold_table(store, tmp_path, torch) == {f"inductor:{KEY_A}": 0.2, f"inductor:{KEY_B}": 0.2}
    warm, _ = run(store, tmp_path, "warm", [KEY_A, KEY_B])
    assert warm.torch_stats.seconds_saved == 0.4


def test_what_a_hitting_test_still_spent_in_the_backend_is_not_counted_saved(tmp_path: Path) -> None:
    """Loading a cached graph costs the backend time too: a test's hits spare what they cost cold less what the test
    spent in the backend warm, and never less than nothing."""
    store = MemoryStore()
    torch = FakeTorch([KEY_A, KEY_B])
    torch.per_test["test_all"].backend = 0.4
    cold_table(store, tmp_path, torch)
    for spent, saved in ((0.1, 0.3), (0.9, 0.0)):
        warm = session(store, tmp_path, f"warm-{spent}")
        again = FakeTorch([KEY_A, KEY_B])
        again.per_test["test_all"].backend = spent
        warm.start_restore(background=False)
        warm.load_into_torch(loader=again.load)
        warm.finish(again)  # type: ignore[arg-type]
        assert warm.torch_stats.seconds_saved == saved
        assert warm.torch_stats.per_test["test_all"]["seconds_saved"] == saved


class WithAot(FakeTorch):
    """A test whose graph torch stored twice: its FX graph and the AOTAutograd entry that bundles it."""

    def __init__(self, keys: list[str], aot: str) -> None:
        super().__init__(keys)
        self.aot = aot
        self.per_test["test_all"].artifacts.append(("aot_autograd", aot))
        self.per_test["test_all"].backend = 0.9

    def save(self) -> bytes | None:
        return torchfmt.serialize([("inductor", k, b"graph") for k in self.keys] + [("aot_autograd", self.aot, b"a")])


def test_an_aotautograd_entry_carries_the_seconds_of_the_graphs_it_bundles(tmp_path: Path) -> None:
    """A hit on an AOTAutograd entry takes its graphs from it, and torch records no hit on those: the test's backend
    seconds go to its AOTAutograd entries (a warm hit on one, all torch records, counts all of it)."""
    assert cold_table(MemoryStore(), tmp_path, WithAot([KEY_A], "aot" + "a" * 40)) == {"aot_autograd:aot" + "a" * 40: 0.9}


def test_a_dynamo_entrys_share_in_an_older_objects_table_is_not_counted() -> None:
    """Objects written before Dynamo variants carried their own seconds gave each Dynamo entry a share of its tests'
    seconds, which the graphs' entries held too: read back, only the graphs' count."""
    import types

    from pytest_megacache.upload import restored_cold_seconds

    older = types.SimpleNamespace(extra={"cold_seconds": {"precompile:fn-key": 5.0, f"inductor:{KEY_A}": 0.5}})
    assert restored_cold_seconds([older]) == {("torch/inductor", KEY_A): 0.5}  # type: ignore[list-item]


def cold_table(store: MemoryStore, tmp_path: Path, torch: FakeTorch) -> Any:
    """The cold seconds a session that compiled as ``torch`` says stored, recorded in its object's header."""
    s = session(store, tmp_path, "cold")
    s.start_restore(background=False)
    s.load_into_torch(loader=torch.load)
    s.finish(torch)  # type: ignore[arg-type]
    [obj] = store.list(FOLDER)
    blob = store.get(FOLDER, obj.name, 1 << 20)
    assert blob is not None
    return bundlemod.decode(blob)[0].extra["cold_seconds"]


def test_full_coverage_is_expected_only_for_the_same_selection(tmp_path: Path) -> None:
    store = MemoryStore()
    run(store, tmp_path, "cold", [KEY_A], meta={"selection": "s1"})
    warm = session(store, tmp_path, "warm")
    warm.start_restore(background=False)
    assert warm.expects_full_coverage("s1")
    assert not warm.expects_full_coverage("s2")
    assert not warm.expects_full_coverage(None)


def test_nearest_fingerprint_names_what_differs(tmp_path: Path) -> None:
    store = MemoryStore()
    other = "torch-2.12.0/cpu-avx2-t2/py3.11-linux-x86_64/aaaaaaaaaaaa"
    parts_there = {"torch": "2.12.0", "threads": 2, "python": "3.11"}
    blob = bundlemod.encode(bundlemod.Entries([bundlemod.Entry("torch/inductor", KEY_A, b"x")]), other,
                            extra={"producer": {"fingerprint_parts": parts_there}})
    store.put(f"pytest-megacache/main/{other}", "20260101T000000-1-abcdef.mcb", blob)
    store.put("pytest-megacache/junk", "20260101T000000-1-abcdef.mcb", b"not even a bundle")
    why = nearest_fingerprint(store, "pytest-megacache", ["main"], FP, {"torch": "2.13.0", "threads": 2,
                                                                       "python": "3.11"})
    assert why is not None and other in why and "torch '2.12.0' here '2.13.0'" in why and "threads" not in why
    assert nearest_fingerprint(MemoryStore(), "pytest-megacache", ["main"], FP, {}) == \
        "nothing is stored under this prefix yet"


def test_this_fingerprint_in_a_scope_that_is_not_read_is_named(tmp_path: Path) -> None:
    store = MemoryStore()
    blob = bundlemod.encode(bundlemod.Entries([bundlemod.Entry("torch/inductor", KEY_A, b"x")]), FP)
    store.put(f"pytest-megacache/release/{FP}", "20260101T000000-1-abcdef.mcb", blob)
    why = nearest_fingerprint(store, "pytest-megacache", ["main"], FP, {})
    assert why is not None and "stored only in scope(s) this session does not read: release (reads main" in why
    assert "release" not in (nearest_fingerprint(store, "pytest-megacache", ["release", "main"], FP, {}) or "")


def test_a_changed_dynamic_shape_profile_is_uploaded_and_the_newest_wins(tmp_path: Path) -> None:
    """torch rewrites a pgo artifact under the same key when a second shape shows up."""
    store = MemoryStore()

    class ProfileTorch(FakeTorch):
        def __init__(self, keys: list[str], profile: bytes) -> None:
            super().__init__(keys)
            self.profile = profile

        def save(self) -> bytes | None:
            graphs = [("inductor", k, f"graph {k}".encode()) for k in self.keys]
            # torch records the profile twice when it changed: the first and the current version.
            return torchfmt.serialize([*graphs, ("pgo", "job1", b"static"), ("pgo", "job1", self.profile)])

    def go(name: str, profile: bytes) -> tuple[CacheSession, ProfileTorch]:
        s = session(store, tmp_path, name)
        torch = ProfileTorch([KEY_A], profile)
        s.start_restore(background=False)
        s.load_into_torch(loader=torch.load)
        s.finish(torch)  # type: ignore[arg-type]
        return s, torch

    go("one", b"dynamic-v1")
    _, second = go("two", b"dynamic-v2")
    assert (("pgo", "job1", b"dynamic-v1") in second.loaded[0])  # the current profile, not the first record
    third_session, third = go("three", b"dynamic-v2")
    assert ("pgo", "job1", b"dynamic-v2") in third.loaded[0]  # the newer object's profile replaced the older
    # Nothing new, but the two objects hold the profile each: merged into one that holds the newer one.
    assert third_session.upload_stats.new_entries == {} and third_session.upload_stats.converged == 2
    [(blob, _when)] = store.objects.values()
    profile = bundlemod.decode(blob, FP)[1].get(("torch/pgo", "job1"))
    assert profile is not None and profile.data == b"dynamic-v2"
    _, fourth = go("four", b"dynamic-v2")
    assert fourth.loaded[0] == third.loaded[0] and len(store.objects) == 1


# --- xdist workers' copies of a dynamic-shape profile ------------------------------------------------
PGO = ("torch/pgo", "megacache-job:None:")


def restored_with_profile(tmp_path: Path, data: bytes | None) -> CacheSession:
    s = session(MemoryStore(), tmp_path, "pgo")
    if data is not None:
        s.restored = bundlemod.Entries([bundlemod.Entry(*PGO, data)])
    return s


def test_worker_profiles_equal_to_the_restored_one_need_no_merge(tmp_path: Path) -> None:
    s = restored_with_profile(tmp_path, b"P")
    calls: list[Any] = []
    out = s.upload.merge_worker_profiles({PGO: [bundlemod.Entry(*PGO, b"P")] * 2}, 5,
                                  merge=lambda *a: calls.append(a))  # type: ignore[func-returns-value]
    assert not out and not calls and s.upload_stats.profiles_merged == 0


def test_a_single_new_profile_is_taken_as_it_is(tmp_path: Path) -> None:
    s = restored_with_profile(tmp_path, None)
    out = s.upload.merge_worker_profiles({PGO: [bundlemod.Entry(*PGO, b"A"), bundlemod.Entry(*PGO, b"A")]}, 5,
                                  merge=lambda *a: pytest.fail("no merge needed"))
    assert [e.data for e in out] == [b"A"]


def test_copies_that_differ_are_merged_with_the_restored_one_as_base(tmp_path: Path) -> None:
    s = restored_with_profile(tmp_path, b"P")
    seen: list[tuple[bytes | None, list[bytes]]] = []

    def merge(base: bytes | None, copies: Any, timeout: float) -> bytes:
        seen.append((base, list(copies)))
        return b"P+A+B"

    copies = {PGO: [bundlemod.Entry(*PGO, d) for d in (b"P+A", b"P", b"P+B", b"P+A")]}
    out = s.upload.merge_worker_profiles(copies, 5, merge=merge)
    assert seen == [(b"P", [b"P+A", b"P+B"])]  # distinct copies that differ from the base, in order
    assert [e.data for e in out] == [b"P+A+B"] and s.upload_stats.profiles_merged == 1


def test_a_merge_that_adds_nothing_uploads_nothing(tmp_path: Path) -> None:
    s = restored_with_profile(tmp_path, b"P")
    out = s.upload.merge_worker_profiles({PGO: [bundlemod.Entry(*PGO, b"P'")]}, 5, merge=lambda *a: None)
    assert not out and s.upload_stats.profiles_merged == 1


def test_a_failed_merge_warns_and_keeps_the_newest_copy(tmp_path: Path) -> None:
    from pytest_megacache.bundle.pgo import ProfileMergeError

    def merge(*a: Any) -> bytes:
        raise ProfileMergeError("no torch here")

    s = restored_with_profile(tmp_path, None)
    out = s.upload.merge_worker_profiles({PGO: [bundlemod.Entry(*PGO, b"A"), bundlemod.Entry(*PGO, b"B")]}, 5, merge=merge)
    assert [e.data for e in out] == [b"B"]
    [problem] = s.new_problems()
    assert "could not merge the xdist workers' dynamic-shape profiles (no torch here)" in problem


def test_profile_merge_errors_are_bounded_and_named(tmp_path: Path) -> None:
    from pytest_megacache.bundle.pgo import ProfileMergeError, merge_profiles

    with pytest.raises(ProfileMergeError, match="could not start"):
        merge_profiles(None, [b"x"], python=str(tmp_path / "no-python"))
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    with pytest.raises(ProfileMergeError, match=r"over 0\.3 s"):
        merge_profiles(None, [b"x"], timeout=0.3, python=str(slow))
    with pytest.raises(ProfileMergeError):  # not a profile: the child fails, its last line is the reason
        merge_profiles(None, [b"not a pickle"], python=sys.executable)


def test_torch_cache_files_travel_only_for_what_no_process_of_the_session_recorded(tmp_path: Path) -> None:
    """A child process compiles into the same directory: its FX-graph and AOTAutograd entries (files there) are
    carried; the parent's own, which mega-cache carries under the same key, are not carried twice."""
    store = MemoryStore()
    s = session(store, tmp_path, "kids")
    s.start_restore(background=False)
    inductor = tmp_path / "kids" / "inductor"
    for rel in (f"fxgraph/{KEY_A[1:3]}/{KEY_A}/entry", f"fxgraph/{KEY_C[1:3]}/{KEY_C}/entry", "aotautograd/achild/entry"):
        (inductor / rel).parent.mkdir(parents=True, exist_ok=True)
        (inductor / rel).write_bytes(b"pickled entry")
    s.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    assert s.upload_stats.new_entries == {"file/inductor": 2, "torch/inductor": 1}
    assert s.torch_stats.other_processes == {"inductor": 1, "aot_autograd": 1}
    carried = {name for (_folder, _n), (blob, _t) in store.objects.items()
               for name in (e.name for e in bundlemod.decode(blob)[1])}
    assert f"fxgraph/{KEY_A[1:3]}/{KEY_A}/entry" not in carried and "aotautograd/achild/entry" in carried


class ForwardOnly(FakeTorch):
    """AOTAutograd misses that torch never saved (a forward needing grad whose backward never ran)."""

    def __init__(self, keys: list[str], per_test: dict[str, tuple[int, int]]) -> None:
        super().__init__(keys)
        self.per_test = {nodeid: CompileRecord(0.1, 1, {"autograd_cache_miss": miss, "autograd_cache_saved": saved}, [])
                         for nodeid, (miss, saved) in per_test.items()}

    def counters(self) -> dict[str, int]:
        per_test = getattr(self, "per_test", {})
        return {"fxgraph_cache_miss": len(self.keys),
                "autograd_cache_miss": sum(r.counters["autograd_cache_miss"] for r in per_test.values()),
                "autograd_cache_saved": sum(r.counters["autograd_cache_saved"] for r in per_test.values())}


@pytest.mark.parametrize(("per_test", "note"), [
    ({"t.py::test_train": (1, 1)}, None),
    ({"t.py::test_train": (1, 1), "t.py::test_infer": (2, 0)}, "2 AOTAutograd graph(s) compiled but not stored "
                                                               "(in t.py::test_infer)"),
    ({f"t.py::test_{i}": (1, 0) for i in range(5)}, "5 AOTAutograd graph(s) compiled but not stored "
                                                   "(in t.py::test_0, t.py::test_1, t.py::test_2 and 2 more)"),
])
def test_graphs_torch_did_not_store_are_named_with_both_causes(
        tmp_path: Path, per_test: dict[str, tuple[int, int]], note: str | None) -> None:
    s = session(MemoryStore(), tmp_path, "a")
    s.start_restore(background=False)
    s.finish(ForwardOnly([KEY_A], per_test))  # type: ignore[arg-type]
    s.check_unstorable()
    unstorable = [n for n in s.notes if "not stored" in n]
    if note is None:
        assert unstorable == []
    else:
        # both causes named: the lazy backward (with its remedies) and a part without an FX-graph key
        assert len(unstorable) == 1 and unstorable[0].startswith(note), unstorable
        assert "torch.no_grad()" in unstorable[0] and "--megacache-eager-backward" in unstorable[0]
        assert "FX-graph cache" in unstorable[0]


def test_with_eager_backwards_the_note_names_only_the_reason_left(tmp_path: Path) -> None:
    s = session(MemoryStore(), tmp_path, "a")
    s.start_restore(background=False)
    s.finish(ForwardOnly([KEY_A], {"t.py::test_dyn": (1, 0)}))  # type: ignore[arg-type]
    s.check_unstorable(eager_backward=True)
    (note,) = [n for n in s.notes if "not stored" in n]
    assert note.startswith("1 AOTAutograd graph(s) compiled but not stored (in t.py::test_dyn)")
    assert "FX-graph cache" in note and "no_grad" not in note and "--megacache-eager-backward" not in note


def test_with_dynamo_reuse_the_backwards_it_compiled_count_as_stored_and_the_note_says_when_the_rest_are(
        tmp_path: Path) -> None:
    """Dynamo reuse compiles forward-only graphs' backwards (their entries saved, torch's counters put back): those
    are not named as unstored, and the note says the rest are stored as reuse pays for them."""
    s = session(MemoryStore(), tmp_path, "a")
    s.start_restore(background=False)
    s.finish(ForwardOnly([KEY_A], {"t.py::test_a": (2, 0), "t.py::test_b": (1, 0)}))  # type: ignore[arg-type]
    s.torch_stats.counters.update({"dynamo_stored": 4, "dynamo_backwards_compiled": 1})
    s.check_unstorable()
    (note,) = [n for n in s.notes if "not stored" in n]
    assert note.startswith("2 AOTAutograd graph(s) compiled but not stored (in t.py::test_a, t.py::test_b)")
    assert "until Dynamo reuse has spared the time to compile their backwards" in note
    s.notes.clear()
    s.torch_stats.counters["dynamo_backwards_compiled"] = 3
    s.check_unstorable()
    assert not [n for n in s.notes if "not stored" in n]


def test_counters_without_a_saved_count_say_nothing_about_storability(tmp_path: Path) -> None:
    """An older torch without the counter: no claim either way."""
    s, _ = run(MemoryStore(), tmp_path, "a", [KEY_A])
    s.torch_stats.counters["autograd_cache_miss"] = 3
    s.check_unstorable()
    assert not [n for n in s.notes if "not stored" in n]
