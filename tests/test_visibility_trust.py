"""Real torch.compile sessions: dynamic-shape profiles (TORCH_COMPILE_JOB_ID) reused by a warm run, signed
objects end to end, and restored objects torch would not load. (Per-test attribution with --megacache-durations
and fork pull requests are asserted on the shared sessions of tests/test_integration.py.)"""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry

from .conftest import fake_elf
from .helpers_torch import Run, TorchProject, skip_without_torch

skip_without_torch()
pytestmark = pytest.mark.torch

KEY = "k" * 32


TWO_SHAPES = textwrap.dedent(
    """
    import torch

    @torch.compile
    def f(x):
        return torch.sin(x) + x.sum()

    def test_two_shapes():
        assert f(torch.zeros(4)).shape == (4,)
        assert f(torch.zeros(9)).shape == (9,)
    """
)


def dynamo(run: Run) -> dict[str, int]:
    """The session's Dynamo reuse counters (frames taken from the store, traced, entries loaded and stored) and its
    refusals by reason, those it counted only."""
    assert run.report is not None, run.result.outlines[-30:]
    counters = run.report["torch"]["counters"]
    return {name.removeprefix("dynamo_"): n for name, n in counters.items()
            if name in ("dynamo_frames_reused", "dynamo_traced", "dynamo_reused", "dynamo_stored")
            or (name.startswith("dynamo_refused_") and n)}


def test_dynamic_shape_profile_makes_the_warm_run_compile_once(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Dynamic-shape profiles are the user's opt-in (TORCH_COMPILE_JOB_ID; the plugin sets none): then they are
    carried, keys with '/' included (torch makes them file names itself), and a warm run compiles once. With Dynamo
    reuse on (the default), the restored profile decides as it does without reuse: neither stored variant was traced
    under the record the profile holds (the static one under none, the dynamic one after the static size), so
    neither is taken; the frame is traced once, dynamic at once, into the cold run's dynamic graph."""
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tmp_path / "store"),
                                          "TORCH_COMPILE_JOB_ID": "myorg/myrepo"}, tests=TWO_SHAPES, dynamo_reuse=True)
    cold = project.run()
    cold.result.assert_outcomes(passed=1)
    assert cold.report is not None
    assert cold.report["torch"]["compiles"] == 2  # static shape first, then a dynamic recompile
    assert cold.report["upload"]["new_entries"].get("torch/pgo") == 1
    # both variants stored, in the function's one Dynamo entry
    assert cold.report["upload"]["new_entries"].get("torch/precompile") == 1, cold.report["upload"]
    assert dynamo(cold) == {"frames_reused": 0, "traced": 2, "reused": 0, "stored": 2}
    warm = project.run()
    warm.result.assert_outcomes(passed=1)
    assert warm.report is not None
    assert warm.report["torch"]["compiles"] == 1, warm.report["torch"]  # the profile says: dynamic at once
    assert warm.counters["traces_per_test"] == {"test_compiled.py::test_two_shapes": 1}, warm.counters  # torch's own
    assert warm.counters["graphs_per_test"] == {"test_compiled.py::test_two_shapes": 1}, warm.counters
    # The entry was loaded and its variants offered; the profile's record is not what either was traced under.
    taken = dynamo(warm)
    assert (taken["reused"], taken["frames_reused"], taken["traced"]) == (1, 0, 1), taken
    assert {k: v for k, v in taken.items() if k.startswith("refused_")} == {"refused_shapes_seen": 1}, taken
    # and that one graph is the cold run's dynamic one, restored (a frame traced looks it up; the AOTAutograd
    # entry holds the compiled graph, so the FX-graph cache is not asked)
    assert (warm.aot_hits, warm.aot_misses, warm.fx_misses) == (1, 0, 0), warm.counters


def _forged(signed: bytes, entries: Entries, fingerprint: str) -> bytes:
    """Another payload under a signed object's signature: what a writer without the key makes of an object it read,
    with every header field that describes the payload fixed up (and a later time, so that its copies would win): a
    well-formed object, which only the signature check stops."""
    plain = bundlemod.encode(entries, fingerprint)
    head = 9 + int.from_bytes(plain[5:9], "big")
    doc: dict[str, Any] = json.loads(plain[9:head])
    doc["sig"] = json.loads(signed[9 : 9 + int.from_bytes(signed[5:9], "big")])["sig"]
    header = json.dumps(doc).encode()
    return plain[:5] + len(header).to_bytes(4, "big") + header + plain[head:]


