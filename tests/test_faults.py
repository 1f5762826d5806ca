"""Hostile but ordinary conditions, for real: pytest sessions compiling with torch against moto's S3 server
behind a fault-injection proxy (tests/faultproxy.py): 503 on every request, a connection reset mid-PUT, a GET
body trickled at one byte a second, a PUT response trickled, an endpoint that never answers; and boto3 that
cannot build a client (a missing AWS profile, an endpoint without a scheme).

Each session is a subprocess whose wall time is measured from outside, until the process has exited (threads
left blocked in I/O must not hold it). Every fault must give: the tests pass, exactly one MegacacheWarning,
an exit within the session's own time (a plain run of the same tests, measured in the same chain) plus the
configured budgets, and a store that a following warm run finds intact. The sessions run once, in one chain
(a class-scoped fixture), and the tests of the class read what they need from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod

from .conftest import HERMETIC_PREFIXES, S3_ENV, S3Server, removed_unless_failed
from .faultproxy import FaultProxy
from .helpers_torch import COUNTERS_CONFTEST, skip_without_torch

skip_without_torch()
pytestmark = pytest.mark.torch

RESTORE_BUDGET = 4.0
UPLOAD_BUDGET = 4.0
GRACE = 1.0  # core.RESTORE_GRACE: the restore thread's time to write what it fetched
# Noise between two runs of the same tests on a loaded 2-core machine; a hang costs minutes (old code: 4 x 30 s
# for a silent endpoint, forever for a trickle), far beyond it.
SLACK = 20.0

PROJECT = textwrap.dedent(
    """
    import os

    import torch

    SCALE = float(os.environ.get("SCALE", "2"))  # a constant of the graph: another SCALE is another graph

    def f(x):
        return torch.sin(x) * SCALE + 1

    def test_compiles():
        assert torch.allclose(torch.compile(f)(torch.zeros(4)), torch.ones(4))

    def test_plain():
        assert True
    """
)


@dataclass
class Outcome:
    rc: int
    out: str
    wall: float
    report: dict[str, Any] | None
    counters: dict[str, Any]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        return [line for line in self.out.splitlines() if "MegacacheWarning" in line]

    def counter(self, group: str, name: str) -> int:
        return int(self.counters.get(group, {}).get(name, 0))


class Chain:
    def __init__(self, root: Path, s3: S3Server, proxy: FaultProxy) -> None:
        self.root = root
        self.proxy = proxy
        self.bucket = s3.new_bucket()
        self.project = root / "project"
        self.project.mkdir()
        (self.project / "test_scaled.py").write_text(PROJECT)
        (self.project / "conftest.py").write_text(COUNTERS_CONFTEST)
        self.outcomes: dict[str, Outcome] = {}

    def run(self, name: str, *args: str, mode: str | None = None, env: dict[str, str] | None = None) -> Outcome:
        work = self.root / name
        for sub in ("inductor", "triton", "tmp"):
            (work / sub).mkdir(parents=True)
        base = {k: v for k, v in os.environ.items()  # the chain starts before the tests' own environment cleaning
                if not k.startswith((*HERMETIC_PREFIXES, "AWS_", "TORCHINDUCTOR_", "TRITON_", "TORCH_COMPILE_"))}
        run_env = {
            **base, **S3_ENV,
            "AWS_ENDPOINT_URL_S3": self.proxy.url, "AWS_CONFIG_FILE": str(work / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(work / "none"), "AWS_EC2_METADATA_DISABLED": "true",
            "MEGACACHE_BUCKET": self.bucket, "MEGACACHE_REPORT": str(work / "report.json"),
            "MEGACACHE_TIMEOUT": str(RESTORE_BUDGET), "MEGACACHE_UPLOAD_TIMEOUT": str(UPLOAD_BUDGET),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton"),
            "TMPDIR": str(work / "tmp"), "TEST_COUNTERS_OUT": str(work / "counters.json"),
            "PYTHONWARNINGS": "ignore::UserWarning:torch",
            # the faults as the layers below Dynamo meet them (a warm run's FX-graph hit is read); Dynamo reuse, which
            # waits for the restore where a function is first wrapped, has a run of its own (precompile-blackhole)
            "MEGACACHE_PRECOMPILE": "0",
            **(env or {}),
        }
        self.proxy.mode = mode
        seen = len(self.proxy.requests)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
                               *args], cwd=self.project, env=run_env, capture_output=True, text=True, timeout=300,
                              check=False)
        wall = time.monotonic() - start
        self.proxy.mode = None
        report_path, counters_path = work / "report.json", work / "counters.json"
        outcome = Outcome(proc.returncode, proc.stdout + proc.stderr, wall,
                          json.loads(report_path.read_text()) if report_path.exists() else None,
                          json.loads(counters_path.read_text()) if counters_path.exists() else {},
                          list(self.proxy.requests[seen:]))
        self.outcomes[name] = outcome
        return outcome

    def bound(self, *budgets: float) -> float:
        """The session's own time (the plain run) plus the budgets a fault may spend, plus noise."""
        return self.outcomes["plain"].wall + sum(budgets) + SLACK


