"""The machine and the versions a benchmark ran on: recorded with its results and written above its tables and
plots."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


def _version(*names: str) -> str | None:
    from pytest_megacache.fingerprint import _dist_version  # the plugin's own lookup (first name installed)

    return _dist_version(*names)


def environment() -> dict[str, Any]:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        try:
            proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=30)
            gpus = [g.strip() for g in proc.stdout.splitlines() if g.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu or platform.processor() or "unknown CPU", "cpu_count": os.cpu_count(), "usable_cpus": usable,
            "gpus": gpus, "python": platform.python_version(), "platform": platform.platform(),
            "torch": _version("torch"), "triton": _version("triton", "pytorch-triton", "pytorch-triton-rocm"),
            "pytest_megacache": _version("pytest-megacache"), "moto": _version("moto"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def env_label(env: dict[str, Any]) -> str:
    hw = f"{env['cpu']}, {env['usable_cpus']} cores"
    if env["gpus"]:
        hw += ", " + ", ".join(sorted(set(env["gpus"])))
    sw = f"torch {env['torch']}" + (f", triton {env['triton']}" if env["triton"] else "") + f", Python {env['python']}"
    return f"{hw}; {sw}"
