"""A pytest plugin that logs when each process of a session reaches the hooks that frame its end: where the seconds
after the last test go (pytest-xdist's workers and controller included).

    TIMELINE_LOG=/tmp/tl.txt TIMELINE_T0=$(date +%s.%N) PYTHONPATH=benchmarks \\
        python -m pytest -p hook_timeline -n 2 tests/

Each line is ``<seconds since TIMELINE_T0> <process> <event>``: the plugin's import, each test's report, the start
of ``pytest_sessionfinish``, the end of ``pytest_unconfigure``, the first and last ``atexit`` handlers (between them:
what the interpreter runs at exit, such as Inductor's compile-pool shutdown) and, on the controller, each worker's
``pytest_testnodedown``. With TIMELINE_STACKS=1 a worker or controller still alive 2.5 s after its unconfigure dumps
every thread's stack to ``<TIMELINE_LOG>.stacks.<process>`` (``faulthandler``), every 2.5 s until it exits.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import time
from typing import Any

import pytest

LOG = os.environ.get("TIMELINE_LOG", "")
T0 = float(os.environ.get("TIMELINE_T0") or time.time())
WHO = os.environ.get("PYTEST_XDIST_WORKER") or ("ctl" if any(a.startswith(("-n", "--numprocesses")) for a in sys.argv)
                                                else "main")
_stacks: list[Any] = []


def log(event: str) -> None:
    if LOG:
        with open(LOG, "a") as fh:
            fh.write(f"{time.time() - T0:8.2f} {WHO:5} {event}\n")


log("plugin-import")
atexit.register(log, "atexit-end")  # registered first: runs last


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        log(f"report {report.nodeid}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    log("sessionfinish-begin")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    log("unconfigure-end")
    atexit.register(log, "atexit-begin")  # registered last: runs first
    if LOG and os.environ.get("TIMELINE_STACKS") and WHO != "main":
        _stacks.append(open(f"{LOG}.stacks.{WHO}", "w"))
        faulthandler.dump_traceback_later(2.5, repeat=True, file=_stacks[-1])


def pytest_testnodedown(node: Any, error: object) -> None:
    log(f"nodedown {node.gateway.id}")
