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


DYNAMO = "torch/precompile"


def handed(worker: str, *entries: Entry) -> dict[str, object]:
    """A worker's workeroutput value for ``entries`` (sent as bytes, as to a worker on another host)."""
    return {**xdist.hand_over(None, worker, Entries(entries), FP), "problems": []}


def test_the_workers_copies_of_one_dynamo_entry_are_merged_once_in_any_order() -> None:
    """Each worker traced other variants of one function: the controller stores one entry holding both copies'
    (the merge is handed every distinct copy once, and only where there are two); an entry one worker handed over, or
    several handed over alike, is stored as it came, and other kinds keep the first copy."""
    key, alone, alike = "a" * 64, "b" * 64, "c" * 64
    graph = "fa" + "a" * 50
    calls: list[list[bytes]] = []

    def merge(copies: list[bytes]) -> bytes:
        calls.append(list(copies))
        return b"+".join(sorted(copies))

    for order in (("gw0", "gw1"), ("gw1", "gw0")):
        outputs = {"gw0": handed("gw0", Entry(DYNAMO, key, b"float32"), Entry(DYNAMO, alike, b"same"),
                                 Entry(DYNAMO, alone, b"only gw0's"), Entry("torch/inductor", graph, b"gw0's graph")),
                   "gw1": handed("gw1", Entry(DYNAMO, key, b"float64"), Entry(DYNAMO, alike, b"same"),
                                 Entry("torch/inductor", graph, b"gw1's graph"))}
        takeover = xdist.Takeover(FP)
        for worker in order:
            takeover.take(worker, outputs[worker], None)
        calls.clear()
        takeover.merge_dynamo(merge)
        assert [sorted(copies) for copies in calls] == [[b"float32", b"float64"]]
        stored = {entry.name: entry.data for entry in takeover.entries}
        assert stored == {key: b"float32+float64", alike: b"same", alone: b"only gw0's",
                          graph: f"{order[0]}'s graph".encode()}
        assert (takeover.dynamo_merged, takeover.dynamo_unmerged, takeover.problems, takeover.notes) == (1, 0, [], [])


def test_copies_that_cannot_be_merged_keep_the_first_and_say_so_once() -> None:
    """A merge that refuses (other code, one name for two objects) or fails keeps the first worker's copy, as before;
    each entry is counted, and said once: a failure as a problem, a refusal as a note."""
    keys = ["a" * 64, "b" * 64]

    def take_both() -> xdist.Takeover:
        takeover = xdist.Takeover(FP)
        for worker in ("gw0", "gw1"):
            takeover.take(worker, handed(worker, *(Entry(DYNAMO, key, f"{worker} {key[0]}".encode()) for key in keys)),
                          None)
        return takeover

    def fails(copies: list[bytes]) -> bytes:
        raise RuntimeError("torch refused it")

    for merge, problems, notes in ((fails, 1, 0), (lambda copies: None, 0, 1)):
        takeover = take_both()
        takeover.merge_dynamo(merge)
        assert {entry.name: entry.data for entry in takeover.entries} == {key: f"gw0 {key[0]}".encode() for key in keys}
        assert (takeover.dynamo_merged, takeover.dynamo_unmerged) == (0, 2)
        assert (len(takeover.problems), len(takeover.notes)) == (problems, notes), (takeover.problems, takeover.notes)
        said = (takeover.problems + takeover.notes)[0]
        assert said.startswith("2 Dynamo entries traced in several xdist workers not merged"), said
        assert ("torch refused it" in said) == bool(problems), said
