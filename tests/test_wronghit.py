"""Never a wrong hit across CPU vector ISAs: cold under one capability, warm under another, compiled vs eager.

torch's Inductor hard-codes the vector width it picked into the generated C++ and its FX-graph key has no field
for it, so a graph compiled under AVX-512 and loaded where torch picks AVX2 computes wrong numbers (torch's own
cache directory has that hole: the control below shows it). A frame's Dynamo entry calls the graphs compiled with
it, so it carries that width too. The fingerprint keys on the ISA torch picks, so a warm run under another capability
restores nothing, takes no frame from the store and compiles its own code.
"""

from __future__ import annotations

import textwrap

import pytest

from .helpers_torch import Run, TorchProject, skip_without_torch

# 64 floats: a width mismatch (16 lanes compiled, 8 run) leaves whole vectors unwritten or wrong.
DIFFERENTIAL_TESTS = textwrap.dedent(
    """
    import torch

    def f(x):
        return torch.sin(x) * 2 + 1

    def g(x):
        return (x * x).sum(0) + torch.cos(x).amax(0)

    def test_pointwise_matches_eager():
        x = torch.linspace(-3, 3, 64)
        out = torch.compile(f)(x)
        wrong = int((~torch.isclose(out, f(x), atol=1e-5)).sum())
        assert wrong == 0, f"{wrong} of 64 elements differ from eager"

    def test_reduction_matches_eager():
        x = torch.linspace(-1, 1, 64 * 24).reshape(64, 24)
        out = torch.compile(g)(x)
        wrong = int((~torch.isclose(out, g(x), atol=1e-5)).sum())
        assert wrong == 0, f"{wrong} of 24 elements differ from eager"
    """
)


def _key(run: Run) -> str:
    assert run.report is not None, run.result.outlines[-20:]
    return str(run.report["fingerprint"]["key"])


def _isa(run: Run) -> str:
    return _key(run).split("/")[1]


def _frames(run: Run) -> tuple[int, int]:
    """Dynamo reuse's count of the frames the session took from the store, and of those it traced."""
    assert run.report is not None, run.result.outlines[-20:]
    counters = run.report["torch"]["counters"]
    return counters["dynamo_frames_reused"], counters["dynamo_traced"]


@pytest.mark.torch
def test_a_warm_run_under_another_cpu_capability_never_hits_code_built_for_the_first(pytester: pytest.Pytester) -> None:
    skip_without_torch()
    store = pytester.path / "store"
    # On the plugin's defaults: Dynamo reuse on
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store)}, tests=DIFFERENTIAL_TESTS, dynamo_reuse=True)
    cold = project.run("-v", env={"ATEN_CPU_CAPABILITY": None})
    cold.result.assert_outcomes(passed=2)
    assert cold.fx_misses == 2 and cold.report is not None and cold.report["upload"]["objects"] == 1
    assert cold.report["upload"]["new_entries"].get("torch/precompile") == 2, cold.report["upload"]  # f's and g's
    picked = _isa(cold)

    # Positive control: the same capability on fresh directories takes both frames from what the cold run stored
    # (their compiled graphs with them: nothing is traced or looked up).
    same = project.run("-v", env={"ATEN_CPU_CAPABILITY": None})
    same.result.assert_outcomes(passed=2)
    assert _frames(same) == (2, 0)
    assert same.fx_misses == same.aot_misses == 0, same.counters
    assert _key(same) == _key(cold)

    # Other capabilities: another key, nothing restored, every result right. AVX2 only where the default is wider;
    # 'default' (scalar code) everywhere torch vectorizes.
    if picked.startswith("cpu-novec"):
        pytest.skip("torch generates scalar code on this CPU: no other capability to compare with")
    others = ["default"] + (["avx2"] if picked.startswith(("cpu-avx512", "cpu-amx")) else [])
    for capability in others:
        warm = project.run("-v", env={"ATEN_CPU_CAPABILITY": capability})
        warm.result.assert_outcomes(passed=2)
        assert warm.report is not None
        assert _key(warm) != _key(cold), capability
        assert _isa(warm).startswith("cpu-novec" if capability == "default" else "cpu-avx2"), _key(warm)
        assert warm.report["restore"]["objects_used"] == 0, capability
        assert (warm.fx_hits, warm.fx_misses) == (0, 2), capability
        assert _frames(warm) == (0, 2), capability  # no frame taken: each traced, its graphs compiled here

    # Control: torch's own cache, plugin off, over the cold run's own cache directory under the narrowest other
    # capability, takes the cold run's graphs: the workload above does detect such a wrong hit. Where the cold run
    # picked AVX-512 or AMX, under AVX2 the 16-lane code loads and computes wrong numbers; where it picked AVX2,
    # under 'default' the vector code is built again with scalar flags and does not compile (scalar code, which a
    # miss would generate, never names at::vec).
    control = others[-1]
    hole = project.run("-v", "-p", "no:megacache",
                       env={"ATEN_CPU_CAPABILITY": control, "TORCHINDUCTOR_CACHE_DIR": str(cold.root / "inductor")})
    assert hole.result.ret != 0, hole.result.outlines[-30:]
    if control == "avx2":
        assert hole.fx_hits >= 1, hole.counters
        wrong = [line for line in hole.result.outlines if "differ from eager" in line]
    else:  # the hit fails in its build, before torch counts it
        wrong = [line for line in hole.result.outlines if "error:" in line and "vec" in line]
    assert wrong, ("torch's own FX-graph cache no longer mixes vector widths: this control needs another workload",
                   hole.result.outlines[-30:])
