"""Each phase of a session works on its own, without a CacheSession: the compaction deletes what a stored object
covers and nothing else; the restore, given only what it reads of a session, restores and settles."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry, Limits
from pytest_megacache.bundle.payload import FRAME_BYTES
from pytest_megacache.compaction import Compaction, Held
from pytest_megacache.files import FileRoot
from pytest_megacache.report import UploadStats
from pytest_megacache.restore import Restore
from pytest_megacache.scratch import Scratch
from pytest_megacache.stores import MemoryStore, Store, new_object_name
from pytest_megacache.stores.deadline import Deadline

FP = "torch-2.13.0/cpu-avx2-t4/py3.11-linux-x86_64"
FOLDER = f"pytest-megacache/main/{FP}/0123456789ab"


def graph(i: int) -> Entry:
    return Entry("torch/inductor", f"f{i:04d}".ljust(52, "0"), f"graph {i}".encode())


def put(store: Store, *entries: Entry) -> str:
    name = new_object_name()
    store.put(FOLDER, name, bundlemod.encode(Entries(entries), FP))
    return name


def test_a_compaction_alone_deletes_only_what_its_object_covers(tmp_path: Path) -> None:
    store = MemoryStore()
    covered = put(store, graph(1))
    apart = put(store, graph(9))  # shares no entry with the merged object: it stays
    merged_entries = Entries([graph(1), graph(2)])
    mine_name = put(store, *merged_entries)
    mine = Held(mine_name, 2e9, merged_entries)
    stats = UploadStats()
    scratch = Scratch()

    def never(entries: Entries, sources: Any) -> None:
        raise AssertionError("nothing left to merge")

    Compaction(store=store, deadline=Deadline(30, "the upload"), folder=FOLDER, fingerprint=FP, limits=Limits(),
               signing_keys=(), scratch=scratch, restored=Entries(), restored_units=[], inputs=set(), stats=stats,
               scrub=lambda e: e, store_merged=never).run(mine)
    scratch.close()
    assert sorted(info.name for info in store.list(FOLDER)) == sorted([apart, mine_name])
    assert covered not in {info.name for info in store.list(FOLDER)} and stats.superseded == 1


@dataclass
class Owner:
    """What a restore reads of its session, and nothing more."""

    roots: list[FileRoot]
    store: Store
    folder: str = FOLDER
    fingerprint: str = FP
    limits: Limits = field(default_factory=Limits)
    signing_keys: list[bytes] = field(default_factory=list)
    reads: bool = True
    restore_timeout: float = 30.0
    diagnosis: None = None
    stage: None = None
    on_settled: None = None
    scratch: Scratch = field(default_factory=Scratch)
    problems: list[str] = field(default_factory=list)

    @property
    def read_folders(self) -> list[str]:
        return [self.folder]

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def bounded_store(self, deadline: Deadline) -> Store:
        return self.store


def test_a_restore_alone_restores_and_settles(tmp_path: Path) -> None:
    store = MemoryStore()
    kernel = Entry("file/inductor", "ab/cabc123def.so", b"\x7fELF\x02\x01\x01" + bytes(57) + b"k" * FRAME_BYTES,
                   0o755)  # over a frame's size: a frame of its own
    put(store, graph(1), kernel)
    put(store, graph(2), kernel)  # the same kernel twice: decompressed and written once
    owner = Owner([FileRoot("inductor", tmp_path / "inductor")], store)
    restore = Restore(owner)  # type: ignore[arg-type]
    restore.start(background=False)
    assert restore.wait() and restore.finished and not owner.problems
    assert {e.name for e in restore.restored} == {graph(1).name, graph(2).name, kernel.name}
    assert restore.stats.files_written == 1 and restore.stats.objects_used == 2
    assert restore.stats.raw_decompressed == restore.stats.raw_unique < restore.stats.raw_fetched
    assert (tmp_path / "inductor" / "ab" / "cabc123def.so").read_bytes() == kernel.data
    owner.scratch.close()
