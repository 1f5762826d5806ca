"""The version suite's fixtures: the sessions of the small project, each run once per suite and shared by the tests
that read it, and the per-tier verdicts (``--compat-results=PATH`` writes them as JSON, with the torch and triton
versions and each session's wall time)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from .sessions import Project, Session

# The main sessions never run the ISA decision test (it patches torch's check; compat/test_isa.py runs it alone).
MAIN = ("-k", "not isa_decision")
# The cache's layers below Dynamo (FX graphs, AOTAutograd, kernels) are seen without Dynamo reuse, which is on by
# default where checked: a frame taken from the store never looks its graphs up. Reuse has sessions of its own.
LAYERS = (*MAIN, "--megacache-no-precompile")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--compat-results", default=None, metavar="PATH",
                     help="write each tier's verdict and each session's wall time to PATH (JSON)")


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version() -> tuple[int, int]:
    """torch's (major, minor), read from its distribution's metadata (the suite's own process never imports torch)."""
    found = version("torch")
    if found is None:
        pytest.skip("torch is not installed")
    major, minor = found.split(".")[:2]
    return int(major), int(minor)


class Matrix:
    """Every session of the suite, run on first use (a warm session runs its cold session first)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.project = Project(base / "project")
        self.store = base / "store"
        self.sessions: dict[str, Session] = {}

    def _get(self, name: str, *args: str, store: Path | None, env: dict[str, str] | None = None) -> Session:
        if name not in self.sessions:
            self.sessions[name] = self.project.run(name, *args, store=store, env=env)
        return self.sessions[name]

    def plain(self) -> Session:
        return self._get("plain", *MAIN, store=None)

    def cold(self) -> Session:
        return self._get("cold", *LAYERS, store=self.store)

    def warm(self) -> Session:
        self.cold()
        return self._get("warm", *LAYERS, store=self.store)

    def warm_xdist(self) -> Session:
        self.cold()
        return self._get("warm-n2", *LAYERS, "-n", "2", store=self.store)

    # The user's opt-in to dynamic-shape profiles (pgo): its own store, the dynamic-shape test alone.
    def pgo_cold(self) -> Session:
        return self._get("pgo-cold", "-k", "dynamic_recompile", store=self.base / "store-pgo",
                         env={"TORCH_COMPILE_JOB_ID": "compat-suite"})

    def pgo_warm(self) -> Session:
        self.pgo_cold()
        return self._get("pgo-warm", "-k", "dynamic_recompile", store=self.base / "store-pgo",
                         env={"TORCH_COMPILE_JOB_ID": "compat-suite"})

    # Dynamo reuse: its own store, the main tests; cold as by default, warm asked for (--megacache-precompile).
    def reuse_cold(self) -> Session:
        return self._get("reuse-cold", *MAIN, store=self.base / "store-reuse")

    def reuse_warm(self) -> Session:
        self.reuse_cold()
        return self._get("reuse-warm", *MAIN, "--megacache-precompile", store=self.base / "store-reuse")

    # The CPU vector-ISA check (torch 2.14 and later): its own store, the decision test alone.
    def isa(self, name: str, *, plugin: bool = True, pretend_amx: bool = False) -> Session:
        env = {"COMPAT_PRETEND_AMX": "1"} if pretend_amx else {}
        return self._get(f"isa-{name}", "-k", "isa_decision", store=self.base / "store-isa" if plugin else None,
                         env=env)


class Results:
    """Each tier's verdict (``hit``, ``fails open``, ``not available``) and what it rests on."""

    def __init__(self) -> None:
        self.tiers: dict[str, dict[str, str]] = {}
        self.failed: set[str] = set()

    def record(self, tier: str, verdict: str, detail: str) -> None:
        self.tiers[tier] = {"verdict": verdict, "detail": detail}


_RESULTS = Results()
_MATRIX: list[Matrix] = []


@pytest.fixture(scope="session")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    torch_version()
    m = Matrix(tmp_path_factory.mktemp("compat"))
    _MATRIX.append(m)
    yield m


@pytest.fixture(scope="session")
def results() -> Results:
    return _RESULTS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    tier = item.get_closest_marker("tier")
    if tier and report.failed:
        _RESULTS.failed.add(str(tier.args[0]))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tier(name): the support table's tier a test decides")


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--compat-results")
    if not path:
        return
    tiers: dict[str, Any] = {name: dict(v) for name, v in _RESULTS.tiers.items()}
    for name in _RESULTS.failed:
        tiers[name] = {"verdict": "FAILED", "detail": tiers.get(name, {}).get("detail", "")}
    doc = {
        "torch": version("torch"), "triton": version("triton"), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "tiers": dict(sorted(tiers.items())),
        "sessions": {name: {"seconds": round(s.seconds, 1), "exit": s.returncode, "outcomes": s.outcomes,
                            "problems": s.problems, "notes": s.notes}
                     for m in _MATRIX for name, s in m.sessions.items()},
        "argv": sys.argv[1:],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
