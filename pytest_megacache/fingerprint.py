"""The environment fingerprint: what makes compiled artifacts reusable, as a readable key.

Computed without importing torch (a torch import costs seconds): versions come from package metadata and
from ``torch/version.py`` read as text, the GPU from ``/proc/driver/nvidia`` (or ``nvidia-smi``), the CPU
ISA and thread count from ``/proc/cpuinfo`` and the environment.

Compiler settings in the environment (``TORCHINDUCTOR_*``, ``TRITON_*``, ...) are keyed by name and value, but
``parts["env"]`` holds a value itself only for known harmless settings; any other value is replaced by a
digest (``hidden:<16 hex>``, see :mod:`envpolicy`), so that the parts, which travel in every stored object
and report, never carry a credential such as ``TORCHINDUCTOR_REDIS_URL``'s password.

Key layout (one readable segment per concern, then a short hash of everything)::

    torch-2.13.0/cpu-avx2-t2/py3.11-linux-x86_64/3f9a1c2b7d10
    torch-2.11.0+cu130/cuda13.0-nvidia-h100-80gb-hbm3-sm90/py3.11-linux-x86_64/8c1d...
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .envpolicy import ENV_IGNORED, ENV_PREFIXES, fingerprint_value

MIN_TORCH = (2, 7)


class TorchUnavailable(Exception):
    """torch is missing or too old for the mega-cache API."""


@dataclass(frozen=True)
class TorchInfo:
    version: str
    git_version: str
    cuda: str | None
    hip: str | None
    path: Path


def torch_info() -> TorchInfo:
    """Read torch's version without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise TorchUnavailable("torch is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    values: dict[str, str | None] = {}
    try:
        tree = ast.parse((root / "version.py").read_text())
    except (OSError, SyntaxError) as exc:
        raise TorchUnavailable(f"cannot read torch's version.py: {exc}") from exc
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target if isinstance(node, ast.AnnAssign) else None
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value if isinstance(value.value, str) else None
    version = values.get("__version__")
    if not version:
        raise TorchUnavailable("torch's version.py has no __version__")
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match or (int(match[1]), int(match[2])) < MIN_TORCH:
        raise TorchUnavailable(f"torch {version} is older than 2.7, which introduced the mega-cache API")
    return TorchInfo(version, values.get("git_version") or "unknown", values.get("cuda"), values.get("hip"), root)


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.+_]+", "-", text.lower()).strip("-")


def _cpu_flags() -> tuple[set[str], int | None]:
    """CPU feature flags and the number of physical cores this process may use (Linux only)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), None
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = None
    flags: set[str] = set()
    cores: set[tuple[str, str]] = set()
    for block in text.strip().split("\n\n"):
        info = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        if not flags:
            flags = set((info.get("flags") or info.get("Features") or "").split())
        proc = info.get("processor", "")
        if allowed is not None and proc.isdigit() and int(proc) not in allowed:
            continue
        cores.add((info.get("physical id", "0"), info.get("core id", proc)))
    return flags, len(cores) or None


def cpu_isa(flags: set[str]) -> str:
    for isa in ("avx512_bf16", "amx_tile", "avx512f", "avx2", "sve", "asimd", "neon"):
        if isa in flags:
            return {"avx512_bf16": "avx512bf16", "amx_tile": "amx", "avx512f": "avx512", "asimd": "neon"}.get(isa, isa)
    return _slug(platform.machine()) or "unknown"


def thread_count(physical_cores: int | None) -> int:
    """torch.get_num_threads() as torch will see it: OMP_NUM_THREADS, else the physical cores."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    if physical_cores:
        return physical_cores
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_names() -> list[str]:
    """Names of the NVIDIA GPUs, from the driver's proc files or nvidia-smi; empty when none."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    if names:
        return names
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=False).stdout
            return [line.replace(",", " sm").strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            return []
    return []


@dataclass(frozen=True)
class Fingerprint:
    """What the key is made of (``parts``) and the key itself."""

    parts: dict[str, object] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        blob = json.dumps(self.parts, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @property
    def key(self) -> str:
        p = self.parts
        return f"torch-{p['torch']}/{p['device']}/py{p['python']}-{p['platform']}/{self.digest}"


def compute(env: dict[str, str] | None = None, torch: TorchInfo | None = None) -> Fingerprint:
    """The fingerprint of this process's environment. Raises :class:`TorchUnavailable`."""
    env = dict(os.environ if env is None else env)
    torch = torch or torch_info()
    flags, physical = _cpu_flags()
    threads = thread_count(physical)
    isa = cpu_isa(flags)
    gpus = gpu_names() if (torch.cuda or torch.hip) and env.get("CUDA_VISIBLE_DEVICES") != "" else []
    if torch.cuda and gpus:
        device = f"cuda{torch.cuda}-{_slug(gpus[0])}"
    elif torch.hip and gpus:
        device = f"rocm{torch.hip}-{_slug(gpus[0])}"
    else:
        device = f"cpu-{isa}-t{threads}"
    parts: dict[str, object] = {
        "torch": torch.version,
        "torch_git": torch.git_version,
        "triton": _dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "cuda": torch.cuda,
        "hip": torch.hip,
        "gpus": gpus,
        "device": device,
        "cpu_isa": isa,
        "threads": threads,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "implementation": sys.implementation.name,
        "platform": f"{sys.platform}-{_slug(platform.machine())}",
        # Every compiler setting by name; its value only when known harmless (envpolicy), else a digest.
        "env": {k: fingerprint_value(k, v) for k, v in sorted(env.items())
                if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED},
    }
    return Fingerprint(parts)
