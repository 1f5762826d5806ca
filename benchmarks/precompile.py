"""The plugin with and without Dynamo reuse (torch's caching precompile behind the plugin's checks; on by default where
checked), side by side in one run: on CPU, or with ``--device cuda`` on the example project's GPU tests.
Every figure is measured here; nothing is a constant.

Modes, each a fresh ``pytest`` process on fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / TMPDIR (a fresh
machine), interleaved repeat by repeat so that a slow spell of the machine hits every mode alike:

- plain:            no plugin (``-p no:megacache``): the baseline, and the proof that the tests pass at all.
- cold / warm:      the plugin without Dynamo reuse (``--megacache-no-precompile``); cold fills a local directory store
                    (``--megacache-dir``), warm restores it.
- cold-pc / warm-pc: the plugin's defaults (Dynamo reuse on where checked, for torch's own backends), into and from a
                    store of their own; ``--precompile-asked`` passes ``--megacache-precompile`` (any backend).
- eager:            no plugin and ``TORCHDYNAMO_DISABLE=1``: the suite without compiling, the floor no cache beats.

Dynamo's seconds in each run come from torch's own compile timings (``bench_dynamo_seconds.py``, loaded as a
pytest plugin in every run): compile attempts less the backend call, plus the guards of installed reused entries.

Recorded per run: passed / failed / errors (and each failing test with its error line, from a JUnit XML file),
session wall, and from the plugin's JSON report (``--megacache-report``): ``torch.compile_seconds``,
``torch.counters`` (FX graph, AOTAutograd and Dynamo-cache hits and misses), ``upload.new_entries`` (whether
``torch/precompile`` artifacts were stored) and what the restore loaded. A failure is a finding, not a crash of
this script: it is recorded and the table says so.

    python benchmarks/precompile.py [--repeats 3] [--workload small|dynamo|varied|short|example|all]
                                    [--device cpu|cuda]
                                    [--tests N] [--json PATH]

Workloads: ``small``, a generated CPU suite (pointwise, an MLP forward, an MLP training step checked against
eager, a dynamic-shape function, two functions compiled in one test, a graph break); ``example``, the example
project's CPU tests (``example_project``, ``tests -m "not gpu"``, run from inside it as benchmarks/run.py does), or
with ``--device cuda`` its GPU tests but the max-autotune one (``tests -m gpu -k "not autotune"``); ``dynamo``, a
generated suite shaped like suites where Dynamo is most of a warm run: many tests (``--tests``, 30 by default),
each compiling two small functions full of Python-level work (dicts, loops, inlined helpers) after
``torch._dynamo.reset()``; ``varied``, run.py's suite of small functions of 13 kinds (``benchmarks/varied.py``,
``--tests`` of them; with ``--device cuda`` on the GPU: many short compiled tests); ``short``, short tests that each
compile one small function afresh after ``torch._dynamo.reset()``, each function at four sizes (``--tests`` in all,
``benchmarks/varied.py``: a stored entry holds several variants, and each test installs it again, as an image library's
compile tests do; ``--device cuda`` runs them on the GPU); ``suite``, any project's tests:
``--suite DIR --suite-args "tests/compile"`` (run in DIR, with the interpreter running this script, so the project and
the plugin must be importable there).

Each run's outcomes are compared test by test with the plain run's, and the table says how many differ.

``--work DIR`` keeps the runs' folders and stores in DIR (else a temporary folder, removed at the end) and each run's
record in ``DIR/runs.json``: a later invocation with the same DIR and workload restores what an earlier one's cold
mode stored and prints the earlier runs beside its own (marked), so that the modes of one workload can be spread
over calls that each have a time limit, on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from run import clean_env as shared_clean_env  # demo/local_s3.py's, as run.py uses it
from run import plugin_args  # benchmarks/run.py, beside this script (its folder is on sys.path)
from varied import SHORT_SIZES, make_short_project, make_varied_project  # benchmarks/varied.py, beside it

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "example_project"
TIMEOUT_S = 900

SMALL_WORKLOAD = textwrap.dedent(
    """
    import copy

    import torch


    def pointwise(x):
        return torch.sin(x) * 2 + torch.cos(x)


    def scale_shift(x):
        return torch.tanh(x) * 0.5 + 1


    def double_relu(x):
        return torch.relu(x) * torch.sigmoid(x) - 0.25


    def gelu_rows(x):
        return torch.nn.functional.gelu(x).sum(dim=-1)


    def with_graph_break(x):
        y = torch.sin(x) + 1
        torch._dynamo.graph_break()
        return torch.cos(y) * 3


    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))


    def test_pointwise():
        x = torch.randn(64)
        torch.testing.assert_close(torch.compile(pointwise)(x), pointwise(x))


    def test_mlp_forward():
        model = MLP()
        x = torch.randn(8, 16)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model)(x), model(x))


    def test_mlp_train_step():
        model = MLP()
        ref = copy.deepcopy(model)
        compiled = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            x = torch.randn(8, 16)
            for m, o in ((compiled, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)


    def test_dynamic_shapes():
        f = torch.compile(gelu_rows)
        for n in (8, 16, 24):  # the second size recompiles with a dynamic dimension, the third reuses it
            x = torch.randn(n, 32)
            torch.testing.assert_close(f(x), gelu_rows(x))


    def test_two_functions():
        x = torch.randn(32)
        torch.testing.assert_close(torch.compile(scale_shift)(x), scale_shift(x))
        torch.testing.assert_close(torch.compile(double_relu)(x), double_relu(x))


    def test_graph_break():
        x = torch.randn(32)
        torch.testing.assert_close(torch.compile(with_graph_break)(x), with_graph_break(x))
    """
)

# The example project's own conftest resets Dynamo before each test; the small suite does the same.
SMALL_CONFTEST = textwrap.dedent(
    """
    import pytest
    import torch


    @pytest.fixture(autouse=True)
    def fresh_compile_state():
        torch._dynamo.reset()
        torch.manual_seed(0)
    """
)

DYNAMO_HELPERS = textwrap.dedent(
    """
    import torch


    def scaled(d, k):
        return {key: value * k + 1 for key, value in d.items()}


    def rotate(d):
        keys, values = list(d), list(d.values())
        return {keys[n]: torch.sin(values[n - 1]) + values[n] for n in range(len(values))}
    """
)

# Each function is its own code (its own dict keys), so Dynamo traces each; the tensor work is one of two graphs
# (by j), so Inductor builds two kernels in all and a cold run is not mostly C++ builds.
DYNAMO_TEST = textwrap.dedent(
    """
    def fn_{i}_{j}(x):
        d = {{"a{i}": x, "b{i}": x + 1, "c{i}_{j}": x * 2}}
        for k in range({j} + 2):
            d = helpers.rotate(helpers.scaled(d, 0.5))
            if k % 2:
                d["b{i}"] = d["b{i}"] - 1
        return sum(d.values())
    """
)


def dynamo_workload(tests: int) -> str:
    """``tests`` tests, each compiling two distinct small functions heavy in Python-level work."""
    parts = ["import torch", "", "import helpers", ""]
    for i in range(tests):
        for j in (1, 2):
            parts.append(DYNAMO_TEST.format(i=i, j=j))
        parts.append(textwrap.dedent(f"""
            def test_{i}():
                x = torch.linspace(-1, 1, 16)
                for fn in (fn_{i}_1, fn_{i}_2):
                    torch.testing.assert_close(torch.compile(fn)(x), fn(x), rtol=1e-4, atol=1e-4)
            """))
    return "\n".join(parts)


LOAD, UNLOAD, _INSTALLED = plugin_args()
MISS_NAMES = ("fxgraph_cache_miss", "autograd_cache_miss", "dynamo_cache_miss")
MODES = ("plain", "eager", "cold", "warm", "cold-pc", "warm-pc", "warm2-pc")
BENCH_DIR = Path(__file__).resolve().parent


@dataclass
class Workload:
    name: str
    cwd: Path
    args: list[str]


@dataclass
class Run:
    """One pytest process and what it measured."""

    workload: str
    mode: str
    repeat: int
    returncode: int = 0
    wall: float = 0.0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)  # "nodeid: error line"
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> passed / failed / error / skipped
    compile_seconds: float | None = None
    counters: dict[str, int] = field(default_factory=dict)
    new_entries: dict[str, int] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)  # what load_cache_artifacts put in place, per type
    compiles: int | None = None  # frames Dynamo compiled (the plugin's count)
    dynamo_seconds: float | None = None  # bench_dynamo_seconds.py: Dynamo's share of the compile seconds
    seconds_saved: float | None = None  # what the report claims the restored artifacts (and reused frames) spared
    phases: dict[str, float] = field(default_factory=dict)  # the main process's phases (the report's "processes")
    peak_mb: float | None = None  # the pytest process's peak resident memory
    missed: dict[str, dict[str, int]] = field(default_factory=dict)  # test -> its miss counters, tests with any miss
    traced_frames: dict[str, str] = field(default_factory=dict)  # a frame reuse left traced -> why (the report's)
    refusals: dict[str, str] = field(default_factory=dict)  # refusal reason -> the first detail the report gives
    problems: list[str] = field(default_factory=list)
    tail: str = ""
    earlier: bool = False  # read back from an earlier invocation's --work records

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.failed == 0 and self.errors == 0

    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)


def clean_env() -> dict[str, str]:
    """The calling shell's environment minus settings that would change what is measured: the demo's and
    run.py's list, plus torch's logging and precompile switches."""
    env = {k: v for k, v in shared_clean_env().items() if k not in ("TORCH_LOGS", "TORCH_CACHING_PRECOMPILE")}
    env["PYTHONUNBUFFERED"] = "1"
    if not _INSTALLED:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def read_junit(path: Path, run: Run) -> None:
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        return
    for case in tree.iter("testcase"):
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        kind = "failed"
        if bad is None:
            bad, kind = case.find("error"), "error"
        if bad is not None:
            if kind == "failed":
                run.failed += 1
            else:
                run.errors += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            run.failures.append(f"{nodeid} ({kind}): {message[0][:300] if message else '?'}")
            run.outcomes[nodeid] = kind
        elif case.find("skipped") is not None:
            run.skipped += 1
            run.outcomes[nodeid] = "skipped"
        else:
            run.passed += 1
            run.outcomes[nodeid] = "passed"


def read_report(path: Path, run: Run) -> None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        run.problems.append("no megacache report was written")
        return
    torch_part = doc.get("torch") or {}
    run.compile_seconds = torch_part.get("compile_seconds")
    run.seconds_saved = torch_part.get("seconds_saved")
    main = [p for p in doc.get("processes") or [] if isinstance(p, dict) and p.get("process") == "main"]
    run.phases = {str(k): float(v) for k, v in (main[0] if main else {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
    run.counters = {str(k): int(v) for k, v in (torch_part.get("counters") or {}).items()}
    run.compiles = torch_part.get("compiles")
    for nodeid, rec in (torch_part.get("per_test") or {}).items():
        misses = {k: int(v) for k, v in (rec.get("counters") or {}).items() if k in MISS_NAMES and v}
        if misses:
            run.missed[str(nodeid)] = misses
    run.traced_frames = {str(k): str(v) for k, v in (torch_part.get("dynamo_refused_frames") or {}).items()}
    run.refusals = {str(k): str(v) for k, v in (torch_part.get("dynamo_refusals") or {}).items()}
    run.new_entries = dict((doc.get("upload") or {}).get("new_entries") or {})
    run.loaded = dict((doc.get("load") or {}).get("artifacts") or {})
    run.problems.extend(str(p) for p in doc.get("problems") or [])
    if not doc.get("enabled"):
        run.problems.append(f"plugin not active: {doc.get('reason')}")


PRECOMPILE_ASKED = [False]  # --precompile-asked


def measured(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, float | None]:
    """Runs ``cmd``: its exit status (-1 where it was killed after ``TIMEOUT_S``), its output, and the process's peak
    resident memory in MB (its own, not its children's: Inductor's compile workers are not counted)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    timer = threading.Timer(TIMEOUT_S, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        out = proc.stdout.read().decode(errors="replace")
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    finally:
        killed = not timer.is_alive()
        timer.cancel()
    if killed:
        return -1, f"killed after {TIMEOUT_S} s\n{out}", None
    return proc.returncode, out, usage.ru_maxrss / 1024  # kB on Linux


def pytest_run(wl: Workload, mode: str, repeat: int, work: Path, store: Path | None, logs: Path) -> Run:
    root = work / f"{wl.name}-{mode}-r{repeat}"
    shutil.rmtree(root, ignore_errors=True)  # a mode run again in a kept --work folder starts as fresh as the first
    for sub in ("inductor", "triton", "tmp"):
        (root / sub).mkdir(parents=True)
    env = {**clean_env(), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
           "TMPDIR": str(root / "tmp"), "MEGACACHE_BENCH_DYNAMO_OUT": str(root / "dynamo.json")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH", "")) if p)
    if mode == "eager":
        env["TORCHDYNAMO_DISABLE"] = "1"
    report, junit = root / "report.json", root / "junit.xml"
    if store is None:
        plugin = list(UNLOAD)
    else:
        plugin = [*LOAD, f"--megacache-dir={store}", f"--megacache-report={report}"]
        if not mode.endswith("-pc"):
            plugin.append("--megacache-no-precompile")
        elif PRECOMPILE_ASKED[0]:
            plugin.append("--megacache-precompile")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench_dynamo_seconds", "-W", "ignore",
           f"--junitxml={junit}", *wl.args, *plugin]
    start = time.perf_counter()
    rc, out, peak = measured(cmd, wl.cwd, env)
    run = Run(wl.name, mode, repeat, returncode=rc, wall=time.perf_counter() - start, tail=out[-3000:], peak_mb=peak)
    read_junit(junit, run)
    if store is not None:
        read_report(report, run)
    try:
        run.dynamo_seconds = float(json.loads((root / "dynamo.json").read_text())["dynamo"])
    except (OSError, ValueError, KeyError, TypeError):
        run.dynamo_seconds = None
    line = (f"  {mode:8} wall {run.wall:6.1f} s  passed {run.passed} failed {run.failed} errors {run.errors}"
            + (f"  compile {run.compile_seconds:.2f} s ({run.compiles} frames)" if run.compile_seconds is not None else "")
            + (f"  dynamo {run.dynamo_seconds:.2f} s" if run.dynamo_seconds is not None else "")
            + (f"  FX {run.counter('fxgraph_cache_hit')}/{run.counter('fxgraph_cache_miss')}"
               f"  AOT {run.counter('autograd_cache_hit')}/{run.counter('autograd_cache_miss')}"
               f"  reuse {run.counter('dynamo_frames_reused')} frames reused/{run.counter('dynamo_traced')} traced/"
               f"{sum(v for k, v in run.counters.items() if k.startswith('dynamo_refused_'))} refused"
               f"  new {run.new_entries}  loaded {run.loaded}" if store is not None else ""))
    print(line, flush=True)
    for failure in run.failures:
        print(f"    FAILED {failure}", flush=True)
    if mode.startswith("warm"):
        for nodeid, misses in run.missed.items():
            print(f"    missed in {nodeid}: {misses}", flush=True)
    for problem in run.problems:
        print(f"    problem: {problem[:300]}", flush=True)
    if rc != 0:
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{wl.name}-{mode}-r{repeat + 1}.log"
        log.write_text("$ " + " ".join(cmd) + "\n" + out)
        print(f"    pytest exited {rc}; full output kept at {log}", flush=True)
        if not run.failures:
            print(textwrap.indent(out[-1500:], "    | "), flush=True)
    return run


def make_workload(name: str, base: Path, device: str = "cpu", tests: int = 30) -> Workload:
    if name == "varied":
        project, args, _ini = make_varied_project(base, tests, device)
        return Workload("varied", project, args)
    if name == "short":
        project, args = make_short_project(base, max(1, tests // len(SHORT_SIZES)), device)
        return Workload("short", project, args)
    if name == "dynamo":
        project = base / "dynamo"
        project.mkdir(exist_ok=True)
        (project / "test_dynamo.py").write_text(dynamo_workload(tests))
        (project / "helpers.py").write_text(DYNAMO_HELPERS)
        (project / "conftest.py").write_text(SMALL_CONFTEST)
        (project / "pytest.ini").write_text("[pytest]\n")
        return Workload("dynamo", project, ["test_dynamo.py"])
    if name == "example":
        select = ["-m", "gpu", "-k", "not autotune"] if device == "cuda" else ["-m", "not gpu"]
        return Workload("example", EXAMPLE, ["tests", *select])
    project = base / "small"
    project.mkdir(exist_ok=True)
    (project / "test_small.py").write_text(SMALL_WORKLOAD)
    (project / "conftest.py").write_text(SMALL_CONFTEST)
    (project / "pytest.ini").write_text("[pytest]\n")  # rootdir here, not wherever tmp lives
    return Workload("small", project, ["test_small.py"])


def bench(wl: Workload, repeats: int, work: Path, logs: Path, modes: tuple[str, ...] = MODES) -> list[Run]:
    runs: list[Run] = []
    for i in range(repeats):
        print(f"[{wl.name}] repeat {i + 1}/{repeats}", flush=True)
        stores = {"": work / f"store-{wl.name}-default-r{i}", "-pc": work / f"store-{wl.name}-precompile-r{i}"}
        for mode in modes:
            # warm2-pc: a second warm run from the store that cold-pc filled and warm-pc added to
            store = None if mode in ("plain", "eager") else stores["-pc" if mode.endswith("-pc") else ""]
            runs.append(pytest_run(wl, mode, i, work, store, logs))
    return runs


def median(runs: list[Run], key: Callable[[Run], float | None]) -> float | None:
    values = [v for v in (key(r) for r in runs) if v is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def hit_miss(runs: list[Run], hit: str, miss: str) -> str:
    h, m = median(runs, lambda r: r.counter(hit)), median(runs, lambda r: r.counter(miss))
    return f"{fmt(h, 'g')}/{fmt(m, 'g')}"


def valid(runs: list[Run], r: Run) -> bool:
    """A run the medians use: it passed, and a warm run's cold partner (same repeat, same store) passed too
    (else the warm run restored nothing and measured a cold run)."""
    if not r.ok:
        return False
    if not r.mode.startswith("warm"):
        return True
    cold = r.mode.replace("warm2", "cold").replace("warm", "cold")
    return any(c.ok for c in runs if c.workload == r.workload and c.repeat == r.repeat and c.mode == cold)


def kept_runs(base: Path, runs: list[Run]) -> list[Run]:
    """The records of earlier invocations kept in ``base/runs.json`` (a workload's mode and repeat run again here
    replaces its earlier record), and this invocation's added to them. Earlier ones come back marked."""
    path = base / "runs.json"
    try:
        kept = [Run(**{**rec, "earlier": True}) for rec in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        kept = []
    mine = {(r.workload, r.mode, r.repeat) for r in runs}
    earlier = [r for r in kept if (r.workload, r.mode, r.repeat) not in mine]
    path.write_text(json.dumps([{k: v for k, v in asdict(r).items() if k != "earlier"} for r in [*earlier, *runs]],
                               indent=1))
    return earlier


PHASE_COLUMNS = ("startup", "collect", "restore_wait", "load", "dynamo", "backend", "reused", "tests", "finish")


def compile_and_reuse(r: Run) -> float | None:
    """What a run spent compiling (torch's compile callbacks) and on Dynamo reuse of its own (the reused phase)."""
    return None if r.compile_seconds is None else r.compile_seconds + r.phases.get("reused", 0.0)


def print_saved(by_mode: dict[str, list[Run]]) -> None:
    """The main process's phases per mode, and what each warm run claims to save beside what it measurably did: its
    seconds saved against its cold run's compile seconds less its own compile and reuse seconds (each chain against
    its own cold run: two cold runs differ by more than reuse does)."""
    print("phases (main process, medians, s): " + " ".join(f"{p:>8}" for p in PHASE_COLUMNS))
    for mode, rs in by_mode.items():
        if rs and mode not in ("plain", "eager"):
            print(f"  {mode:31} " + " ".join(f"{fmt(median(rs, lambda r, p=p: r.phases.get(p))):>8}"
                                               for p in PHASE_COLUMNS))
    for warm, cold in (("warm", "cold"), ("warm-pc", "cold-pc"), ("warm2-pc", "cold-pc")):
        claimed, spent = median(by_mode[warm], lambda r: r.seconds_saved), median(by_mode[warm], compile_and_reuse)
        cold_seconds = median(by_mode[cold], lambda r: r.compile_seconds)
        if claimed is None or spent is None or cold_seconds is None:
            continue
        spared = cold_seconds - spent
        print(f"seconds saved, {warm}: claimed {claimed:.2f} s, spared {spared:.2f} s ({cold}'s compile seconds less "
              f"{warm}'s compile and reuse seconds)" + (f": claimed/spared {claimed / spared:.2f}" if spared > 0 else ""))


def print_traced(r: Run) -> None:
    """Each frame the run ``r`` left traced, with its reasons, and the first detail of each refusal."""
    for frame, why in sorted(r.traced_frames.items()):
        print(f"  traced: {frame}: {why}")
    for reason, detail in sorted(r.refusals.items()):
        print(f"  {reason}, first seen: {detail}")


def table(wl: str, runs: list[Run], repeats: int) -> None:
    mine = [r for r in runs if r.workload == wl]
    by_mode = {mode: [r for r in mine if r.mode == mode and valid(mine, r)] for mode in MODES}
    print()
    print(f"workload {wl}: torch {importlib.metadata.version('torch')}, {os.cpu_count()} CPUs, {repeats} repeats; "
          "medians of the valid runs (n: how many; a failed run, or a warm run whose cold run failed, is left out)")
    head = (f"{'mode':8} {'n':>2} {'pass/fail/err':>13} {'wall s':>7} {'compile s':>9} {'Dynamo s':>8} {'Dynamo %':>8} "
            f"{'FX hit/miss':>11} {'AOT hit/miss':>12} {'frames reused/traced':>17} {'precompile stored':>17}")
    print(head)
    print("-" * len(head))
    for mode, rs in by_mode.items():
        if not rs:
            print(f"{mode:8}  0 (no valid run)")
            continue
        counts = f"{fmt(median(rs, lambda r: r.passed), 'g')}/{fmt(median(rs, lambda r: r.failed), 'g')}/" \
                 f"{fmt(median(rs, lambda r: r.errors), 'g')}"
        plugin = mode not in ("plain", "eager")
        stored = median(rs, lambda r: r.new_entries.get("torch/precompile", 0)) if plugin else None
        share = median(rs, lambda r: 100 * r.dynamo_seconds / r.wall if r.dynamo_seconds is not None and r.wall else None)
        label = mode + ("*" if any(r.earlier for r in rs) else "")
        print(f"{label:8} {len(rs):>2} {counts:>13} {fmt(median(rs, lambda r: r.wall), '.1f'):>7} "
              f"{fmt(median(rs, lambda r: r.compile_seconds)):>9} {fmt(median(rs, lambda r: r.dynamo_seconds)):>8} "
              f"{fmt(share, '.0f'):>8} "
              f"{hit_miss(rs, 'fxgraph_cache_hit', 'fxgraph_cache_miss') if plugin else '':>11} "
              f"{hit_miss(rs, 'autograd_cache_hit', 'autograd_cache_miss') if plugin else '':>12} "
              f"{hit_miss(rs, 'dynamo_frames_reused', 'dynamo_traced') if plugin else '':>17} "
              f"{fmt(stored, 'g') if plugin else '':>17}")

    def ratio(a: str, b: str, key: Callable[[Run], float | None]) -> str:
        x, y = median(by_mode[a], key), median(by_mode[b], key)
        return "n/a" if x is None or not y else f"{x / y:.2f}"

    def peak(r: Run) -> float | None:
        return r.peak_mb

    def frames(r: Run) -> float | None:
        """Frames Dynamo traced: every compile of a run without reuse; those it traced with reuse."""
        return float(r.counter("dynamo_traced")) if r.mode.endswith("-pc") else r.compiles

    print(f"frames traced: warm-pc/warm {ratio('warm-pc', 'warm', frames)}, warm2-pc/warm {ratio('warm2-pc', 'warm', frames)}")
    for mode in ("warm-pc", "warm2-pc"):
        refused: dict[str, float] = {}
        for name in sorted({k for r in by_mode[mode] for k in r.counters if k.startswith("dynamo_refused_")}):
            n = median(by_mode[mode], lambda r, name=name: r.counter(name))
            if n:
                refused[name.removeprefix("dynamo_refused_")] = n
        print(f"{mode} refusals: {', '.join(f'{k} {v:g}' for k, v in refused.items()) or 'none'}")
        if by_mode[mode]:
            print_traced(by_mode[mode][-1])  # the last run of the mode
    print(f"warm-pc/warm: compile seconds {ratio('warm-pc', 'warm', lambda r: r.compile_seconds)}, "
          f"Dynamo seconds {ratio('warm-pc', 'warm', lambda r: r.dynamo_seconds)}, "
          f"session wall {ratio('warm-pc', 'warm', lambda r: r.wall)}")
    print_saved(by_mode)
    print(f"cold-pc/cold: compile seconds {ratio('cold-pc', 'cold', lambda r: r.compile_seconds)}, "
          f"session wall {ratio('cold-pc', 'cold', lambda r: r.wall)}, peak memory {ratio('cold-pc', 'cold', peak)}")
    print(f"warm-pc/warm peak memory {ratio('warm-pc', 'warm', peak)}; peak MB, cold / cold-pc / warm / warm-pc: "
          + " / ".join(fmt(median(by_mode[m], peak), '.0f') for m in ('cold', 'cold-pc', 'warm', 'warm-pc')))
    print(f"warm/plain wall {ratio('warm', 'plain', lambda r: r.wall)}, warm-pc/plain wall "
          f"{ratio('warm-pc', 'plain', lambda r: r.wall)}")
    print(f"against eager (TORCHDYNAMO_DISABLE=1): warm/eager wall {ratio('warm', 'eager', lambda r: r.wall)}, "
          f"warm-pc/eager wall {ratio('warm-pc', 'eager', lambda r: r.wall)}")
    # the plain run is the reference; where it was not run, the cold run with the plugin's defaults
    reference = [r for r in mine if r.mode == "plain"] or [r for r in mine if r.mode == "cold"]
    for r in mine:
        if r.mode in ("plain", "eager") or not reference or r is reference[0]:
            continue
        changed = sorted(t for t, o in r.outcomes.items() if reference[0].outcomes.get(t, o) != o)
        changed += sorted(t for t in reference[0].outcomes if t not in r.outcomes)
        print(f"{r.mode} (repeat {r.repeat + 1}): {len(changed)} outcomes differ from {reference[0].mode}'s"
              + (f": {', '.join(changed[:5])}" if changed else ""))
    seen: set[str] = set()
    for r in mine:
        if r.ok and not valid(mine, r):
            print(f"{r.mode} (repeat {r.repeat + 1}): left out, its cold run failed (it restored nothing)")
        for failure in r.failures:
            text = f"{r.mode}: {failure}"
            if text not in seen:
                seen.add(text)
                print(f"FAILED in {text} (repeat {r.repeat + 1})")
        if r.returncode != 0 and not r.failures:
            print(f"{r.mode} (repeat {r.repeat + 1}): pytest exited {r.returncode} without a failing test recorded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workload", choices=("small", "dynamo", "varied", "short", "example", "suite", "all"), default="small")
    parser.add_argument("--suite", type=Path, help="suite workload: the folder to run pytest in (a project's tests)")
    parser.add_argument("--suite-args", default="", help="suite workload: pytest's arguments there (split on spaces)")
    parser.add_argument("--tests", type=int, default=30,
                        help="tests of the dynamo, varied and short workloads (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the example project's GPU tests, or the varied workload's functions on the GPU "
                             "(many short compiled tests; the small and dynamo workloads are CPU only)")
    parser.add_argument("--json", type=Path, help="write every run's record here")
    parser.add_argument("--modes", default="", help="run only these modes (comma-separated; a warm mode needs its "
                                                    "cold one), e.g. cold,warm,cold-pc,warm-pc")
    parser.add_argument("--work", type=Path, help="keep runs, stores and records here: a later invocation with the same "
                                                  "folder runs warm modes from an earlier one's cold stores")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "megacache-precompile-logs",
                        help="where the full output of failed pytest runs is kept (default: %(default)s)")
    parser.add_argument("--precompile-asked", action="store_true",
                        help="the -pc modes pass --megacache-precompile (reuse for any backend), not the default")
    opts = parser.parse_args()
    PRECOMPILE_ASKED[0] = opts.precompile_asked
    names = ["small", "dynamo", "example"] if opts.workload == "all" else [opts.workload]
    modes = tuple(m for m in MODES if m in opts.modes.split(",")) if opts.modes else MODES
    if opts.modes and len(modes) != len(opts.modes.split(",")):
        parser.error(f"--modes: a comma-separated selection of {', '.join(MODES)}")
    if opts.workload == "suite" and opts.suite is None:
        parser.error("--workload suite needs --suite DIR")
    if opts.device == "cuda" and names not in (["example"], ["suite"], ["varied"], ["short"]):
        parser.error("--device cuda runs the example, varied or short workload only: pass --workload example, varied "
                     "or short")
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        if opts.work is not None:
            base = opts.work.resolve()
            base.mkdir(parents=True, exist_ok=True)
        else:
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="megacache-precompile-")))
        for name in names:
            wl = (Workload("suite", opts.suite.resolve(), opts.suite_args.split()) if name == "suite"
                  else make_workload(name, base, opts.device, opts.tests))
            runs += bench(wl, opts.repeats, base / f"work-{name}", opts.logs, modes)
        earlier = kept_runs(base, runs) if opts.work is not None else []
    for name in names:
        table(name, [*earlier, *runs], opts.repeats)
        if any(r.workload == name for r in earlier):
            print(f"  modes marked * ran in an earlier invocation with --work {opts.work}: "
                  + ", ".join(sorted({r.mode for r in earlier if r.workload == name})))
    if opts.json:
        records: list[dict[str, Any]] = [{**asdict(r), "ok": r.ok} for r in runs]
        opts.json.write_text(json.dumps(records, indent=1))
    if any(not r.ok for r in runs):
        print("\nsome runs failed: see FAILED above (a finding, recorded; the table still stands)")
        sys.exit(1)


if __name__ == "__main__":
    main()
