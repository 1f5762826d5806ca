"""Concurrent compactions converge: sessions of one fingerprint that compact at once leave one merged object
(beside it only objects of entries it lacks altogether) and lose no entry, on a real directory store and on S3
(moto's server over HTTP). The sessions run in threads, made to overlap: each restores the same objects, and
each waits for the others at its first upload (before it, or after it: every merged object is stored before any
session looks at the folder again)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache import torchfmt
from pytest_megacache.bundle import Entries, Entry, Limits
from pytest_megacache.core import CacheSession
from pytest_megacache.errors import StoreError
from pytest_megacache.report import _upload_lines
from pytest_megacache.stores import LocalDirStore, ObjectInfo, Store, Walk, new_object_name

from .test_core import FOLDER, FP, FakeTorch

K = 4  # sessions compacting at once
INPUTS = 4  # objects in the folder before they start; each session compacts (compact_after=INPUTS)
WAIT = 30.0  # seconds a barrier waits for the others before it breaks (a hang fails the test)
PGO = ("pgo", "megacache-job:None:")


def key(tag: str, i: int) -> str:
    return f"f{tag}{i:04d}".ljust(52, "0")


class Overlapping:
    """One session's view of the shared store: waits at ``before_put`` before its first upload and at
    ``after_put`` after it; refuses the operations ``fail`` names (kind, how many of that kind came before)."""

    def __init__(self, inner: Store, before_put: threading.Barrier | None = None,
                 after_put: threading.Barrier | None = None, fail: Callable[[str, int], bool] | None = None,
                 phantom: str | None = None, meanwhile: Callable[[], None] | None = None) -> None:
        self.inner, self.label = inner, inner.label
        self.before_put, self.after_put, self.fail, self.phantom = before_put, after_put, fail, phantom
        self.meanwhile = meanwhile  # run after the first upload, before anything else
        self.calls: list[str] = []
        self.puts: list[tuple[str, bytes]] = []

    def _count(self, what: str) -> None:
        done = self.calls.count(what)
        self.calls.append(what)
        if self.fail is not None and self.fail(what, done):
            raise StoreError(f"injected: {what} refused", "io")

    def list(self, folder: str) -> list[ObjectInfo]:
        self._count("list")
        out = self.inner.list(folder)
        if self.phantom is not None and self.puts:  # an object listed, then deleted before it is read
            out.append(ObjectInfo(self.phantom, 100, 0.0))
        return out

    def get(self, folder: str, name: str, max_bytes: int) -> bytes | None:
        self._count("get")
        return self.inner.get(folder, name, max_bytes)

    def fetch(self, folder: str, name: str, max_bytes: int, dest: BinaryIO) -> bool:
        self._count("get")
        return self.inner.fetch(folder, name, max_bytes, dest)

    def put_file(self, folder: str, name: str, path: str) -> None:
        self.put(folder, name, Path(path).read_bytes())

    def head(self, folder: str, name: str, nbytes: int) -> bytes | None:
        return self.inner.head(folder, name, nbytes)

    def walk(self, prefix: str) -> Walk:
        return self.inner.walk(prefix)

    def put(self, folder: str, name: str, data: bytes) -> None:
        first = not self.puts
        if first and self.before_put is not None:
            self.before_put.wait(WAIT)
        self._count("put")
        self.inner.put(folder, name, data)
        self.puts.append((name, data))
        if first and self.after_put is not None:
            self.after_put.wait(WAIT)
        if first and self.meanwhile is not None:
            self.meanwhile()

    def delete(self, folder: str, name: str) -> None:
        self._count("delete")
        self.inner.delete(folder, name)


def seed(store: Store, n: int = INPUTS, signing_key: bytes | None = None) -> set[str]:
    """``n`` objects of one entry each (as ``n`` earlier sessions left them); their keys."""
    keys = set()
    for i in range(n):
        keys.add(key("0", i))
        store.put(FOLDER, new_object_name(), bundlemod.encode(
            Entries([Entry("torch/inductor", key("0", i), f"graph {i}".encode())]), FP, signing_key=signing_key))
    return keys


def session(store: Store, compact_after: int = INPUTS, **kw: Any) -> CacheSession:
    return CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[], reads=True,
                        writes=True, compact_after=compact_after, **kw)


def finish_together(sessions: list[CacheSession], torches: list[Any], restore: str = "first") -> None:
    """Finish every session at once in threads, each restored ``first`` (in the calling thread, one after another),
    ``in_thread`` (each in its own thread before it finishes, as concurrent CI jobs do) or ``done`` already (by the
    caller); any exception fails the test."""
    if restore == "first":
        for s in sessions:
            s.start_restore(background=False)
    errors: list[BaseException] = []

    def finish(s: CacheSession, torch: Any) -> None:
        try:
            if restore == "in_thread":
                s.start_restore(background=False)
            s.finish(torch)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=finish, args=pair) for pair in zip(sessions, torches, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT)
    assert not errors and not any(t.is_alive() for t in threads)


def contents(store: Store, verify_keys: tuple[bytes, ...] = ()) -> dict[str, Entries]:
    """Every object of the folder, decoded as a restore decodes it (one that fails validation fails the test)."""
    out = {}
    for info in store.list(FOLDER):
        blob = store.get(FOLDER, info.name, 1 << 30)
        assert blob is not None
        out[info.name] = bundlemod.decode(blob, FP, verify_keys=verify_keys)[1]
    return out


def names(entries: Entries) -> set[str]:
    return {e.name for e in entries}


def compacting(store: Store, new: list[list[str]], *, after_put: bool, fail: Callable[[str, int], bool] | None = None,
               **kw: Any) -> tuple[list[CacheSession], list[Overlapping]]:
    """``len(new)`` sessions, session i compiling ``new[i]``, compacting at once through overlapping views."""
    barrier = threading.Barrier(len(new), timeout=WAIT)
    views = [Overlapping(store, before_put=None if after_put else barrier, after_put=barrier if after_put else None,
                         fail=fail) for _ in new]
    sessions = [session(view, **kw) for view in views]
    finish_together(sessions, [FakeTorch(keys) for keys in new])
    return sessions, views


@pytest.mark.parametrize("after_put", [False, True], ids=["upload-race", "all-uploaded-first"])
@pytest.mark.parametrize("same", [False, True], ids=["own-entries", "same-entries"])
def test_concurrent_compactions_leave_one_object_with_every_entry(shared: Store, after_put: bool, same: bool) -> None:
    inputs = seed(shared)
    new = [[key("n", 0), key("n", 1)] if same else [key(f"{i + 1}", 0), key(f"{i + 1}", 1)] for i in range(K)]
    sessions, _views = compacting(shared, new, after_put=after_put)
    stored = contents(shared)
    assert len(stored) == 1
    [merged] = stored.values()
    assert names(merged) == inputs | {k for keys in new for k in keys}
    for s in sessions:
        assert s.upload_stats.objects == 1 and not s.problems and not s.notes
    # Every input was deleted once (by one session or another; a second delete of a gone object is harmless) and
    # every other session's merged object too, by some session: what the sessions count adds up.
    assert sum(s.upload_stats.compacted for s in sessions) >= INPUTS
    assert sum(s.upload_stats.superseded for s in sessions) >= 1


def test_objects_stored_meanwhile_or_later_with_other_entries_stay(shared: Store) -> None:
    inputs = seed(shared)
    barrier = threading.Barrier(K + 1, timeout=WAIT)
    views = [Overlapping(shared, after_put=barrier) for _ in range(K + 1)]
    # K compacting sessions and one that does not compact (compact_after above the count), all at once.
    sessions = [session(view) for view in views[:K]] + [session(views[K], compact_after=100)]
    new = [[key(f"{i + 1}", 0)] for i in range(K)] + [[key("p", 0)]]
    finish_together(sessions, [FakeTorch(keys) for keys in new])
    late = session(shared, compact_after=100)
    late.start_restore(background=False)
    late.finish(FakeTorch([key("l", 0)]))  # type: ignore[arg-type]
    stored = contents(shared)
    # The merged object, the plain upload made meanwhile (no entry in common with any merged object) and the
    # later one: what they hold is everything.
    assert len(stored) == 3
    assert sorted(len(e) for e in stored.values()) == [1, 1, INPUTS + K]
    assert set().union(*map(names, stored.values())) == inputs | {k for keys in new for k in keys} | {key("l", 0)}
    # The next compaction merges all three.
    again = session(shared, compact_after=2)
    again.start_restore(background=False)
    again.finish(FakeTorch([key("m", 0)]))  # type: ignore[arg-type]
    assert [len(e) for e in contents(shared).values()] == [INPUTS + K + 3]


@pytest.mark.parametrize("fault", ["one-session-cannot-delete", "second-delete-fails", "merge-upload-fails",
                                   "listing-fails"])
def test_a_failing_store_operation_loses_nothing(shared: Store, fault: str) -> None:
    inputs = seed(shared)
    fails: dict[str, Callable[[int, str, int], bool]] = {
        "one-session-cannot-delete": lambda i, what, n: i == 0 and what == "delete",
        "second-delete-fails": lambda i, what, n: what == "delete" and n == 1,
        "merge-upload-fails": lambda i, what, n: what == "put" and n == 1,
        "listing-fails": lambda i, what, n: what == "list" and n == 1,  # the listing after the upload
    }
    barrier = threading.Barrier(K, timeout=WAIT)
    views = [Overlapping(shared, after_put=barrier, fail=lambda what, n, i=i: fails[fault](i, what, n))  # type: ignore[misc]
             for i in range(K)]
    sessions = [session(view) for view in views]
    new = [[key(f"{i + 1}", 0)] for i in range(K)]
    finish_together(sessions, [FakeTorch(keys) for keys in new])
    everything = inputs | {k for keys in new for k in keys}
    stored = contents(shared)
    assert set().union(*map(names, stored.values())) == everything
    stopped = [s for s in sessions if any("compaction stopped" in n and "injected" in n for n in s.notes)]
    assert stopped and all(not s.problems and s.upload_stats.objects == 1 for s in sessions)
    # A later compaction settles the folder.
    again = session(shared, compact_after=1)
    again.start_restore(background=False)
    again.finish(FakeTorch([key("m", 0)]))  # type: ignore[arg-type]
    assert [names(e) for e in contents(shared).values()] == [everything | {key("m", 0)}]


def test_objects_that_fail_validation_are_never_deleted(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    mine, theirs = b"k" * 32, b"o" * 32
    inputs = seed(store, signing_key=mine)
    junk, foreign = new_object_name(), new_object_name()
    store.put(FOLDER, junk, b"not a bundle")
    store.put(FOLDER, foreign, bundlemod.encode(Entries([Entry("torch/inductor", key("0", 0), b"x")]), FP,
                                                signing_key=theirs))
    sessions, _views = compacting(store, [[key(f"{i + 1}", 0)] for i in range(K)], after_put=True,
                                  signing_keys=[mine])
    left = {info.name for info in store.list(FOLDER)}
    assert {junk, foreign} < left and len(left) == 3  # the two it cannot read, and one merged object
    [merged] = [n for n in left if n not in (junk, foreign)]
    blob = store.get(FOLDER, merged, 1 << 30)
    assert blob is not None
    assert names(bundlemod.decode(blob, FP, verify_keys=[mine])[1]) == inputs | {key(f"{i + 1}", 0) for i in range(K)}
    assert all(s.upload_stats.objects == 1 for s in sessions)


def test_an_object_holding_a_secret_of_this_environment_is_neither_copied_nor_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirStore(tmp_path / "store")
    inputs = seed(store)
    secret = "s3cr3t-9f1c2b7e4d5a6c8b"
    planted = new_object_name()

    def plant() -> None:  # another session's object, sharing an entry with the merged one
        store.put(FOLDER, planted, bundlemod.encode(Entries([
            Entry("torch/inductor", key("0", 0), b"graph 0"),
            Entry("torch/inductor", key("s", 0), b"holds " + secret.encode())]), FP))

    compactor = session(Overlapping(store, meanwhile=plant))
    compactor.start_restore(background=False)
    monkeypatch.setenv("DEPLOY_TOKEN", secret)
    compactor.finish(FakeTorch([key("c", 0)]))  # type: ignore[arg-type]
    stored = contents(store)
    assert planted in stored and len(stored) == 2
    assert set().union(*map(names, stored.values())) == inputs | {key("c", 0), key("s", 0)}
    assert compactor.upload_stats.remerged == 0 and compactor.upload_stats.compacted == INPUTS
    [problem] = compactor.problems
    assert "DEPLOY_TOKEN" in problem and secret not in problem


def test_a_merge_over_the_restore_limits_is_written_as_one_group_of_parts(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    inputs = seed(store)

    barrier = threading.Barrier(K, timeout=WAIT)
    views = [Overlapping(store, after_put=barrier) for _ in range(K)]
    limits = Limits(max_object_bytes=60_000)  # one session's merged object fits, two sessions' would not
    sessions = [session(view, limits=limits) for view in views]
    new = [[key(f"{i + 1}", 0)] for i in range(K)]
    finish_together(sessions, [Incompressible(keys) for keys in new])  # one entry each
    everything = inputs | {k for keys in new for k in keys}
    stored = contents(store)
    assert all(info.size <= limits.max_object_bytes for info in store.list(FOLDER))
    assert set().union(*map(names, stored.values())) == everything
    assert all(not s.problems for s in sessions)
    # The wave leaves one merged whole, a group of parts. A session that lists while another stores or deletes a
    # group's parts lists again (test_a_group_half_listed_is_looked_at_again_and_merged), within its rounds; a
    # session slowed past them leaves two groups, which the next read-write session merges, as it merges any
    # overlapping objects.
    groups = {part_field(store, name)["group"] for name in stored}
    assert 1 <= len(groups) <= 2 and len(stored) == K * len(groups)
    if len(groups) > 1:
        later = session(store, limits=limits)
        later.start_restore(background=False)
        later.finish(FakeTorch([]))  # type: ignore[arg-type]
        assert not later.problems and later.upload_stats.converged == len(stored)
        stored = contents(store)
    # One merged whole, in parts of one group: no entry in two objects.
    assert set().union(*map(names, stored.values())) == everything
    assert sum(len(e) for e in stored.values()) == len(everything)
    assert len({part_field(store, name)["group"] for name in stored}) == 1 and len(stored) == K


class Incompressible(FakeTorch):
    """Compiles its keys into incompressible inductor entries of 40 KB each."""

    def save(self) -> bytes | None:
        return torchfmt.serialize([("inductor", k, os.urandom(40_000)) for k in self.keys])


class HidingAPart(Overlapping):
    """Its first listing after its upload leaves out one object it did not write: a part of another session's group
    being stored or deleted at that moment."""

    hidden: str | None = None

    def list(self, folder: str) -> list[ObjectInfo]:
        out = super().list(folder)
        if self.puts and self.hidden is None:
            mine = {name for name, _ in self.puts}
            self.hidden = next(info.name for info in out if info.name not in mine)
            out = [info for info in out if info.name != self.hidden]
        return out


def test_a_group_half_listed_is_looked_at_again_and_merged(shared: Store) -> None:
    """A compaction that lists while a peer's group of parts is half stored or half deleted lists again once it may
    have settled: the whole group is then merged with its own (they share entries), and one group is left."""
    store = shared
    inputs = seed(store)
    limits = Limits(max_object_bytes=60_000)
    first, second = session(store, limits=limits), session(view := HidingAPart(store), limits=limits)
    for s in (first, second):
        s.start_restore(background=False)
    first.finish(Incompressible([key("1", 0), key("1", 1)]))  # type: ignore[arg-type]
    assert len({part_field(store, name)["group"] for name in contents(store)}) == 1 and len(contents(store)) == 2
    second.finish(Incompressible([key("2", 0)]))  # type: ignore[arg-type]
    assert view.hidden is not None and not first.problems and not second.problems
    stored = contents(store)
    everything = inputs | {key("1", 0), key("1", 1), key("2", 0)}
    assert set().union(*map(names, stored.values())) == everything
    assert sum(len(e) for e in stored.values()) == len(everything)  # no entry in two objects
    assert len({part_field(store, name)["group"] for name in stored}) == 1 and len(stored) == 3
    assert view.calls.count("list") >= 3  # the restore's, the half listing, and the one after it


def part_field(store: Store, name: str) -> dict[str, Any]:
    blob = store.get(FOLDER, name, 1 << 30)
    assert blob is not None
    doc = bundlemod.decode_header(blob)[0].extra["part"]
    assert isinstance(doc, dict)
    return doc


class Profiling(FakeTorch):
    """Compiles its keys and saves ``profile`` as the dynamic-shape profile (torch/pgo)."""

    def __init__(self, keys: list[str], profile: bytes) -> None:
        super().__init__(keys)
        self.profile = profile

    def save(self) -> bytes | None:
        return torchfmt.serialize([*(("inductor", k, b"g") for k in self.keys), (*PGO, self.profile)])

    def compiled_anything(self) -> bool:
        return True  # a recompile that only grew the profile


def test_a_newer_profile_in_an_object_of_fewer_entries_is_merged_not_deleted(tmp_path: Path) -> None:
    """A session that only grew the profile stores an object of that one entry, while a compaction holding the
    older profile uploads: the compaction's object has every entry of it, but not its newer profile."""
    store = LocalDirStore(tmp_path / "store")
    seed(store, INPUTS - 1)
    store.put(FOLDER, new_object_name(), bundlemod.encode(Entries([Entry("torch/pgo", PGO[1], b"profile v0")]), FP))
    grower = session(store, compact_after=100)
    grower.start_restore(background=False)

    def grow() -> None:
        time.sleep(0.01)  # objects are ordered by their header's time, in milliseconds: this one is the newer
        grower.finish(Profiling([], b"profile v2"))  # type: ignore[arg-type]

    compactor = session(Overlapping(store, meanwhile=grow))
    compactor.start_restore(background=False)
    compactor.finish(Profiling([key("c", 0)], b"profile v1"))  # type: ignore[arg-type]
    assert grower.upload_stats.new_entries == {"torch/pgo": 1}
    [merged] = contents(store).values()
    assert len(merged) == INPUTS + 1
    assert merged.get(("torch/pgo", PGO[1])).data == b"profile v2"  # type: ignore[union-attr]
    assert compactor.upload_stats.remerged == 1 and compactor.upload_stats.superseded == 1
    [line] = _upload_lines(compactor.upload_stats, 0)
    assert f"compacting {INPUTS} objects; 1 object of concurrent sessions merged (1 more merged upload, " in line


def test_a_lone_compaction_reads_nothing_more_and_a_plain_upload_lists_nothing_more(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    seed(store)
    plain = Overlapping(store)
    s = session(plain, compact_after=100)
    s.start_restore(background=False)
    s.finish(FakeTorch([key("p", 0)]))  # type: ignore[arg-type]
    assert plain.calls == ["list", *["get"] * INPUTS, "put"]
    view = Overlapping(store, phantom="20200101T000000000-1-aaaaaaaaaaaa.mcb")  # listed, gone when read
    c = session(view, compact_after=INPUTS)
    c.start_restore(background=False)
    c.finish(FakeTorch([key("c", 0)]))  # type: ignore[arg-type]
    after_put = view.calls[view.calls.index("put"):]
    # The inputs are deleted without being read again; one listing finds only the merged object (and the name
    # of one that is gone by the time it is read: skipped).
    assert after_put == ["put", *["delete"] * (INPUTS + 1), "list", "get"]
    assert c.upload_stats.compacted == INPUTS + 1 and not c.problems and not c.notes
    assert [len(e) for e in contents(store).values()] == [INPUTS + 2]
