"""A pytest plugin for the benchmarks (``-p bench_dynamo_seconds``, this folder on PYTHONPATH): at the end of the
session, torch's own compile timings summed into the seconds Dynamo spent, written as JSON to
``$MEGACACHE_BENCH_DYNAMO_OUT``. Imports nothing of torch's that the session did not import.

Dynamo's seconds: every compile attempt (``compile_attempt_N``, which holds tracing, guard building and the backend
call) less the backend call (``OutputGraph.call_user_compiler``), plus the guards built and loaded for entries
installed from Dynamo reuse (``precompile_load_guards``, ``precompile_build_guards``)."""

from __future__ import annotations

import json
import os
import sys

import pytest

BACKEND = "OutputGraph.call_user_compiler"
REUSE = ("precompile_load_guards", "precompile_build_guards")


def dynamo_seconds(metrics: dict[str, list[float]]) -> dict[str, float]:
    attempts = sum(sum(v) for k, v in metrics.items() if k.startswith("compile_attempt_"))
    backend = sum(metrics.get(BACKEND, []))
    reuse = sum(sum(metrics.get(k, [])) for k in REUSE)
    return {"dynamo": attempts - backend + reuse, "attempts": attempts, "backend": backend, "reuse_guards": reuse,
            "bytecode_tracing": sum(metrics.get("bytecode_tracing", [])),
            "build_guards": sum(metrics.get("build_guards", []))}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("MEGACACHE_BENCH_DYNAMO_OUT")
    utils = sys.modules.get("torch._dynamo.utils")
    if not out:
        return
    metrics = getattr(utils, "compilation_time_metrics", None) or {}
    with open(out, "w") as fh:
        json.dump(dynamo_seconds({str(k): [float(x) for x in v] for k, v in metrics.items()}), fh)
