"""With the plugin on, cold or warm, torch compiles and runs the same graphs as without it.

The plugin used to set TORCH_COMPILE_JOB_ID, which turns on torch's dynamic-shape profiles: a profile survives
``torch._dynamo.reset()``, so two independent tests compiling one function with different shapes compiled
``[static, static]`` without the plugin and ``[static, dynamic]`` with it. Here the tests compile with torch's own
backend (Inductor), so the warm run takes every frame from the store (Dynamo reuse) instead of tracing it, and what
each test ends up with is read from Dynamo's cache of the function after each call: every compiled variant, as the
input sizes its guards accept (a static graph one size, a dynamic graph a range), and the call's result. The three
runs must agree call for call. A stored dynamic variant accepts the sizes of the static ones too: where a fresh
trace would be static, taking it would change the graphs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .helpers_torch import TorchProject, skip_without_torch

skip_without_torch()
pytestmark = pytest.mark.torch

SHAPES = textwrap.dedent(
    """
    import json, os

    import torch

    def f(x):
        return torch.sin(x) + x.sum()

    def compile_and_record(test, sizes):
        torch._dynamo.reset()
        compiled = torch.compile(f)
        for n in sizes:
            out = compiled(torch.arange(n, dtype=torch.float32))
            variants = [[p for p in range(1, 13) if entry.guard_manager.check({"x": torch.zeros(p)})]
                        for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)]
            with open(os.environ["GRAPHS_OUT"], "a") as fh:
                fh.write(json.dumps({"test": test, "size": n, "variants": variants,
                                     "result": [round(v, 4) for v in out.tolist()]}) + "\\n")

    def test_small():
        compile_and_record("small", [4])

    def test_large():
        compile_and_record("large", [9, 11])  # the second size of the same test: a dynamic graph
        # What Inductor decided about the CPU's vector ISA for these kernels (the plugin reuses its load check).
        from torch._inductor import cpu_vec_isa as m
        picked = m.pick_vec_isa()
        with open(os.environ["GRAPHS_OUT"] + ".isa", "w") as fh:
            json.dump({"valid": [str(i) for i in m.valid_vec_isa_list()], "picked": str(picked),
                       "flags": picked.build_arch_flags()}, fh)
    """
)


def graphs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_independent_tests_compile_the_same_graphs_off_cold_and_warm(pytester: pytest.Pytester, tmp_path: Path) -> None:
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(tmp_path / "store")}, tests=SHAPES, dynamo_reuse=True)
    seen, isa, checks, isa_seconds, reuse = {}, {}, {}, {}, {}
    for name, args in (("off", ("-p", "no:megacache")), ("cold", ()), ("warm", ())):
        out = tmp_path / f"{name}.jsonl"
        run = project.run(*args, env={"GRAPHS_OUT": str(out)})
        run.result.assert_outcomes(passed=2)
        seen[name] = graphs(out)
        isa[name] = json.loads(Path(f"{out}.isa").read_text())
        checks[name] = (run.report or {}).get("torch", {}).get("isa_checks")
        isa_seconds[name] = [p["isa_check"] for p in (run.report or {}).get("processes", [])]
        reuse[name] = ((run.report or {}).get("torch", {}).get("counters", {}), run.counters["traces_per_test"])
    # Without the plugin: each test's first graph static, for its size alone ([static, static] across the tests)...
    variants = [[v if len(v) == 1 else "dynamic" for v in call["variants"]] for call in seen["off"]]
    assert variants == [[[4]], [[9]], ["dynamic", [9]]], seen["off"]
    assert seen["cold"] == seen["off"]  # ...and the very same graphs and results with it, cold
    assert seen["warm"] == seen["off"]  # and warm, every graph taken from the store:
    counters, traces = reuse["warm"]
    assert counters["dynamo_frames_reused"] == 3 and counters["dynamo_traced"] == 0, counters  # the plugin's count
    assert sum(traces.values()) == 0, traces  # and torch's: Dynamo traced nothing
    # The same vector ISA, decided by torch's own load check cold and taken from its record warm.
    assert isa["cold"] == isa["off"] and isa["warm"] == isa["off"]
    if isa["off"]["valid"]:
        assert checks["cold"]["run"] >= 1 and checks["cold"]["recorded"] == checks["cold"]["run"], checks
        assert checks["warm"] == {"reused": checks["cold"]["run"]}, checks
        # Their seconds are a phase of their own in the per-process times: a child per check cold, records warm.
        assert isa_seconds["cold"][0] > isa_seconds["warm"][0] > 0, isa_seconds
    else:  # a CPU without a vector ISA torch knows: nothing to check
        assert checks["cold"] == checks["warm"] == {}, checks


def test_required_signatures_fail_closed_on_an_empty_key(pytester: pytest.Pytester, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """GitHub gives a missing secret as an empty string: with --megacache-require-signature nothing unsigned is
    trusted, so nothing is restored or uploaded (one warning); under --megacache-strict the session stops."""
    monkeypatch.setenv("MEGACACHE_SIGNING_KEY", "")
    pytester.makepyfile("def test_one():\n    assert True\n")
    report = tmp_path / "r.json"
    store = tmp_path / "store"
    result = pytester.runpytest_subprocess(f"--megacache-dir={store}", "--megacache-require-signature",
                                           f"--megacache-report={report}")
    result.assert_outcomes(passed=1)
    warnings = [line for line in result.outlines if "MegacacheWarning" in line]
    assert len(warnings) == 1 and "signatures are required" in warnings[0]
    doc = json.loads(report.read_text())
    assert doc["enabled"] is False and "MEGACACHE_SIGNING_KEY is empty or unset" in doc["reason"]
    assert not store.exists()
    strict = pytester.runpytest_subprocess(f"--megacache-dir={store}", "--megacache-require-signature",
                                           "--megacache-strict")
    assert strict.ret == pytest.ExitCode.USAGE_ERROR
    assert "signatures are required" in "\n".join(strict.errlines)
