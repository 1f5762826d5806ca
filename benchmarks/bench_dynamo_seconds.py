"""A pytest plugin for the benchmarks (``-p bench_dynamo_seconds``, this folder on PYTHONPATH): at the end of the
session, torch's own compile timings summed into the seconds Dynamo spent, written as JSON to
``$MEGACACHE_BENCH_DYNAMO_OUT``. Imports nothing of torch's that the session did not import.

Dynamo's seconds: every compile attempt (``compile_attempt_N``, which holds tracing, guard building and the backend
call) less the backend call (``OutputGraph.call_user_compiler``), plus the stored variants offered where Dynamo would
trace (``precompile_build_guards``: their guards built and checked, and their guard states unpickled, timed again
inside it as ``precompile_load_guards``, so counted once). ``torch._dynamo.reset()`` clears torch's timings, so they
are added up after every test (and cleared here, so none counts twice)."""

from __future__ import annotations

import json
import os
import sys

import pytest

BACKEND = "OutputGraph.call_user_compiler"
REUSE = "precompile_build_guards"  # holds precompile_load_guards (timed inside it)
LOAD = "precompile_load_guards"


def dynamo_seconds(metrics: dict[str, list[float]]) -> dict[str, float]:
    attempts = sum(sum(v) for k, v in metrics.items() if k.startswith("compile_attempt_"))
    backend = sum(metrics.get(BACKEND, []))
    reuse = sum(metrics.get(REUSE, []))
    return {"dynamo": attempts - backend + reuse, "attempts": attempts, "backend": backend, "reuse_guards": reuse,
            "reuse_unpickle": sum(metrics.get(LOAD, [])),
            "bytecode_tracing": sum(metrics.get("bytecode_tracing", [])),
            "build_guards": sum(metrics.get("build_guards", []))}


_TOTALS: dict[str, list[float]] = {}


def _collect() -> None:
    metrics = getattr(sys.modules.get("torch._dynamo.utils"), "compilation_time_metrics", None)
    if not metrics:
        return
    for key, values in metrics.items():
        _TOTALS.setdefault(str(key), []).extend(float(v) for v in values)
    metrics.clear()


def pytest_runtest_logfinish() -> None:
    _collect()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("MEGACACHE_BENCH_DYNAMO_OUT")
    if not out:
        return
    _collect()
    with open(out, "w") as fh:
        json.dump(dynamo_seconds(_TOTALS), fh)
