"""The store at scale, without torch: the shards of a CI matrix converge on one object once a session restores
their overlapping objects (on a directory store and on S3 through moto's server); what would be over the restore
limits is written as several objects of one group, each under them; each entry is counted once in what a restore
writes and reports.

Sessions stand in for torch with :class:`FakeTorch` and write synthetic kernel files and a precompiled header where
torch would (the cache directories the session's file roots name), so no test here compiles anything."""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Limits, payload
from pytest_megacache.core import PART_FIELD, STALE_GROUP_SECONDS, CacheSession, Held, units
from pytest_megacache.files import FileRoot
from pytest_megacache.report import _restore_lines, _upload_lines
from pytest_megacache.stores import LocalDirStore, MemoryStore, Store

from ..conftest import fake_elf
from ..test_compaction import finish_together
from ..test_core import FOLDER, FP, FakeTorch

K = 4  # shards of one suite
WAIT = 30.0
HEADER = "0123abcd4567ef89.h.gch"  # the precompiled header every shard builds, the same bytes
ISA = "isa/avx512.so"  # a vector-ISA check's library, the same in every shard


def graph(shard: int, i: int) -> str:
    return f"f{shard}x{i:03d}".ljust(52, "0")


def shared_bytes(n: int, seed: int) -> bytes:
    """``n`` bytes that compress about 2:1, the same for the same seed."""
    rng = random.Random(seed)
    return bytes(rng.getrandbits(4) for _ in range(n))


class Shard:
    """One CI shard's machine: fresh cache directories per session, its own graphs plus what every shard builds."""

    def __init__(self, tmp: Path, shard: int, graphs: int = 3, header: bytes = b"") -> None:
        self.tmp, self.shard, self.header = tmp, shard, header
        self.keys = [graph(shard, i) for i in range(graphs)]
        self.runs = 0

    def session(self, store: Store, **kw: Any) -> CacheSession:
        self.runs += 1
        base = self.tmp / f"shard{self.shard}-run{self.runs}"
        self.roots = [FileRoot("inductor", base / "inductor"), FileRoot("pch", base / "pch")]
        return CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=self.roots,
                            reads=True, writes=kw.pop("writes", True), **kw)

    def compile(self, s: CacheSession) -> FakeTorch:
        """What a session of this shard leaves: its graphs (misses for those the restore lacked) and its files."""
        missing = [k for k in self.keys if ("torch/inductor", k) not in s.restored]
        for root, rel, data in [(self.roots[1], HEADER, b"gpch" + self.header),
                                (self.roots[0], ISA, fake_elf(b"isa" * 500)),
                                *((self.roots[0], f"k{self.shard}/{k[:8]}.so", fake_elf(k.encode() * 40))
                                  for k in missing)]:
            target = root.path / rel
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        torch = FakeTorch(self.keys)
        if not missing:
            torch.compiles, torch.per_test = 0, {}
        return torch

    def hits_everything(self, s: CacheSession) -> bool:
        on_disk = (self.roots[1].path / HEADER).exists() and (self.roots[0].path / ISA).exists()
        return on_disk and all(("torch/inductor", k) in s.restored for k in self.keys)


def factory(store: Store) -> Callable[[], Store]:
    return lambda: store


def cold_wave(store: Store, shards: list[Shard]) -> None:
    """Every shard starts on an empty store at once and uploads its own object."""
    sessions = [shard.session(store) for shard in shards]
    for s in sessions:
        s.start_restore(background=False)
    finish_together(sessions, [shard.compile(s) for shard, s in zip(shards, sessions, strict=True)], restore="done")
    assert all(s.upload_stats.objects == 1 and not s.problems for s in sessions)


def objects(store: Store) -> dict[str, Entries]:
    out = {}
    for info in store.list(FOLDER):
        blob = store.get(FOLDER, info.name, 1 << 30)
        assert blob is not None
        out[info.name] = bundlemod.decode(blob, FP)[1]
    return out


def union(stored: dict[str, Entries]) -> Entries:
    out = Entries()
    for entries in stored.values():
        out.merge(entries)
    return out


