"""Fixtures shared by the CPU and GPU tests."""

from __future__ import annotations

import pytest
import torch


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
