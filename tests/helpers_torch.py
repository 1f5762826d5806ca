"""Tiny torch projects run as pytest subprocesses, each run on fresh compile caches.

A project lives in a test's ``pytester`` directory, or in a directory of its own that a module- or
session-scoped fixture creates: then one cold/warm sequence of sessions is run once and many tests assert on
what it left (its runs' output, reports, torch's counters, snapshots of the store in between).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import HERMETIC_PREFIXES


def holds_function(entry: bytes, name: bytes) -> bool:
    """Whether a stored Dynamo entry is one of the function ``name``: its pickled name (a short string, as pickle
    writes one) is in the entry's bytes."""
    return b"\x8c" + bytes([len(name)]) + name + b"\x94" in entry


def skip_without_torch() -> None:
    """Skip the calling module where torch is not installed, without importing it (that takes seconds and
    changes the whole test process: torch runs only in the projects' subprocesses)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed", allow_module_level=True)


TORCH_TESTS = textwrap.dedent(
    """
    import torch

    def f(x):
        return torch.sin(x) * 2 + 1

    def g(x):
        return torch.relu(x - 0.5).cumsum(0)

    def test_f():
        assert torch.allclose(torch.compile(f)(torch.zeros(8)), torch.ones(8))

    def test_g():
        out = torch.compile(g)(torch.ones(8))
        assert torch.allclose(out, torch.arange(1, 9) * 0.5)

    def test_plain():
        assert torch.ones(2).sum() == 2
    """
)

# Reads torch's own counters at the end of the session, independently of the plugin.
COUNTERS_CONFTEST = textwrap.dedent(
    """
    import json, os, sys
    import pytest

    _graphs = {}  # test id: the graphs counted while it ran (torch's own count, not the plugin's)
    _traces = {}  # test id: the frames Dynamo traced while it ran (torch's timings of a trace's first attempt)
    _seconds = {}  # test id: what torch's own records say its frames' compiles took while it ran

    def _unique_graphs():
        utils = sys.modules.get("torch._dynamo.utils")
        return utils.counters["stats"].get("unique_graphs", 0) if utils is not None else 0

    def _traced():
        utils = sys.modules.get("torch._dynamo.utils")
        return len(utils.compilation_time_metrics.get("compile_attempt_0", [])) if utils is not None else 0

    def _compiled():
        # torch's timing of each frame's whole compile (trace, backend, guards): its "entire_frame_compile"
        utils = sys.modules.get("torch._dynamo.utils")
        return utils.compilation_time_metrics.get("_compile.compile_inner", []) if utils is not None else []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        before, traced, compiled = _unique_graphs(), _traced(), len(_compiled())
        yield
        _graphs[item.nodeid] = _unique_graphs() - before
        now = _traced()
        _traces[item.nodeid] = now - traced if now >= traced else now  # cleared by torch._dynamo.reset()
        times = _compiled()
        _seconds[item.nodeid] = sum(times[compiled:] if len(times) >= compiled else times)

    def pytest_sessionfinish(session):
        out = os.environ.get("TEST_COUNTERS_OUT")
        if not out:
            return
        if os.environ.get("PYTEST_XDIST_WORKER"):
            out += "." + os.environ["PYTEST_XDIST_WORKER"]
        doc = {"modules": {m: m in sys.modules for m in ("torch", "torch._dynamo", "torch._inductor")}}
        if "torch._dynamo.utils" in sys.modules:
            from torch._dynamo.utils import counters
            doc["inductor"] = dict(counters["inductor"])
            doc["aot_autograd"] = dict(counters["aot_autograd"])
            doc["frames"] = dict(counters["frames"])  # Dynamo's own: frames it was asked to compile, and compiled
            doc["stats"] = dict(counters["stats"])  # its graphs (unique_graphs), calls captured
            doc["graphs_per_test"] = _graphs
            doc["traces_per_test"] = _traces
            doc["compile_seconds_per_test"] = _seconds
            # the session's, from torch's records as each test left them (torch._dynamo.reset() clears them, and
            # torch._dynamo.explain() resets)
            doc["compile_seconds"] = sum(_seconds.values())
        with open(out, "w") as fh:
            json.dump(doc, fh)
    """
)


@dataclass
class Run:
    """One session's result, its report (None when it wrote none) and torch's counters as the project's conftest
    wrote them (``witness``: None when no process of the session wrote them, e.g. a session that crashed)."""

    result: pytest.RunResult
    witness: dict[str, Any] | None
    report: dict[str, Any] | None
    root: Path

    @property
    def counters(self) -> dict[str, Any]:
        """torch's counters; a session that left none fails the test (a missing witness is never a zero)."""
        if self.witness is None:
            pytest.fail(f"the session wrote no counters file (exit {self.result.ret}):\n"
                        + "\n".join(self.result.outlines[-30:] + self.result.errlines[-30:]))
        return self.witness

    def _count(self, group: str, name: str) -> int:
        counters = self.counters
        if group not in counters:  # torch's counters were never loaded: nothing compiled, nothing to count
            pytest.fail(f"no process of the session loaded torch's counters ({group}): {counters}")
        return int(counters[group].get(name, 0))

    @property
    def fx_hits(self) -> int:
        return self._count("inductor", "fxgraph_cache_hit")

    @property
    def fx_misses(self) -> int:
        return self._count("inductor", "fxgraph_cache_miss")

    @property
    def aot_hits(self) -> int:
        return self._count("aot_autograd", "autograd_cache_hit")

    @property
    def aot_misses(self) -> int:
        return self._count("aot_autograd", "autograd_cache_miss")

    def megacache_warnings(self) -> list[str]:
        return [line for line in self.result.outlines if "MegacacheWarning" in line]