def test_sharded_cold_wave_converges_in_the_first_warm_session(shared: Store, tmp_path: Path) -> None:
    store = shared  # the directory store, then moto's S3 (tests/conftest.py)
    shards = [Shard(tmp_path, i, header=shared_bytes(60_000, 7)) for i in range(K)]
    cold_wave(store, shards)
    before = objects(store)
    assert len(before) == K
    unique = union(before)
    assert sum(len(e) for e in before.values()) > len(unique)  # the header and ISA library K times
    # One shard's warm session: it compiles nothing, restores the K objects, and merges them.
    warm = shards[0].session(store)
    warm.start_restore(background=False)
    assert shards[0].hits_everything(warm)
    warm.finish(shards[0].compile(warm))  # type: ignore[arg-type]
    up = warm.upload_stats
    assert up.new_entries == {} and up.objects == 0 and up.converged == K and up.compacted == K
    after = objects(store)
    assert len(after) == 1
    [merged] = after.values()
    assert {e.ident for e in merged} == {e.ident for e in unique}
    # Within 10 % of what the distinct entries take, compressed.
    [info] = store.list(FOLDER)
    assert info.size <= 1.1 * len(bundlemod.encode(unique, FP))
    r = warm.restore_stats
    assert r.raw_fetched > r.raw_unique == unique.raw_bytes()
    assert any("held more than once" in line for line in _restore_lines(r, 0))
    assert "merged the store's 4 objects into 1 object" in _upload_lines(up, 0)[0]
    # Every shard's warm run hits everything from the one object, and stores nothing.
    for shard in shards:
        s = shard.session(store)
        s.start_restore(background=False)
        assert shard.hits_everything(s) and s.restore_stats.objects_used == 1
        assert s.restore_stats.raw_fetched == s.restore_stats.raw_unique
        s.finish(shard.compile(s))  # type: ignore[arg-type]
        assert s.upload_stats.reason == "nothing new" and not s.problems
    assert list(objects(store)) == list(after)


def test_all_shards_warm_at_once_converge_and_lose_nothing(shared: Store, tmp_path: Path) -> None:
    store = shared
    shards = [Shard(tmp_path, i, header=shared_bytes(20_000, 3)) for i in range(K)]
    cold_wave(store, shards)
    everything = {e.ident for e in union(objects(store))}
    sessions = [shard.session(store) for shard in shards]
    for s in sessions:
        s.start_restore(background=False)
    assert all(shard.hits_everything(s) for shard, s in zip(shards, sessions, strict=True))
    finish_together(sessions, [shard.compile(s) for shard, s in zip(shards, sessions, strict=True)], restore="done")
    after = objects(store)
    assert len(after) == 1 and {e.ident for e in union(after)} == everything
    assert all(not s.problems and s.upload_stats.converged == K for s in sessions)


def test_an_entry_held_by_several_objects_is_decompressed_and_written_once(tmp_path: Path) -> None:
    # A precompiled header over a frame's size, in every shard's object: a warm session decompresses it once.
    store = LocalDirStore(tmp_path / "store")
    header = random.Random(5).randbytes(payload.FRAME_BYTES + 10)
    shards = [Shard(tmp_path, i, header=header) for i in range(3)]
    cold_wave(store, shards)
    warm = shards[0].session(store, writes=False)
    warm.start_restore(background=False)
    r = warm.restore_stats
    assert shards[0].hits_everything(warm) and r.objects_used == 3
    small = sum(e.raw_bytes() - len(header) - 4 for e in objects(store).values())
    assert r.raw_fetched > 3 * len(header)  # every object holds the header
    assert r.raw_unique < r.raw_decompressed <= r.raw_unique + small  # its bytes are decompressed once
    assert r.files_written == len(warm.restored.of_kind_prefix("file/"))
    # The restored files were moved into place: the session reads them from there (a merge would), its scratch
    # directory holds no copy of them.
    scratch = warm.scratch.path()
    pch = warm.restored.get(("file/pch", HEADER))
    placed = shards[0].roots[1].path / HEADER
    assert pch is not None and pch.path is not None and Path(pch.path).resolve() == placed.resolve()
    assert placed.read_bytes() == pch.data == b"gpch" + header
    assert [p.name for p in Path(scratch).iterdir()] == ["owner"]
    warm.finish(shards[0].compile(warm))  # type: ignore[arg-type]
    warm.close()
    assert not Path(scratch).exists()


def test_read_only_sessions_never_merge(tmp_path: Path) -> None:
    store = MemoryStore()
    shards = [Shard(tmp_path, i) for i in range(K)]
    cold_wave(store, shards)
    s = shards[0].session(store, writes=False)
    s.start_restore(background=False)
    s.finish(shards[0].compile(s))  # type: ignore[arg-type]
    assert s.upload_stats.reason == "read-only mode" and len(store.objects) == K


