"""The benchmark's own arithmetic (benchmarks/run.py): ratios, targets and the xdist one-download check,
on hand-made run records, so a wrong PASS cannot hide in the published tables. No torch, no server."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("run.py")


def runs(bench: ModuleType, downloads: float) -> list:  # type: ignore[type-arg]
    def r(mode: str, compile_s: float, rep: int = 0, **kw: object) -> object:
        return bench.Run("wl", mode, rep, ok=True, wall=compile_s + 5, compile_seconds=compile_s, fx_hit=1, fx_miss=0,
                         aot_hit=1, aot_miss=0, **kw)

    out = []
    for rep, cold in enumerate((40.0, 50.0, 60.0)):  # median cold 50
        out += [r("cold", cold, rep, upload_bytes=100, upload_raw_bytes=1000),
                r("warm", 4.0 + rep, rep, bytes_moved=90),  # median warm 5
                r("hot", 5.0, rep),
                r("naive", 5.0, rep, bytes_moved=120, extra={"pack_seconds": 0.1, "unpack_seconds": 0.2}),
                r("cold-xdist", 50.0, rep, upload_bytes=100, upload_raw_bytes=1000),
                r("warm-xdist", 2.5, rep, bytes_moved=int(100 * downloads),
                  extra={"bucket_objects": 1, "bucket_bytes": 100, "downloads": downloads})]
    return out


def test_ratios_are_of_medians_and_targets_are_checked(bench: ModuleType) -> None:
    wl = bench.Workload("wl", ROOT, [], ROOT / "pyproject.toml", "cpu")
    lines, summary = bench.workload_tables(wl, runs(bench, 1.0), 3)
    ratios = summary["ratios"]
    assert ratios["warm/cold compile"] == pytest.approx(5 / 50)
    assert ratios["warm/hot compile"] == pytest.approx(5 / 5)
    assert ratios["warm bytes moved / raw"] == pytest.approx(90 / 1000)
    assert ratios["warm bytes moved / naive tar.zst"] == pytest.approx(90 / 120)
    assert ratios["warm-xdist bytes fetched / bytes stored"] == 1.0
    assert ratios["warm-xdist/cold-xdist compile"] == pytest.approx(2.5 / 50)
    text = "\n".join(lines)
    assert "| warm/cold compile | 0.100 | <= 0.2 (cpu) | PASS |" in text
    assert "| 1.000 | 1 (one download for all workers) | PASS |" in text
    assert "| cold | 3/3 | 55.00 [45.00-65.00] | 50.00 [40.00-60.00] |" in text
    assert ratios["warm/cold wall"] == pytest.approx(10 / 55)
    assert "| warm/cold session wall | 0.182 | - | - |" in text  # no wall target on CPU


def test_workers_downloading_on_their_own_fail_the_xdist_check(bench: ModuleType) -> None:
    wl = bench.Workload("wl", ROOT, [], ROOT / "pyproject.toml", "cuda")
    lines, summary = bench.workload_tables(wl, runs(bench, 2.0), 3)
    assert summary["ratios"]["warm-xdist bytes fetched / bytes stored"] == 2.0
    text = "\n".join(lines)
    assert "| 2.000 | 1 (one download for all workers) | MISS |" in text
    assert "| warm/cold compile | 0.100 | <= 0.05 (cuda) | MISS |" in text  # the GPU bound is the tighter one
    assert "| warm/cold session wall | 0.182 | <= 0.2 (cuda) | PASS |" in text


def test_synthetic_functions_are_distinct_graphs(bench: ModuleType) -> None:
    source = bench.synthetic_source(12, "cpu")
    module = ast.parse(source)  # parsed, not run: running it would import torch in this (fast-tier) process
    functions = {node.name: node for node in module.body if isinstance(node, ast.FunctionDef)}
    assert sorted(n for n in functions if n.startswith("test_f_")) == sorted(f"test_f_{i}" for i in range(12))
    bodies = {ast.dump(ast.Module(body=functions[f"f_{i}"].body, type_ignores=[])) for i in range(12)}
    assert len(bodies) == 12  # each function has its own graph (its own FX key and kernel)


def test_triton_builds_are_counted_from_the_listener_log(bench: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    assert bench.triton_events(log) == (None, None)  # no process wrote one: the workload has no listener
    log.write_text('{"name": "k1", "cache_hit": false}\n{"name": "k2", "cache_hit": true}\n\n'
                   '{"name": "k1", "cache_hit": false}\n')
    assert bench.triton_events(log) == (2, 1)
    wl = bench.Workload("wl", ROOT, [], ROOT / "pyproject.toml", "cuda")
    rs = runs(bench, 1.0)
    for r in rs:
        if r.mode == "warm":
            r.triton_built, r.triton_hits = (2, 1) if r.repeat == 0 else (0, 3)
    text = "\n".join(bench.workload_tables(wl, rs, 3)[0])
    assert "| FX hit/miss | AOT hit/miss | Triton built/cached |" in text
    warm = next(line for line in text.splitlines() if line.startswith("| warm |"))
    assert "| 0/3, 2/1 |" in warm
    cold = next(line for line in text.splitlines() if line.startswith("| cold |"))
    assert "| 1/0 | 1/0 | - |" in cold


def test_the_mixed_workload_selects_cpu_and_gpu_tests_but_not_the_distributed_one(bench: ModuleType) -> None:
    import subprocess
    import sys

    wl = bench.make_mixed("cuda")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:megacache", *wl.args], cwd=wl.cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    files = {i.split("::")[0] for i in ids}
    assert {"tests/test_model_cpu.py", "tests/test_model_gpu.py"} <= files
    assert not [i for i in ids if "distributed" in i]


def test_skipped_modes_are_not_run_and_every_run_is_logged_as_it_finishes(bench: ModuleType, tmp_path: Path) -> None:
    import json
    from types import SimpleNamespace

    class FakeRunner(bench.Runner):  # type: ignore[misc,name-defined]
        """The real progress log; pytest runs replaced by records of what was asked."""

        def __init__(self) -> None:
            self.s3 = SimpleNamespace(create_bucket=lambda name: name)
            self.progress_file = tmp_path / "runs.jsonl"

        def plain(self, wl: object, repeat: int, root: Path) -> object:
            return bench.Run("wl", "plain", repeat, ok=True, wall=10.0)

        def run(self, wl: object, mode: str, repeat: int, root: Path, **kw: object) -> object:
            return bench.Run("wl", mode, repeat, ok=True, wall=5.0, compile_seconds=1.0, fx_hit=0, fx_miss=0,
                             aot_hit=0, aot_miss=0)

    wl = bench.Workload("wl", ROOT, [], ROOT / "pyproject.toml", "cpu")
    runs_, _ = bench.bench_workload(FakeRunner(), wl, 2, tmp_path / "work", threads=False, skip=["hot", "naive"])
    assert [r.mode for r in runs_] == ["plain", "cold", "warm"] * 2
    logged = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(d["mode"], d["repeat"]) for d in logged] == [(r.mode, r.repeat) for r in runs_]
    lines, summary = bench.workload_tables(wl, runs_, 2)
    assert summary["ratios"]["cold/plain wall"] == pytest.approx(0.5)
    assert not [line for line in lines if line.startswith(("| hot", "| naive"))]


def test_without_cold_xdist_the_warm_xdist_run_restores_from_the_serial_bucket(bench: ModuleType,
                                                                               tmp_path: Path) -> None:
    from types import SimpleNamespace

    asked: list[tuple[str, object]] = []
    created: list[str] = []

    class FakeRunner(bench.Runner):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.s3 = SimpleNamespace(create_bucket=lambda name: created.append(name) or name,
                                      objects=lambda bucket: [("a.mcb", 100), ("b.mcb", 300)])
            self.progress_file = tmp_path / "runs.jsonl"

        def plain(self, wl: object, repeat: int, root: Path) -> object:
            return bench.Run("wl", "plain", repeat, ok=True, wall=10.0)

        def run(self, wl: object, mode: str, repeat: int, root: Path, **kw: object) -> object:
            asked.append((mode, kw.get("bucket")))
            return bench.Run("wl", mode, repeat, ok=True, wall=5.0, compile_seconds=1.0, fx_hit=0, fx_miss=0,
                             aot_hit=0, aot_miss=0, bytes_moved=400)

    wl = bench.Workload("wl", ROOT, [], ROOT / "pyproject.toml", "cpu")
    runs_, _ = bench.bench_workload(FakeRunner(), wl, 1, tmp_path / "work", threads=False, xdist=2,
                                    skip=["hot", "naive", "cold-xdist"])
    assert [r.mode for r in runs_] == ["plain", "cold", "warm", "warm-xdist"]
    assert len(created) == 1  # no bucket of the xdist pair's own
    assert asked == [("cold", created[0]), ("warm", created[0]), ("warm-xdist", created[0])]
    assert runs_[-1].extra["downloads"] == pytest.approx(1.0)
    # With cold-xdist, the pair gets its bucket and the warm run restores from that one.
    asked.clear(), created.clear()
    runs_, _ = bench.bench_workload(FakeRunner(), wl, 1, tmp_path / "work2", threads=False, xdist=2,
                                    skip=["hot", "naive"])
    assert [r.mode for r in runs_] == ["plain", "cold", "warm", "cold-xdist", "warm-xdist"]
    assert len(created) == 2 and asked[-2:] == [("cold-xdist", created[1]), ("warm-xdist", created[1])]


def test_a_children_workload_counts_what_its_child_processes_reported(bench: ModuleType, tmp_path: Path) -> None:
    wl = bench.make_children(tmp_path, "cpu")
    assert wl.children and (wl.cwd / "child_step.py").is_file()
    compile((wl.cwd / "test_children.py").read_text(), "test_children.py", "exec")  # a generator bug fails here
    child = {"label": "rank 0", "compiles": 2, "compile_seconds": 1.5,
             "counters": {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 1, "autograd_cache_hit": 1}}
    doc = {"enabled": True, "problems": [], "upload": {"objects": 1},
           "torch": {"compiled": False, "compiles": 0, "compile_seconds": 0.0, "counters": {}, "children": [child, child]}}
    r = bench.Run("children", "cold", 0)
    bench.fill_from_report(r, doc, from_children=True)
    assert (r.children, r.compiles, r.compile_seconds) == (2, 4, 3.0)
    assert (r.fx_hit, r.fx_miss, r.aot_hit, r.aot_miss) == (4, 2, 2, 0)
    assert bench.failure_reason(0, doc, wl, "cold") is None
    assert "no child process" in bench.failure_reason(0, {**doc, "torch": {**doc["torch"], "children": []}}, wl, "cold")
    # A workload whose pytest process compiles keeps its own counters, and fails when it compiled nothing.
    plain_wl = bench.Workload("wl", ROOT, [], ROOT / "pyproject.toml", "cpu")
    r = bench.Run("wl", "cold", 0)
    bench.fill_from_report(r, doc)
    assert (r.children, r.fx_hit, r.compile_seconds) == (2, 0, 0.0)
    assert "nothing was compiled" in bench.failure_reason(0, doc, plain_wl, "cold")


def test_the_ranks_workload_is_the_example_projects_distributed_test(bench: ModuleType) -> None:
    wl = bench.make_ranks("cuda")
    assert wl.children and wl.args == ["tests/test_distributed.py"] and (wl.cwd / wl.args[0]).is_file()


def test_precompile_records_kept_in_a_work_folder_come_back_marked_and_a_mode_run_again_replaces_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--work DIR``: the modes of one workload spread over invocations (each under a time limit) are tabled
    together, a warm run's cold partner from an earlier invocation makes it valid, and a rerun replaces the earlier
    record of that mode rather than counting twice."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports run.py and varied.py beside it
    pc = load_benchmark("precompile.py")
    cold = pc.Run("suite", "cold-pc", 0, wall=100.0, passed=3, dynamo_seconds=10.0)
    assert pc.kept_runs(tmp_path, [cold]) == []  # nothing earlier; this one is kept
    warm = pc.Run("suite", "warm-pc", 0, wall=20.0, passed=3, dynamo_seconds=2.0)
    earlier = pc.kept_runs(tmp_path, [warm])
    assert [(r.mode, r.wall, r.earlier) for r in earlier] == [("cold-pc", 100.0, True)]
    assert pc.valid([*earlier, warm], warm) and not pc.valid([warm], warm)
    again = pc.kept_runs(tmp_path, [pc.Run("suite", "warm-pc", 0, wall=30.0, passed=3)])
    assert [(r.mode, r.wall) for r in again] == [("cold-pc", 100.0)]  # the first warm-pc record was replaced
    # the frames a warm run left traced are named with the report's reasons, and the first detail of each refusal
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"enabled": True, "torch": {
        "counters": {"dynamo_refused_unsupported_guard": 2},
        "dynamo_refused_frames": {"forward (m.py:3)": "no_backend, unsupported_guard", "step (m.py:9)": "none stored"},
        "dynamo_refusals": {"unsupported_guard": "an identity guard on L['self'].op, which has no stable name"}}}))
    pc.read_report(report, warm)
    pc.table("suite", [*again, warm], 1)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("cold-pc* ") for line in lines) and any(line.startswith("warm-pc  ") for line in lines)
    assert "warm-pc refusals: unsupported_guard 2" in lines
    assert "  traced: forward (m.py:3): no_backend, unsupported_guard" in lines
    assert "  traced: step (m.py:9): none stored" in lines
    assert "  unsupported_guard, first seen: an identity guard on L['self'].op, which has no stable name" in lines


def test_precompile_measures_each_runs_peak_memory_and_each_chains_seconds_saved_against_its_own_cold_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    pc = load_benchmark("precompile.py")
    rc, out, peak = pc.measured([sys.executable, "-c", "b = bytearray(64 << 20); print('done')"], tmp_path, {})
    assert (rc, out.strip()) == (0, "done") and peak is not None and peak >= 64
    monkeypatch.setattr(pc, "TIMEOUT_S", 0.5)
    rc, out, peak = pc.measured([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path, {})
    assert rc == -1 and out.startswith("killed after 0.5 s") and peak is None
    runs = {"cold": pc.Run("w", "cold", 0, compile_seconds=20.0),
            "warm": pc.Run("w", "warm", 0, compile_seconds=4.0, seconds_saved=15.0),
            "cold-pc": pc.Run("w", "cold-pc", 0, compile_seconds=22.0),
            "warm-pc": pc.Run("w", "warm-pc", 0, compile_seconds=1.0, seconds_saved=25.0, phases={"reused": 1.0})}
    pc.print_saved({m: [runs[m]] if m in runs else [] for m in pc.MODES})
    printed = capsys.readouterr().out
    assert "seconds saved, warm: claimed 15.00 s, spared 16.00 s" in printed and "claimed/spared 0.94" in printed
    assert "seconds saved, warm-pc: claimed 25.00 s, spared 20.00 s" in printed and "claimed/spared 1.25" in printed


def test_dynamo_seconds_count_the_unpickling_of_offered_variants_once() -> None:
    """torch's timings nest: the guard states unpickled (``precompile_load_guards``) are timed inside the offers'
    guard building (``precompile_build_guards``), and Dynamo's seconds hold them once."""
    seconds = load_benchmark("bench_dynamo_seconds.py").dynamo_seconds({
        "compile_attempt_0": [5.0, 3.0], "OutputGraph.call_user_compiler": [2.0],
        "precompile_build_guards": [1.5, 0.5], "precompile_load_guards": [1.0], "bytecode_tracing": [4.0]})
    assert seconds["dynamo"] == 8.0 - 2.0 + 2.0
    assert (seconds["reuse_guards"], seconds["reuse_unpickle"]) == (2.0, 1.0)
