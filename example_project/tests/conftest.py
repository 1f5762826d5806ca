"""Fixtures shared by the CPU and GPU tests."""

from __future__ import annotations

import json
import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """With EXAMPLE_TRITON_EVENTS set, log every Triton compile (kernel name, cache hit or not): the proof
    that a restored TRITON_CACHE_DIR spares user kernels their compile. Needs Triton's listener knob.
    (Not a TRITON_* name: those variables are part of the cache fingerprint.)"""
    out = os.environ.get("EXAMPLE_TRITON_EVENTS")
    if not out:
        return
    try:
        import triton.knobs
    except ImportError:
        return

    def listener(*, src, metadata, metadata_group, times, cache_hit):  # Triton calls it with these keywords
        with open(out, "a") as fh:
            fh.write(json.dumps({"name": metadata.get("name"), "cache_hit": cache_hit,
                                 "seconds": getattr(times, "total_us", 0) / 1e6 if times else None}) + "\n")

    triton.knobs.compilation.listener = listener


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_compile_state() -> None:
    """Each test compiles from a clean Dynamo state (in-memory only: on-disk caches stay)."""
    torch._dynamo.reset()
    torch.manual_seed(0)


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
