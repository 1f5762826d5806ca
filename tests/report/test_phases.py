"""Per-process times (issue 15's breakdown): the process's age from the kernel, torch's own compile split read
from its compilation metrics, the restore waits, the report's rows, and the benchmark's table of them. No torch
here: torch's metrics are stood in for by plain records; the real sessions are checked in test_integration.py
and test_xdist.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pytest_megacache.core import CacheSession
from pytest_megacache.patches import PATCHES
from pytest_megacache.report import SessionReport, markdown, terminal_lines
from pytest_megacache.report.stats import PHASES, LoadStats, ProcessTimes, RestoreStats, TorchStats, UploadStats, process_age
from pytest_megacache.stores import MemoryStore
from pytest_megacache.torch_adapter import TorchAdapter

from ..conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the process's start time comes from /proc")
def test_process_age_counts_from_the_process_start_not_from_the_import() -> None:
    code = ("import time; time.sleep(0.6); from pytest_megacache.report.stats import process_age; "
            "print(process_age())")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    outside = time.monotonic() - started
    age = float(out.stdout)
    # The kernel records a process's start in clock ticks (/proc/self/stat): the age may run one tick past the
    # span measured outside it.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0.6 <= age <= outside + tick, (age, outside, tick)
    assert process_age() is not None


def test_process_age_is_none_where_the_kernel_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(*_a: object, **_k: object) -> None:
        raise FileNotFoundError("/proc/self/stat")

    monkeypatch.setattr("builtins.open", no_proc)
    assert process_age() is None


def test_another_process_times_are_checked_number_by_number() -> None:
    doc = {"startup": 1.5, "collect": "2", "imports": True, "restore_wait": -1, "load": float("nan"),
           "dynamo": 0.25, "backend": 3.0, "tests": 1e9, "total": 9.0, "process": "evil"}
    t = ProcessTimes.from_dict(doc, "gw3")
    assert t.process == "gw3"  # the name comes from the controller, not from what the worker says
    assert (t.startup, t.dynamo, t.backend, t.total) == (1.5, 0.25, 3.0, 9.0)
    assert (t.collect, t.imports, t.restore_wait, t.load, t.tests) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert ProcessTimes.from_dict({"startup": "x"}, "gw0").startup is None


def test_the_report_lists_each_process_in_json_and_in_verbose_lines() -> None:
    main = ProcessTimes(process="controller", startup=0.5, tests=10.0, finish=1.0, total=11.5)
    worker = ProcessTimes(process="gw0", startup=1.0, imports=4.0, backend=2.25, tests=3.0, total=10.25)
    report = SessionReport(enabled=True, reason=None, settings={"store": "dir:x", "mode": "readwrite"},
                           fingerprint={"key": "k"}, scope={"write": "main"}, session_seconds=11.0, notes=[],
                           problems=[], restore=RestoreStats(), load=LoadStats(), torch=TorchStats(),
                           upload=UploadStats(), processes=[main, worker])
    doc = report.to_json()
    assert [p["process"] for p in doc["processes"]] == ["controller", "gw0"]
    assert doc["processes"][1]["backend"] == 2.25
    quiet = terminal_lines(report)
    assert not any("gw0" in line for line in quiet)
    loud = terminal_lines(report, verbose=1)
    assert "  gw0: 10.25 s = startup 1.00, imports 4.00, backend 2.25, tests 3.00" in loud, loud
    assert "  controller: 11.50 s = startup 0.50, tests 10.00, finish 1.00" in loud, loud


def test_the_summary_says_four_lines_by_default_and_everything_under_verbose() -> None:
    """By default: what was restored and from where, the hits and frames reused, the compiling and seconds saved,
    what was uploaded, and one line for the problems; the fingerprint, the load, the layers' details and the notes
    (the signing hint, ...) under -v, and in the step summary."""
    restore = RestoreStats(attempted=True, ok=True, objects_listed=2, objects_used=2, bytes_fetched=2048,
                           entries={"torch/inductor": 3}, files_written=5)
    torch = TorchStats(compiled=True, compiles=3, compile_seconds=1.5, seconds_saved=20.0,
                       counters={"fxgraph_cache_hit": 3, "dynamo_frames_reused": 2, "dynamo_traced": 1},
                       isa_checks={"reused": 6})
    report = SessionReport(enabled=True, reason=None, settings={"store": "s3://bucket/prefix", "mode": "readwrite"},
                           fingerprint={"key": "torch-k"}, scope={"write": "main"}, session_seconds=11.0,
                           notes=["restored bundles are trusted as-is: set MEGACACHE_SIGNING_KEY to sign and verify them"],
                           problems=["upload: cannot write"], restore=restore, load=LoadStats(called=True, ok=True),
                           torch=torch, upload=UploadStats(reason="nothing new"))
    quiet = terminal_lines(report)
    assert quiet[0].startswith("restored 2/2 objects, 2.0 KB") and quiet[0].endswith(", from s3://bucket/prefix (scope main)")
    assert quiet[1].startswith("torch: FX graph 3 hit") and "Dynamo reuse 2 frames reused / 1 traced" in quiet[1]
    assert quiet[2].startswith("3 compiles, 1.50 s compiling; about 20.0 s of cold compiling saved")
    assert quiet[3:] == ["uploaded nothing: nothing new", "1 problem(s); the session ran without that part of the cache"]
    loud = terminal_lines(report, verbose=1)
    for line in ("fingerprint torch-k", "store s3://bucket/prefix (mode readwrite, scope main)",
                 "torch's CPU vector-ISA load checks: 6 taken from an earlier run's record, 0 run", *report.notes):
        assert line in loud and line not in quiet, line
    assert set(quiet[1:]) <= set(loud) and markdown(report).count("\n- ") >= len(loud) - 1
    idle = SessionReport(enabled=True, reason=None, settings={"store": "dir:x", "mode": "readwrite"}, fingerprint={},
                         scope={}, session_seconds=0.1, notes=["a note"], problems=[])
    assert terminal_lines(idle) == ["idle: the session never imported torch, so nothing was restored or uploaded"]


@dataclass
class Metric:
    """What torch records per compiled frame (torch._dynamo.utils.CompilationMetrics), as far as we read it."""

    start_time_us: int
    entire_frame_compile_time_s: float | None = None
    backend_compile_time_s: float | None = None
    duration_us: int | None = None
    is_forward: bool | None = True


def fake_torch_metrics(monkeypatch: pytest.MonkeyPatch, records: list[Metric]) -> None:
    utils = types.ModuleType("torch._dynamo.utils")
    utils.get_compilation_metrics = lambda: list(records)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", utils)


def test_torch_split_counts_each_frame_once_across_reads_and_a_ring_rollover(monkeypatch: pytest.MonkeyPatch) -> None:
    records = [Metric(1, 2.0, 1.5), Metric(2, 1.0, None)]
    fake_torch_metrics(monkeypatch, records)
    adapter = TorchAdapter(lambda: None)
    adapter.absorb_metrics()
    adapter.absorb_metrics()  # nothing new: nothing added
    assert adapter.split == {"dynamo": 1.5, "backend": 1.5, "backward": 0.0}
    records.append(Metric(3, duration_us=250_000, is_forward=False))  # a lazily compiled backward
    adapter.absorb_metrics()
    assert adapter.split["backward"] == 0.25
    # torch keeps the last 64: the one read last has left the ring, later ones are new, older ones are not
    records[:] = [Metric(2, 1.0, 0.0), Metric(4, 0.5, 0.25), Metric(5, 0.5, 0.5)]
    adapter.absorb_metrics()
    assert adapter.split == {"dynamo": 1.75, "backend": 2.25, "backward": 0.25}


def test_torch_split_is_best_effort(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = TorchAdapter(lambda: None)
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils", raising=False)
    adapter.absorb_metrics()  # torch never compiled: nothing to read
    utils = types.ModuleType("torch._dynamo.utils")

    def broken() -> list[Metric]:
        raise RuntimeError("moved")

    utils.get_compilation_metrics = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", utils)
    adapter.absorb_metrics()
    assert adapter.split == {"dynamo": 0.0, "backend": 0.0, "backward": 0.0}


def test_restore_waits_add_up_and_a_settled_restore_costs_nothing(tmp_path: Path) -> None:
    gate = threading.Event()

    class SlowStore(MemoryStore):
        def list(self, prefix: str) -> list:  # type: ignore[override, type-arg]
            gate.wait(5)
            return super().list(prefix)

    s = CacheSession(store_factory=SlowStore, folder="f", fingerprint="fp", roots=[], reads=True, writes=False)
    s.start_restore()
    threading.Timer(0.3, gate.set).start()
    assert s.wait_restore()
    first = s.wait_seconds
    assert 0.25 <= first < 5, first
    assert s.wait_restore()
    assert s.wait_seconds == first


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("run.py")


def test_the_benchmark_reads_the_plugins_phases(bench: ModuleType) -> None:
    assert bench.PHASES is PHASES  # the plugin's own tuple, not a copy that could drift
    assert set(bench.PHASE_COLORS) == {*PHASES, "exit"}


def test_the_benchmark_tables_medians_per_mode_and_process_and_the_exit(bench: ModuleType) -> None:
    def run(mode: str, rep: int, wall: float, main_total: float, workers: dict[str, float]) -> object:
        r = bench.Run("wl", mode, rep, ok=True, wall=wall)
        bench.fill_from_report(r, {"processes": [
            {"process": "main" if mode == "warm" else "controller", "startup": 0.5, "tests": main_total - 0.5,
             "total": main_total},
            *({"process": name, "startup": 1.0, "backend": b, "total": 1.0 + b} for name, b in workers.items())]})
        return r

    runs = [run("warm", 0, 10.0, 8.0, {}), run("warm", 1, 12.0, 9.0, {}), run("warm", 2, 11.0, 8.5, {}),
            run("warm-xdist", 0, 20.0, 19.0, {"gw0": 4.0, "gw1": 6.0})]
    assert [r.exit_seconds for r in runs] == [2.0, 3.0, 2.5, 1.0]
    rows = {(m, p): med for m, p, med in bench.phase_rows(runs)}
    assert set(rows) == {("warm", "main"), ("warm-xdist", "controller"), ("warm-xdist", "gw0"),
                         ("warm-xdist", "gw1")}
    assert rows[("warm", "main")]["tests"] == 8.0 and rows[("warm", "main")]["exit"] == 2.5
    assert rows[("warm-xdist", "gw1")]["backend"] == 6.0 and "exit" not in rows[("warm-xdist", "gw1")]
    text = "\n".join(bench.phase_lines(bench.Workload("wl", ROOT, [], ROOT, "cpu"), runs, bench.phase_rows(runs)))
    assert "| warm | main | 0.50 | 0.00 |" in text and "| 11.00 | 11.00 |" in text  # sum of phases, then the wall


def test_a_torch_config_flag_is_switched_on_or_the_reason_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-ins (--megacache-precompile, --megacache-eager-backward) set one torch config flag each, and say why
    not where the module or the flag is missing (an older torch), instead of raising."""
    config = types.ModuleType("fake_torch_config")
    config.present = False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_torch_config", config)
    assert TorchAdapter._switch_on("fake_torch_config", "present", "a test") is None
    assert config.present is True  # type: ignore[attr-defined]
    assert PATCHES.remove(config, "present") and config.present is False  # type: ignore[attr-defined]
    assert TorchAdapter._switch_on("fake_torch_config", "absent", "a test") == "this torch has no absent"
    why = TorchAdapter._switch_on("no_such_torch_config_module", "present", "a test")
    assert why is not None and why.startswith("no_such_torch_config_module did not import")


class _Config:
    """pytest's config as the summary reads it: the verbosity, and the project's ini addopts."""

    def __init__(self, verbosity: int, addopts: list[str] | Exception) -> None:
        self.verbosity, self.addopts = verbosity, addopts

    def get_verbosity(self) -> int:
        return self.verbosity

    def getini(self, name: str) -> list[str]:
        assert name == "addopts"
        if isinstance(self.addopts, Exception):
            raise self.addopts
        return self.addopts


@pytest.mark.parametrize(("verbosity", "addopts", "asked"), [
    (2, ["--capture=no", "-vv", "-m", "not slow"], 0),  # a project that lists its tests verbosely: the short summary
    (3, ["-vv"], 1),  # -v on the command line on top: everything
    (1, [], 1),
    (0, ["-v", "-q"], 0),
    (-1, ["--quiet"], 0),
    (2, ["--verbose", "-rav"], 1),  # -r's value is not a verbosity
    (1, ValueError("no such ini"), 1),
])
def test_the_verbosity_a_projects_addopts_set_does_not_unfold_the_summary(verbosity: int, addopts: Any,
                                                                          asked: int) -> None:
    from pytest_megacache.report import asked_verbosity

    assert asked_verbosity(_Config(verbosity, addopts)) == asked