@pytest.fixture(scope="class")
def chain(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Chain]:
    with FaultProxy(s3_server.url) as proxy:
        c = Chain(removed_unless_failed(request, tmp_path_factory.mktemp("faults")), s3_server, proxy)
        c.run("plain", "-p", "no:megacache")
        c.run("cold", env={"SCALE": "1"})
        c.run("trickle-get", mode="trickle-get", env={"SCALE": "1"})
        c.run("503", mode="503", env={"SCALE": "2"})
        c.run("blackhole", mode="blackhole", env={"SCALE": "2"})
        c.run("strict-blackhole", "--megacache-strict", mode="blackhole", env={"SCALE": "2"})
        c.run("precompile-blackhole", "--megacache-precompile", mode="blackhole", env={"SCALE": "2"})
        c.run("reset-put", mode="reset-put", env={"SCALE": "3"})
        c.run("trickle-put", mode="trickle-put", env={"SCALE": "4"})
        c.run("no-profile", env={"SCALE": "5", "AWS_PROFILE": "does-not-exist"})
        c.run("no-scheme", env={"SCALE": "5", "AWS_ENDPOINT_URL_S3": c.proxy.url.removeprefix("http://")})
        c.run("warm", env={"SCALE": "1"})
        c.run("strict-new-graph", "--megacache-strict", env={"SCALE": "6"})
        summary = os.environ.get("MEGACACHE_FAULTS_SUMMARY")  # for a closing note: wall and warnings per fault
        if summary:
            Path(summary).write_text(json.dumps({name: {"wall": round(o.wall, 2), "rc": o.rc, "warnings": len(o.warnings),
                                                        "requests": len(o.requests)} for name, o in c.outcomes.items()},
                                                indent=1))
        yield c


def assert_contained(chain: Chain, name: str, *budgets: float, says: str) -> Outcome:
    run = chain.outcomes[name]
    assert run.rc == 0, run.out[-3000:]
    assert "2 passed" in run.out
    assert len(run.warnings) == 1 and says in run.warnings[0], run.warnings or run.out[-3000:]
    assert "Traceback" not in run.out
    assert run.wall < chain.bound(*budgets), (run.wall, chain.outcomes["plain"].wall)
    assert run.report is not None and len(run.report["problems"]) >= 1
    return run


