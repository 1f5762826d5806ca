"""Real torch.compile sessions: dynamic-shape profiles (TORCH_COMPILE_JOB_ID) reused by a warm run, signed
objects end to end, and restored objects torch would not load. (Per-test attribution with --megacache-durations
and fork pull requests are asserted on the shared sessions of tests/test_integration.py.)"""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache.bundle import Entries, Entry

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


def test_dynamic_shape_profile_makes_the_warm_run_compile_once(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Dynamic-shape profiles are the user's opt-in (TORCH_COMPILE_JOB_ID; the plugin sets none): then they are
    carried, keys with '/' included (torch makes them file names itself), and a warm run compiles once."""
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tmp_path / "store"),
                                          "TORCH_COMPILE_JOB_ID": "myorg/myrepo"}, tests=TWO_SHAPES)
    cold = project.run()
    cold.result.assert_outcomes(passed=1)
    assert cold.report is not None
    assert cold.report["torch"]["compiles"] == 2  # static shape first, then a dynamic recompile
    assert cold.report["upload"]["new_entries"].get("torch/pgo") == 1
    warm = project.run()
    warm.result.assert_outcomes(passed=1)
    assert warm.report is not None
    assert warm.report["torch"]["compiles"] == 1, warm.report["torch"]  # the profile says: dynamic at once
    assert (warm.fx_hits, warm.fx_misses) == (1, 0), warm.counters  # and that one graph is restored


def test_signed_objects_round_trip_and_unsigned_ones_are_refused(pytester: pytest.Pytester, tmp_path: Path) -> None:
    store = tmp_path / "store"
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store), "MEGACACHE_SIGNING_KEY": KEY})
    cold = project.run("-k", "test_f")
    assert cold.report is not None and cold.report["upload"]["objects"] == 1
    [signed] = list(store.rglob("*.mcb"))
    header = bundlemod.decode_header(signed.read_bytes(), verify_keys=[KEY.encode()])[0]
    assert header.signature is not None
    # Someone without the key plants an object (a kernel file) next to it.
    planted = signed.with_name("20990101T000000-1-abcdef.mcb")
    planted.write_bytes(bundlemod.encode(Entries([Entry("file/inductor", "zz/evil.so", b"\x7fELF")]),
                                         header.fingerprint))
    warm = project.run("-k", "test_f")
    warm.result.assert_outcomes(passed=1, deselected=2)
    assert warm.fx_misses == 0 and warm.fx_hits == 1  # the signed object was used
    assert warm.report is not None and warm.report["restore"]["objects_rejected"] == 1
    warm.result.stdout.fnmatch_lines([f"*refused*{planted.name}*unsigned object*"])
    assert not (warm.root / "inductor" / "zz" / "evil.so").exists()
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
