"""Lint and types are part of the suite when the tools are installed (scripts/bootstrap.sh installs them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .conftest import tool_path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    proc = subprocess.run([tool_path("ruff"), "check", "pytest_megacache", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_is_clean() -> None:
    proc = subprocess.run([tool_path("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
