"""Real pytest sessions of the small project (compat/project.py), each in a fresh process with fresh
``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` and ``TMPDIR`` (a new CI runner), the plugin on a directory store
or off (``-p no:megacache``). What a session did is read from torch's own counters (the project's conftest),
pytest's JUnit XML and the plugin's JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import project

# Never inherited from the machine or the CI job: the sessions choose their own.
CLEARED_PREFIXES = ("MEGACACHE_", "GITHUB_", "TORCH_COMPILE_JOB_ID", "TORCHINDUCTOR_", "TRITON_", "PYTEST_")
SESSION_TIMEOUT = 900


def _hits(counters: dict[str, Any], group: str, name: str) -> int:
    return int(counters.get(group, {}).get(name, 0))


@dataclass
class Counters:
    """torch's own counters of one or more processes, summed."""

    totals: dict[str, dict[str, int]] = field(default_factory=dict)
    per_test: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def add(self, doc: dict[str, Any]) -> None:
        for group, values in dict(doc.get("totals", {})).items():
            into = self.totals.setdefault(group, {})
            for name, value in values.items():
                into[name] = into.get(name, 0) + int(value)
        for test, groups in dict(doc.get("per_test", {})).items():
            self.per_test[test] = groups

    @property
    def fx_hits(self) -> int:
        return _hits(self.totals, "inductor", "fxgraph_cache_hit")

    @property
    def fx_misses(self) -> int:
        return _hits(self.totals, "inductor", "fxgraph_cache_miss")

    @property
    def aot_hits(self) -> int:
        return _hits(self.totals, "aot_autograd", "autograd_cache_hit")

    @property
    def aot_misses(self) -> int:
        return _hits(self.totals, "aot_autograd", "autograd_cache_miss")

    def test(self, name: str) -> dict[str, dict[str, int]]:
        return self.per_test.get(name, {})

    def graphs(self, name: str) -> int:
        """Graphs Dynamo compiled in this test (torch's ``unique_graphs``)."""
        return _hits(self.test(name), "stats", "unique_graphs")


@dataclass
class Session:
    name: str
    args: tuple[str, ...]
    returncode: int
    output: str
    seconds: float
    root: Path
    counters: Counters
    children: Counters  # the child processes' own counters
    outcomes: dict[str, str]
    report: dict[str, Any] | None

    @property
    def cache_dir(self) -> Path:
        return self.root / "inductor"

    def megacache_warnings(self) -> list[str]:
        return [line for line in self.output.splitlines() if "MegacacheWarning" in line]

    @property
    def problems(self) -> list[str]:
        return list((self.report or {}).get("problems", []))

    @property
    def notes(self) -> list[str]:
        return list((self.report or {}).get("notes", []))

    def describe(self) -> str:
        return f"session {self.name} ({' '.join(self.args)}), exit {self.returncode}:\n{self.output[-6000:]}"


def outcomes(junit: Path) -> dict[str, str]:
    """test name -> passed / failed / error / skipped, from pytest's JUnit XML."""
    if not junit.exists():
        return {}
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        result = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                result = {"failure": "failed"}.get(child.tag, child.tag)
        out[case.get("name", "?")] = result
    return out


class Project:
    """The project's files in ``path``; :meth:`run` starts a session under ``path/runs/<name>``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "test_project.py").write_text(project.TESTS)
        (path / "conftest.py").write_text(project.CONFTEST)
        (path / "pytest.ini").write_text(project.PYTEST_INI)
        self.runs = path.parent / f"{path.name}-runs"

    def run(self, name: str, *args: str, store: Path | None, env: dict[str, str] | None = None) -> Session:
        """One session; ``store`` None runs it with the plugin off."""
        root = self.runs / name
        for sub in ("inductor", "triton", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=False)
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(CLEARED_PREFIXES)}
        run_env.update({
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "TMPDIR": str(root / "tmp"),
            "TEST_COUNTERS_OUT": str(root / "counters.json"),
            "COMPAT_ISA_OUT": str(root / "isa.json"),
        })
        cmd = [sys.executable, "-m", "pytest", f"--junitxml={root / 'junit.xml'}", "-p", "no:randomly"]
        if store is None:
            cmd += ["-p", "no:megacache"]
        else:
            run_env["MEGACACHE_DIR"] = str(store)
            run_env["MEGACACHE_REPORT"] = str(root / "report.json")
        run_env.update(env or {})
        started = time.perf_counter()
        done = subprocess.run([*cmd, *args], cwd=self.path, env=run_env, capture_output=True, text=True,
                              timeout=SESSION_TIMEOUT, check=False)
        seconds = time.perf_counter() - started
        counters, children = Counters(), Counters()
        for path in sorted(root.glob("counters.json*")):
            doc = json.loads(path.read_text())
            if ".child." in path.name:
                children.add({"totals": doc})
            else:
                counters.add(doc)
        report_path = root / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        return Session(name, tuple(args), done.returncode, done.stdout + done.stderr, seconds, root, counters,
                       children, outcomes(root / "junit.xml"), report)


def isa_decision(session: Session) -> dict[str, Any]:
    path = session.root / "isa.json"
    assert path.exists(), session.describe()
    return dict(json.loads(path.read_text()))


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``pytest-megacache`` of this environment (its console script beside the interpreter)."""
    script = Path(sys.executable).with_name("pytest-megacache")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "pytest_megacache"]
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(CLEARED_PREFIXES)}
    run_env.update(env or {})
    return subprocess.run([*cmd, *args], env=run_env, capture_output=True, text=True, timeout=300, check=False)