def test_signed_objects_round_trip_and_unsigned_or_forged_ones_are_refused(pytester: pytest.Pytester,
                                                                          tmp_path: Path) -> None:
    """On the plugin's defaults (Dynamo reuse on): the signed object holds the frame's Dynamo entry and a warm run
    takes the frame from it; an unsigned object and a signed one whose payload was replaced are refused before any
    of their entries reaches the disk or torch."""
    store = tmp_path / "store"
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store), "MEGACACHE_SIGNING_KEY": KEY},
                           dynamo_reuse=True)
    cold = project.run("-k", "test_f")
    assert cold.report is not None and cold.report["upload"]["objects"] == 1
    [signed] = list(store.rglob("*.mcb"))
    header, entries = bundlemod.decode(signed.read_bytes(), verify_keys=[KEY.encode()])
    assert header.signature is not None
    assert entries.counts().get("torch/precompile") == 1, entries.counts()  # f's Dynamo entry, signed
    # Someone without the key plants an object (a kernel file) next to it...
    planted = signed.with_name("20990101T000000-1-abcdef.mcb")
    planted.write_bytes(bundlemod.encode(Entries([Entry("file/inductor", "zz/evil.so", fake_elf())]),
                                         header.fingerprint))
    # ...and rewrites the signed object's payload: its Dynamo entry replaced, a kernel file added.
    forged = signed.with_name("20990101T000000-2-abcdef.mcb")
    rewritten = Entries([e.with_data(b"\x80\x04not the stored entry.") if e.kind == "torch/precompile" else e
                         for e in entries])
    rewritten.add(Entry("file/inductor", "zz/forged.so", fake_elf()))
    forged.write_bytes(_forged(signed.read_bytes(), rewritten, header.fingerprint))
    warm = project.run("-k", "test_f")
    warm.result.assert_outcomes(passed=1, deselected=2)
    # The signed object was used: its one entry loaded, the frame taken from it, nothing traced (torch's own record)
    assert dynamo(warm) == {"frames_reused": 1, "traced": 0, "reused": 1, "stored": 0}, dynamo(warm)
    assert warm.counters["traces_per_test"] == {"test_compiled.py::test_f": 0}, warm.counters
    assert warm.fx_misses == warm.aot_misses == 0, warm.counters
    assert warm.report is not None and warm.report["restore"]["objects_used"] == 1
    assert warm.report["restore"]["objects_rejected"] == 2
    warm.result.stdout.fnmatch_lines([f"*refused*{planted.name}*unsigned object*"])
    warm.result.stdout.fnmatch_lines([f"*refused*{forged.name}*signature mismatch*"])
    # neither object's kernel file reached the disk (the folder itself may hold a real kernel: it is a hash prefix)
    assert not [name for name in ("evil.so", "forged.so") if (warm.root / "inductor" / "zz" / name).exists()]
    assert not any("trusted as-is" in line for line in warm.result.outlines)


def test_restored_but_unloadable_blames_the_load_not_the_settings(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Objects were restored, torch refused to load them, and hit none: the one warning says the load failed
    (it used to blame settings). The "same tests, no hit" warning naming likely causes is for objects torch
    did load (tests/stores/test_deadlines.py)."""
    from pytest_megacache.fingerprint import compute

    store = tmp_path / "store"
    key = compute().key
    folder = store.joinpath("pytest-megacache", "main", *key.split("/"))
    folder.mkdir(parents=True)
    unrelated = Entries([Entry("torch/inductor", "f" + "q" * 51, b"an FX graph this project never builds")])
    # Stored by a run of the very same tests (the selection digest the plugin records): were the load not the
    # cause, "hit none" would be a note naming a changed setting or code.
    selection = hashlib.sha256(b"test_compiled.py::test_f").hexdigest()[:32]
    (folder / "20260101T000000000-1-abcdef.mcb").write_bytes(
        bundlemod.encode(unrelated, key, extra={"producer": {"selection": selection}}))
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store), "MEGACACHE_MODE": "read"})
    run = project.run("-k", "test_f")
    assert run.fx_misses == 1 and run.fx_hits == 0
    assert run.report is not None and run.report["restore"]["objects_used"] == 1
    warnings = run.megacache_warnings()
    assert len(warnings) == 1 and "torch did not load the restored artifacts" in warnings[0], warnings
    assert run.report is not None and not any("compiled only graphs" in note for note in run.report["notes"])


def test_a_session_that_left_no_counters_fails_a_check_of_them(tmp_path: Path) -> None:
    """torch's counters are the witness of hits and misses: where no process wrote them (a session that crashed
    before its end, a conftest that did not run), a check of a count fails instead of reading zero."""
    result = pytest.RunResult(3, ["INTERNALERROR> boom"], [], 0.1)
    lost = Run(result, None, None, tmp_path)
    for read in (lambda: lost.fx_misses, lambda: lost.aot_hits, lambda: lost.counters):
        with pytest.raises(pytest.fail.Exception, match="no counters file"):
            read()
    idle = Run(result, {"modules": {"torch": True, "torch._dynamo": False}}, None, tmp_path)
    assert idle.counters["modules"]["torch"] is True
    with pytest.raises(pytest.fail.Exception, match="loaded torch's counters"):
        _ = idle.fx_misses
    compiled = Run(result, {"inductor": {"fxgraph_cache_hit": 2}, "aot_autograd": {}}, None, tmp_path)
    assert (compiled.fx_hits, compiled.fx_misses, compiled.aot_misses) == (2, 0, 0)
