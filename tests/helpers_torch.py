"""Tiny torch projects run through pytester in subprocesses, each run on fresh compile caches."""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
        with open(out, "w") as fh:
            json.dump(doc, fh)
    """
)


@dataclass
class Run:
    result: pytest.RunResult
    counters: dict[str, Any]
    report: dict[str, Any] | None
    root: Path

    @property
    def fx_hits(self) -> int:
        return int(self.counters.get("inductor", {}).get("fxgraph_cache_hit", 0))

    @property
    def fx_misses(self) -> int:
        return int(self.counters.get("inductor", {}).get("fxgraph_cache_miss", 0))

    @property
    def aot_hits(self) -> int:
        return int(self.counters.get("aot_autograd", {}).get("autograd_cache_hit", 0))

    @property
    def aot_misses(self) -> int:
        return int(self.counters.get("aot_autograd", {}).get("autograd_cache_miss", 0))

    def megacache_warnings(self) -> list[str]:
        return [line for line in self.result.outlines if "MegacacheWarning" in line]


class TorchProject:
    """A pytester project; every :meth:`run` gets new empty TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, TMPDIR."""

    def __init__(self, pytester: pytest.Pytester, env: dict[str, str] | None = None,
                 tests: str = TORCH_TESTS) -> None:
        self.pytester = pytester
        self.env = dict(env or {})
        self.runs = 0
        pytester.makepyfile(test_compiled=tests)
        pytester.makeconftest(COUNTERS_CONFTEST)

    def run(self, *args: str, env: dict[str, str | None] | None = None, timeout: float = 600) -> Run:
        """Run pytest; ``env`` values of None unset that variable for the run."""
        self.runs += 1
        root = self.pytester.path / f"run{self.runs}"
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
        old = {k: os.environ.get(k) for k in run_env}
        for k, v in run_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            result = self.pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W",
                                                        "ignore::DeprecationWarning", *args, timeout=timeout)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        counters = json.loads(counters_path.read_text()) if counters_path.exists() else {}
        for worker_file in sorted(root.glob("counters.json.gw*")):  # xdist workers: torch's counters summed
            worker = json.loads(worker_file.read_text())
            for group in ("inductor", "aot_autograd"):
                for name, value in worker.get(group, {}).items():
                    counters.setdefault(group, {})[name] = counters.get(group, {}).get(name, 0) + value
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        return Run(result, counters, report, root)