class TestFaultChain:
    """Assertions on the chain's sessions (a class: under pytest-xdist its tests share one worker)."""

    def test_the_chain_starts_from_a_plain_run_and_a_cold_upload(self, chain: Chain) -> None:
        plain, cold = chain.outcomes["plain"], chain.outcomes["cold"]
        assert plain.rc == 0 and cold.rc == 0 and not cold.warnings
        assert cold.report is not None and cold.report["upload"]["objects"] == 1
        assert cold.wall < chain.bound()


    def test_a_trickled_get_body_costs_the_restore_budget_once(self, chain: Chain) -> None:
        run = assert_contained(chain, "trickle-get", RESTORE_BUDGET, GRACE,
                               says="not fetched within the budget of the restore (4 s")
        assert run.report is not None and run.report["upload"]["reason"] == "store unavailable"
        assert any(mode == "trickle-get" for _m, _p, mode in run.requests)  # the body really trickled


    def test_503_on_every_request_is_three_requests_and_one_warning(self, chain: Chain) -> None:
        run = assert_contained(chain, "503", says="SlowDown")
        # One listing, 3 attempts in all (botocore's max_attempts would have made 4), and no upload tried after it.
        assert [(m, mode) for m, _p, mode in run.requests] == [("GET", "503")] * 3
        assert run.report is not None and run.report["upload"]["reason"] == "store unavailable"


    def test_an_endpoint_that_never_answers_costs_the_restore_budget(self, chain: Chain) -> None:
        run = assert_contained(chain, "blackhole", RESTORE_BUDGET, GRACE,
                               says="listing the store did not finish within the budget of the restore (4 s")
        assert run.report is not None and run.report["upload"]["reason"] == "store unavailable"


    def test_strict_mode_fails_within_the_same_budget(self, chain: Chain) -> None:
        run = chain.outcomes["strict-blackhole"]
        assert run.rc == pytest.ExitCode.USAGE_ERROR, run.out[-3000:]
        assert "pytest-megacache (strict): restore: listing the store did not finish within the budget of the restore" in run.out
        assert run.wall < chain.bound(RESTORE_BUDGET, GRACE)


    def test_precompile_waits_for_the_restore_at_the_first_wrapping_within_the_same_budget(self, chain: Chain) -> None:
        """--megacache-precompile loads the restore where torch first looks a stored entry up (torch.compile() wrapping
        a function): against an endpoint that never answers, that wait costs the restore budget once."""
        run = assert_contained(chain, "precompile-blackhole", RESTORE_BUDGET, GRACE,
                               says="listing the store did not finish within the budget of the restore (4 s")
        assert run.report is not None and run.report["settings"]["precompile"] is True
        assert run.report["processes"][0]["restore_wait"] >= RESTORE_BUDGET - 1


    def test_a_reset_mid_put_is_one_warning(self, chain: Chain) -> None:
        run = assert_contained(chain, "reset-put", UPLOAD_BUDGET, says="upload")
        assert run.report is not None and run.report["upload"]["reason"] == "upload failed"
        assert [m for m, _p, mode in run.requests if mode == "reset-put"] == ["PUT"] * 3


    def test_a_trickled_put_response_costs_the_upload_budget(self, chain: Chain) -> None:
        run = assert_contained(chain, "trickle-put", UPLOAD_BUDGET,
                               says="upload did not finish within the budget of the upload (4 s")
        assert run.report is not None and run.report["upload"]["reason"] == "upload failed"


    @pytest.mark.parametrize(("name", "says"), [("no-profile", "ProfileNotFound"), ("no-scheme", "ValueError")])
    def test_a_client_boto3_cannot_build_is_one_warning_and_a_report(self, chain: Chain, name: str, says: str) -> None:
        run = assert_contained(chain, name, says=says)
        assert run.report is not None and run.report["upload"]["reason"] == "store unavailable"
        assert "megacache" in run.out and "uploaded nothing: store unavailable" in run.out  # the summary is there


    def test_after_every_fault_the_store_is_intact(self, chain: Chain, s3_server: S3Server) -> None:
        warm = chain.outcomes["warm"]
        assert warm.rc == 0 and not warm.warnings, warm.out[-3000:]
        assert warm.counter("inductor", "fxgraph_cache_hit") == 1 and warm.counter("inductor", "fxgraph_cache_miss") == 0
        client = s3_server.client()
        for key in s3_server.keys(chain.bucket):  # every stored object is whole and valid
            blob = client.get_object(Bucket=chain.bucket, Key=key)["Body"].read()
            bundlemod.decode(blob)


    def test_strict_mode_passes_a_healthy_session_that_compiles_only_new_graphs(self, chain: Chain) -> None:
        """A session (a shard, new code) whose graphs the store does not hold yet restores objects and hits none of
        them: healthy, a note and no problem, so --megacache-strict does not fail it."""
        run = chain.outcomes["strict-new-graph"]
        assert run.rc == 0 and not run.warnings, run.out[-3000:]
        assert run.counter("inductor", "fxgraph_cache_hit") == 0 and run.counter("inductor", "fxgraph_cache_miss") == 1
        assert run.report is not None and run.report["problems"] == [] and run.report["restore"]["objects_used"] >= 1
        assert any("compiled only graphs they do not hold" in note for note in run.report["notes"])