def test_races_of_warm_shards_converge_every_time(tmp_path: Path) -> None:
    """Warm shards restoring and merging at once, their steps interleaved at random (the memory store yields
    between operations): every round ends with one object holding every entry, and every restore got all of it."""
    rounds = int(os.environ.get("TESTS_RACE_ROUNDS", "100"))  # 100 in the suite; run with 300 for more
    rng = random.Random(35)

    class Jittery(MemoryStore):
        def _pause(self) -> None:
            if rng.random() < 0.5:
                threading.Event().wait(rng.random() / 2000)

        def list(self, folder: str) -> list[Any]:
            self._pause()
            return super().list(folder)

        def get(self, folder: str, name: str, max_bytes: int) -> bytes | None:
            self._pause()
            return super().get(folder, name, max_bytes)

        def put(self, folder: str, name: str, data: bytes) -> None:
            self._pause()
            super().put(folder, name, data)

        def delete(self, folder: str, name: str) -> None:
            self._pause()
            super().delete(folder, name)

    failures = []
    for n in range(rounds):
        store = Jittery()
        seeds = [Shard(tmp_path, i, graphs=1) for i in range(K)]
        for shard in seeds:  # the cold wave, one after the other: K objects, each with the shared entries
            s = CacheSession(store_factory=factory(store), folder=FOLDER, fingerprint=FP, roots=[], reads=False,
                             writes=True)
            s.start_restore(background=False)
            s.finish(FakeTorch([*shard.keys, "fshared".ljust(52, "0")]))  # type: ignore[arg-type]
        everything = {e.ident for e in union(objects(store))}
        sessions = [CacheSession(store_factory=factory(store), folder=FOLDER, fingerprint=FP, roots=[], reads=True,
                                 writes=True) for _ in range(K)]
        # Each restores, then finishes at once: one's merge and deletions may run while another still restores.
        finish_together(sessions, [FakeTorch([]) for _ in sessions], restore="in_thread")
        restored_all = all(("torch/inductor", k) in s.restored for s in sessions for shard in seeds for k in shard.keys)
        stored = objects(store)
        ok = (len(stored) == 1 and {e.ident for e in union(stored)} == everything and restored_all
              and not any(s.problems for s in sessions))
        if not ok:
            failures.append((n, len(stored), restored_all, [s.problems for s in sessions]))
    assert not failures, failures[:3]


# --- no size cliff ----------------------------------------------------------------------------------


def kernel_session(store: Store, tmp: Path, name: str, files: dict[str, bytes], **kw: Any) -> CacheSession:
    """A session that writes ``files`` into its inductor cache directory (as g++ would) and compiles nothing else."""
    root = FileRoot("inductor", tmp / name / "inductor")
    s = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[root], reads=True,
                     writes=True, **kw)
    s.start_restore(background=False)
    for rel, data in files.items():
        target = root.path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.write_bytes(data)
    s.finish(FakeTorch([]))  # type: ignore[arg-type]
    return s