class TorchProject:
    """A project of ``tests`` (test_compiled.py) and a conftest reading torch's counters; every :meth:`run` gets
    new empty TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, TMPDIR, and Dynamo reuse turned off unless asked for.

    In a test's ``pytester``: its runs inherit this process's environment, as pytester's do. Else in ``path``
    (a fixture's directory, whatever its scope): its runs get this process's environment less what
    :data:`HERMETIC_PREFIXES` names, and what pytester would set (its own HOME, no colors)."""

    def __init__(self, pytester: pytest.Pytester | None = None, env: dict[str, str] | None = None,
                 tests: str = TORCH_TESTS, *, path: Path | None = None, dynamo_reuse: bool = False) -> None:
        if (pytester is None) == (path is None):
            raise TypeError("a TorchProject lives in a pytester or in a path, one of them")
        self._pytester = pytester
        self.path: Path = pytester.path if pytester is not None else path  # type: ignore[assignment]
        # The cache's layers below Dynamo (FX graphs, AOTAutograd, kernels, files) are seen without Dynamo reuse,
        # which is on by default: a frame taken from the store never looks its graphs up. ``dynamo_reuse``: the
        # plugin's default (reuse on where the torch is checked), for the sessions that test reuse itself.
        self.env = {**({} if dynamo_reuse else {"MEGACACHE_PRECOMPILE": "0"}), **(env or {})}
        self.runs = 0
        if pytester is not None:
            pytester.makepyfile(test_compiled=tests)
            pytester.makeconftest(COUNTERS_CONFTEST)
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self.write("test_compiled.py", tests)
            self.write("conftest.py", COUNTERS_CONFTEST)

    @property
    def pytester(self) -> pytest.Pytester:
        assert self._pytester is not None, "this project lives in a directory of its own, not in a pytester"
        return self._pytester

    def write(self, name: str, text: str) -> Path:
        """Another file of the project (a module its tests import, a second test file)."""
        target = self.path / name
        target.write_text(textwrap.dedent(text).strip() + "\n")
        return target

    def run(self, *args: str, env: dict[str, str | None] | None = None, timeout: float = 600) -> Run:
        """Run pytest; ``env`` values of None unset that variable for the run."""
        self.runs += 1
        root = self.path / f"run{self.runs}"
        for sub in ("inductor", "triton", "tmp"):
            (root / sub).mkdir(parents=True)
        counters_path = root / "counters.json"
        report_path = root / "report.json"
        run_env: dict[str, str | None] = {
            **self.env,
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "TMPDIR": str(root / "tmp"),
            "TEST_COUNTERS_OUT": str(counters_path),
            "MEGACACHE_REPORT": str(report_path),
            "PYTHONWARNINGS": "ignore::UserWarning:torch",
            **(env or {}),
        }
        pytest_args = ("-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", *args)
        if self._pytester is not None:
            result = self._run_in_pytester(self._pytester, pytest_args, run_env, timeout)
        else:
            result = self._run_in_path(root, pytest_args, run_env, timeout)
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        return Run(result, self._counters(root, counters_path), report, root)

    @staticmethod
    def _counters(root: Path, counters_path: Path) -> dict[str, Any] | None:
        """What the session's processes wrote of torch's counters, xdist workers' summed; None when none wrote."""
        workers = sorted(root.glob("counters.json.gw*"))
        if not counters_path.exists() and not workers:
            return None
        counters: dict[str, Any] = json.loads(counters_path.read_text()) if counters_path.exists() else {}
        for worker_file in workers:
            worker = json.loads(worker_file.read_text())
            for group in ("inductor", "aot_autograd"):
                for name, value in worker.get(group, {}).items():
                    counters.setdefault(group, {})[name] = counters.get(group, {}).get(name, 0) + value
        return counters

    @staticmethod
    def _run_in_pytester(pytester: pytest.Pytester, args: tuple[str, ...], run_env: dict[str, str | None],
                         timeout: float) -> pytest.RunResult:
        old = {k: os.environ.get(k) for k in run_env}
        for k, v in run_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            return pytester.runpytest_subprocess(*args, timeout=timeout)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _run_in_path(self, root: Path, args: tuple[str, ...], run_env: dict[str, str | None],
                     timeout: float) -> pytest.RunResult:
        """What pytester.runpytest_subprocess does, without a pytester: cwd and PYTHONPATH the project, its
        own HOME, no colors, stdin closed, a --basetemp of its own."""
        home = self.path / "home"
        home.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(HERMETIC_PREFIXES)}
        env.update({"HOME": str(home), "USERPROFILE": str(home), "PY_COLORS": "0",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(self.path), env.get("PYTHONPATH", "")]))})
        for k, v in run_env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-mpytest", f"--basetemp={root / 'basetemp'}", *args],
                              cwd=self.path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, errors="replace", timeout=timeout, check=False)
        return pytest.RunResult(proc.returncode, proc.stdout.splitlines(), proc.stderr.splitlines(),
                                time.monotonic() - start)
