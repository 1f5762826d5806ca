"""What an xdist controller stages for its workers tells them which test selections stored it."""

from __future__ import annotations

from pathlib import Path

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.core import CacheSession
from pytest_megacache.stores import MemoryStore
from pytest_megacache.xdist import staging as xdist

FP = "torch-x/cpu-avx2-t2/py3.11-linux-x86_64/0123456789ab"


def staged_header(stage_dir: Path) -> bundlemod.Header:
    [obj] = sorted((stage_dir / xdist.STAGE_FOLDER).glob("*.mcb"))
    return bundlemod.decode(obj.read_bytes(), FP)[0]


def test_a_worker_running_a_stored_selection_expects_everything_cached(tmp_path: Path) -> None:
    entries = Entries([Entry("torch/inductor", "fa" + "a" * 50, b"graph")])
    xdist.stage(tmp_path, entries, FP, ok=True, selections=["sel-a", "sel-b"])
    header = staged_header(tmp_path)
    assert header.extra["producer"] == {"selections": ["sel-a", "sel-b"]}
    worker = CacheSession(store_factory=MemoryStore, folder="f", fingerprint=FP, roots=[], reads=True, writes=False)
    worker.restored_headers.append(header)
    assert worker.expects_full_coverage("sel-b")
    assert not worker.expects_full_coverage("sel-c") and not worker.expects_full_coverage(None)


def test_a_plain_object_names_its_own_selection(tmp_path: Path) -> None:
    blob = bundlemod.encode(Entries([Entry("torch/inductor", "fa" + "a" * 50, b"graph")]), FP,
                            extra={"producer": {"selection": "sel-a", "selections": "not a list"}})
    header = bundlemod.decode(blob, FP)[0]
    controller = CacheSession(store_factory=MemoryStore, folder="f", fingerprint=FP, roots=[], reads=True, writes=False)
    controller.restored_headers.append(header)
    assert controller.producer_selections() == {"sel-a"}
    staged = Entries([Entry("torch/inductor", "fb" + "b" * 50, b"x")])
    xdist.stage(tmp_path, staged,
                FP, ok=True, selections=sorted(controller.producer_selections()))
    assert staged_header(tmp_path).extra["producer"] == {"selections": ["sel-a"]}


def test_nothing_restored_stages_no_object(tmp_path: Path) -> None:
    assert xdist.stage(tmp_path, Entries(), FP, ok=True, selections=["sel-a"]) is None
    assert not (tmp_path / xdist.STAGE_FOLDER).exists() or not list((tmp_path / xdist.STAGE_FOLDER).iterdir())


def test_a_graph_recorded_by_one_worker_travels_once() -> None:
    """Workers sharing cache directories (the user set them) find each other's graph files: the controller keeps the
    torch entry and drops the file twin; a child's graph (no torch entry anywhere) stays a file."""
    from pytest_megacache.core import other_process_layers, without_torch_twins

    key_a, key_b, key_c = "fa" + "a" * 50, "fb" + "b" * 50, "fc" + "c" * 50
    handed = Entries([Entry("torch/inductor", key_a, b"graph a"),
                      Entry("file/inductor", f"fxgraph/{key_a[1:3]}/{key_a}/entry", b"graph a on disk"),
                      Entry("file/inductor", f"fxgraph/{key_b[1:3]}/{key_b}/entry", b"graph b on disk"),
                      Entry("file/inductor", f"fxgraph/{key_c[1:3]}/{key_c}/entry", b"a child's graph"),
                      Entry("file/inductor", "ab/kernel.so", b"\x7fELF...")])
    restored = Entries([Entry("torch/inductor", key_b, b"graph b")])
    kept = without_torch_twins(handed, restored)
    assert sorted(e.name for e in kept) == sorted([key_a, f"fxgraph/{key_c[1:3]}/{key_c}/entry", "ab/kernel.so"])
    assert other_process_layers(kept) == {"inductor": 1}


def test_the_workers_notes_are_said_once() -> None:
    takeover = xdist.Takeover(FP)
    note = "torch's vector-ISA check records its own successes"
    takeover.take("gw0", {"notes": [note, "only gw0's"], "problems": ["a fault"]}, None)
    takeover.take("gw1", {"notes": [note, 42], "problems": []}, None)
    assert takeover.notes == [note, "only gw0's"]
    assert takeover.problems == ["[gw0] a fault"]