def restored_files(store: Store, tmp: Path, name: str, **kw: Any) -> tuple[CacheSession, dict[str, bytes]]:
    s = kernel_session(store, tmp, name, {}, **kw)
    root = tmp / name / "inductor"
    return s, {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def kernels(n: int, size: int, tag: str) -> dict[str, bytes]:
    return {f"{tag}{i:02d}/k{i}.so": fake_elf(os.urandom(size)) for i in range(n)}


LIMITS = Limits(max_object_bytes=100_000, max_raw_bytes=150_000)


def part_of(store: Store, name: str) -> dict[str, Any]:
    blob = store.get(FOLDER, name, 1 << 30)
    assert blob is not None
    doc = bundlemod.decode_header(blob)[0].extra[PART_FIELD]
    assert isinstance(doc, dict)
    return doc


def test_new_entries_over_the_limits_upload_as_parts_and_restore_whole(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    files = kernels(7, 30_000, "a")  # 210 KB raw, incompressible: at least three objects
    cold = kernel_session(store, tmp_path, "cold", files, limits=LIMITS)
    assert not cold.problems and cold.upload_stats.objects >= 3
    listed = store.list(FOLDER)
    assert len(listed) == cold.upload_stats.objects and all(i.size <= LIMITS.max_object_bytes for i in listed)
    parts = [part_of(store, info.name) for info in listed]
    assert {p["group"] for p in parts} == {parts[0]["group"]} and sorted(p["index"] for p in parts) == list(
        range(len(parts)))
    assert sum(len(e) for e in objects(store).values()) == len(files)  # split by entry, none twice
    warm, got = restored_files(store, tmp_path, "warm", limits=LIMITS)
    assert got == files
    # A group is one object to compaction: the warm session has nothing to merge.
    assert warm.upload_stats.converged == 0 and len(store.list(FOLDER)) == len(listed)


def test_a_compaction_over_the_limits_splits_and_a_fresh_session_restores_every_entry(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    files: dict[str, bytes] = {}
    for n in range(4):  # four sessions, one after the other, each adding two kernels
        new = kernels(2, 25_000, f"s{n}")
        kernel_session(store, tmp_path, f"cold{n}", new, limits=LIMITS, compact_after=100)
        files.update(new)
    assert len(store.list(FOLDER)) == 4
    more = kernels(1, 25_000, "m")
    merging = kernel_session(store, tmp_path, "merging", more, limits=LIMITS, compact_after=2)
    files.update(more)
    assert not merging.problems and merging.upload_stats.compacted == 4 and merging.upload_stats.objects >= 3
    listed = store.list(FOLDER)
    assert len({part_of(store, info.name)["group"] for info in listed}) == 1
    assert all(info.size <= LIMITS.max_object_bytes for info in listed)
    _s, got = restored_files(store, tmp_path, "fresh", limits=LIMITS)
    assert got == files


def test_an_entry_over_the_limits_on_its_own_is_left_out_and_the_rest_stored(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    files = {**kernels(2, 20_000, "ok"), "big/huge.so": fake_elf(os.urandom(120_000))}
    s = kernel_session(store, tmp_path, "cold", files, limits=LIMITS)
    [problem] = s.problems
    assert "not storing 1 entry" in problem and "big/huge.so" in problem
    _w, got = restored_files(store, tmp_path, "warm", limits=LIMITS)
    assert set(got) == {k for k in files if not k.startswith("big/")}


def test_a_group_with_a_part_missing_is_pending_until_stale() -> None:
    headers = []
    for i in range(3):
        last = {"count": 3} if i == 2 else {}  # the last part says how many there are
        blob = bundlemod.encode(Entries(), FP, extra={PART_FIELD: {"group": "20260101T000000000-1-aaaaaaaaaaaa.mcb",
                                                                  "index": i, **last}})
        headers.append(bundlemod.decode_header(blob)[0])
    parts = [Held(f"p{i}", h.created, Entries(), (h,)) for i, h in enumerate(headers)]
    [whole], pending = units(parts)
    assert whole.objects == ("p0", "p1", "p2") and pending == []
    got, pending = units(parts[:2])
    assert got == [] and pending == ["p0", "p1"]
    got, pending = units(parts[1:])
    assert got == [] and pending == ["p1", "p2"]
    got, pending = units(parts[:2], now=headers[0].created + STALE_GROUP_SECONDS + 1)
    assert [g.name for g in got] == ["p0", "p1"] and pending == []


# --- what overlapping objects cost -----------------------------------------------------------------------


def test_ls_shows_the_bytes_a_fingerprints_objects_hold_twice(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    from pytest_megacache import cli
    from pytest_megacache.bundle import Entry
    from pytest_megacache.stores import new_object_name

    store = LocalDirStore(tmp_path)
    folder = f"pytest-megacache/main/{FP}"
    shared = Entry("file/pch", HEADER, b"gpch" + b"h" * 5000)
    for i in range(3):  # three shards' objects, each with the header and a graph of its own
        store.put(folder, new_object_name(), bundlemod.encode(
            Entries([shared, Entry("torch/inductor", graph(i, 0), b"g" * 100)]), FP))
    alone = FP.replace("0123456789ab", "ba9876543210")
    store.put(f"pytest-megacache/main/{alone}", new_object_name(), bundlemod.encode(Entries([shared]), alone))
    assert cli.main(["ls", "--dir", str(tmp_path), "--duplicates", "--json"]) == 0
    doc = {g["fingerprint"]: g for g in json.loads(capsys.readouterr().out)}
    assert doc[FP]["duplicated_bytes"] == 2 * len(shared.data) and doc[alone]["duplicated_bytes"] == 0
    assert cli.main(["ls", "--dir", str(tmp_path), "--duplicates"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[-1] == "DUPLICATED"
    assert {row.split()[1]: row.split(None, 7)[-1] for row in rows[:2]} == {FP: "10.0 KB", alone: "0 B"}
    assert cli.main(["ls", "--dir", str(tmp_path)]) == 0
    assert "DUPLICATED" not in capsys.readouterr().out  # reading every object only when asked
