"""The environment fingerprint: what makes compiled artifacts reusable, as a readable key.

Computed without importing torch (a torch import costs seconds): versions come from package metadata and
from ``torch/version.py`` read as text, the GPU from ``/proc/driver/nvidia`` (or ``nvidia-smi``), the vector ISA
torch's Inductor will generate CPU code for (derived as torch derives it, from ``/proc/cpuinfo``'s flags and
``ATEN_CPU_CAPABILITY``), the CPU flags that decide it, the C++ compiler and the thread count from
``/proc/cpuinfo`` and the environment.

Compiler settings in the environment (``TORCHINDUCTOR_*``, ``TRITON_*``, ...) are keyed by name and value, but
``parts["env"]`` holds a value itself only for known harmless settings; any other value is replaced by a
digest (``hidden:<16 hex>``, see :mod:`envpolicy`), so that the parts, which travel in every stored object
and report, never carry a credential such as ``TORCHINDUCTOR_REDIS_URL``'s password.

Key layout (one readable segment per concern, then a short hash of everything)::

    torch-2.13.0/cpu-avx512vnni-t2/py3.11-linux-x86_64/3f9a1c2b7d10
    torch-2.11.0+cu130/cuda13.0-nvidia-h100-80gb-hbm3/py3.11-linux-x86_64/8c1d...
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

from .envpolicy import HARMLESS_VALUE, fingerprint_value, hide, keyed

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
            flags = set((info.get("flags") or info.get("Features") or info.get("features") or "").split())
        proc = info.get("processor", "")
        if allowed is not None and proc.isdigit() and int(proc) not in allowed:
            continue
        cores.add((info.get("physical id", "0"), info.get("core id", proc)))
    return flags, len(cores) or None


# torch's Inductor generates CPU code for one vector ISA, hard-coding its width (``x0+=16``, ``loadu(ptr, 16)``) into
# the generated source, and its FX-graph cache key has no field for it: a graph compiled for AVX-512 and loaded where
# torch picks AVX2 computes wrong numbers. So the key holds what torch picks (``torch/_inductor/cpu_vec_isa.py``:
# ``valid_vec_isa_list`` then ``pick_vec_isa``), derived here from the CPU's flags and ``ATEN_CPU_CAPABILITY``
# without importing torch, and the raw flags that decide the pick or its build flags (bf16/fp16 conversions, AMX
# micro-GEMMs, SVE2's -march), so two CPUs that differ in any of them never share a key.
_AVX512 = frozenset({"avx512f", "avx512dq", "avx512vl", "avx512bw"})
CODEGEN_FLAGS = frozenset({
    # x86: what torch.cpu._is_*_supported() and VecAVX512/VecAVX512VNNI/VecAMX test
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512vl", "avx512bw", "avx512cd", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    # aarch64: VecNEON / VecSVE(128|256), and SVE2 (armv9-a build flags)
    "asimd", "asimdhp", "fphp", "sve", "sve2", "bf16", "svebf16", "i8mm", "svei8mm",
    # ppc64le / s390x
    "vsx", "altivec", "vxe", "vxe2",
})
# ATEN_CPU_CAPABILITY's values that torch maps to an ISA (get_isa_from_cpu_capability); any other value is ignored
# by torch (with a warning) and the first valid ISA is picked.
_CAPABILITY = {"default": None, "zvector": "zvector", "vsx": "vsx", "avx2": "avx2", "avx512": "avx512"}
_PR_SVE_GET_VL = 51


def sve_bits(machine: str | None = None) -> int | None:
    """The SVE vector length in bits this process runs with (torch's ``sve_max_length``), None off aarch64 or
    without SVE: ``prctl(PR_SVE_GET_VL)``, else ``/proc/sys/abi/sve_default_vector_length``."""
    if (machine or platform.machine()).lower() not in ("aarch64", "arm64") or not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        vl = int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SVE_GET_VL, 0, 0, 0, 0))
        if vl > 0:
            return (vl & 0xFFFF) * 8
    except (OSError, AttributeError, ValueError):
        pass
    try:
        return int(Path("/proc/sys/abi/sve_default_vector_length").read_text().strip()) * 8
    except (OSError, ValueError):
        return None


def vec_isas(flags: set[str], machine: str, system: str = sys.platform, sve: int | None = None) -> list[str]:
    """The ISAs torch's ``valid_vec_isa_list()`` finds valid, best first, named as torch's ``str(isa)``."""
    machine = machine.lower()
    if system == "darwin":
        return ["asimd"] if machine in ("arm64", "aarch64") else []
    if not system.startswith(("linux", "win32")):
        return []
    if machine in ("x86_64", "amd64"):
        avx512 = _AVX512 <= flags and "fma" in flags
        vnni = avx512 and "avx512_vnni" in flags
        found = {"avx2": "avx2" in flags, "avx512": avx512, "avx512_vnni": vnni, "amx_tile": "amx_tile" in flags}
        order = ["avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2"]
        return [isa for isa in order if all(found[part] for part in isa.split())]
    if machine in ("aarch64", "arm64"):
        if {"sve", "sve2"} & flags and "bf16" in flags:
            return ["sve128" if sve == 128 else "sve256"]
        return ["asimd"]
    if machine == "ppc64le":
        return ["vsx"]
    if machine == "s390x":
        return ["zvector"] if "vxe" in flags else []
    return []


def picked_isa(flags: set[str], machine: str, capability: str | None = None, system: str = sys.platform,
               sve: int | None = None) -> str:
    """The vector ISA torch generates CPU code for (``pick_vec_isa()`` with ``cpp.simdlen`` unset, its default), as a
    key segment: ``amx``, ``avx512vnni``, ``avx512``, ``avx2``, ``sve256``, ``sve128``, ``neon``, ``vsx``, ``zvector``,
    or ``novec`` (scalar code: no valid ISA, or ``ATEN_CPU_CAPABILITY=default``)."""
    valid = vec_isas(flags, machine, system, sve)
    pick = valid[0] if valid else None
    if valid and capability in _CAPABILITY:
        wanted = _CAPABILITY[capability]
        if wanted is None:
            pick = None
        else:
            pick = next((isa for isa in valid if wanted in isa), valid[0])
    if pick is None:
        return "novec"
    return {"avx512 avx512_vnni amx_tile": "amx", "avx512 avx512_vnni": "avx512vnni", "asimd": "neon"}.get(pick, pick)


def compiler_identity(env: dict[str, str]) -> str:
    """The C++ compiler Inductor builds CPU kernels (and its vector-ISA checks) with: ``$CXX``, else ``g++``
    (``clang++`` on macOS), as the file name it resolves to (``x86_64-linux-gnu-g++-12``). A name that does not look
    harmless is hidden behind a digest."""
    cxx = env.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    found = shutil.which(cxx, path=env.get("PATH"))
    name = os.path.basename(os.path.realpath(found)) if found else "missing"
    return name if HARMLESS_VALUE.fullmatch(name) else hide("CXX", name)


def thread_count(physical_cores: int | None) -> int:
    """torch.get_num_threads() as torch will see it: OMP_NUM_THREADS, else the physical cores."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    if physical_cores:
        return physical_cores
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# The NVIDIA driver's directory of one ``<PCI bus id>/information`` file per GPU.
PROC_GPUS = Path("/proc/driver/nvidia/gpus")
# What nvidia-smi is asked: the model name alone, one line per GPU, as the proc files give it (``Model:``).
SMI_ARGS = ("--query-gpu=name", "--format=csv,noheader")


def gpu_names_from_proc(root: Path) -> list[str]:
    """The ``Model:`` line of each GPU's ``information`` file under ``root``, in PCI bus order."""
    names = []
    for info in sorted(root.glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
                    break
        except (OSError, UnicodeDecodeError):
            continue
    return names


def gpu_names_from_smi(stdout: str) -> list[str]:
    """The names in what ``nvidia-smi`` printed for :data:`SMI_ARGS`: one a line."""
    return [line.strip() for line in stdout.splitlines() if line.strip()]


def gpu_names(proc: Path | None = None) -> list[str]:
    """Names of the NVIDIA GPUs, the model alone (``NVIDIA H100 80GB HBM3``) whichever source answers: the
    driver's proc files (``proc``, else :data:`PROC_GPUS`), else ``nvidia-smi`` on ``PATH``; empty when none."""
    names = gpu_names_from_proc(PROC_GPUS if proc is None else proc)
    if names:
        return names
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        done = subprocess.run([smi, *SMI_ARGS], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return []
    # A failing nvidia-smi (no driver loaded, a mismatch) says so on stdout: those lines are no GPU's name.
    return gpu_names_from_smi(done.stdout) if done.returncode == 0 else []


def amd_gpu_archs(root: Path = Path("/sys/class/kfd/kfd/topology/nodes")) -> list[str]:
    """The AMD GPUs' architectures (``gfx942``), which torch (``gcnArchName``) and Triton's HIP backend key on,
    from the kernel driver's topology (CPU nodes report 0); empty when none."""
    archs = []
    for props in sorted(root.glob("*/properties"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
        try:
            fields = dict(line.split(None, 1) for line in props.read_text().splitlines() if " " in line)
            version = int(fields.get("gfx_target_version", "0"))
        except (OSError, ValueError):
            continue
        if version:
            major, minor, step = version // 10000, version // 100 % 100, version % 100
            archs.append(f"gfx{major}{minor:x}{step:x}")
    return archs


def visible_gpus(names: list[str], env: dict[str, str]) -> list[str]:
    """The GPUs this process sees, in CUDA's order: ``CUDA_VISIBLE_DEVICES`` as indices picks and orders them (on a
    host with several models, device 0 is the one listed first); any other form of it (UUIDs, MIG) keeps every
    name and, where the models differ, adds the setting itself as a digest."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not names:
        return names
    items = [item.strip() for item in visible.split(",")]
    picked: list[str] = []
    for item in items:
        if not item.isdigit() or int(item) >= len(names):
            break  # CUDA stops at the first invalid entry
        picked.append(names[int(item)])
    if picked and all(item.isdigit() for item in items):
        return picked
    if len(set(names)) > 1:
        return [*names, hide("CUDA_VISIBLE_DEVICES", visible)]
    return names


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
    machine = platform.machine()
    sve = sve_bits(machine)
    isa = picked_isa(flags, machine, env.get("ATEN_CPU_CAPABILITY"), sve=sve)
    gpus: list[str] = []
    if torch.cuda and env.get("CUDA_VISIBLE_DEVICES") != "":
        gpus = visible_gpus(gpu_names(), env)
    elif torch.hip and env.get("HIP_VISIBLE_DEVICES") != "" and env.get("CUDA_VISIBLE_DEVICES") != "":
        gpus = visible_gpus(amd_gpu_archs(), {"CUDA_VISIBLE_DEVICES": env["HIP_VISIBLE_DEVICES"]}
                            if "HIP_VISIBLE_DEVICES" in env else env)
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
        "cpu_features": sorted(flags & CODEGEN_FLAGS),
        "sve_bits": sve,
        "cxx": compiler_identity(env),
        "threads": threads,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "implementation": sys.implementation.name,
        "platform": f"{sys.platform}-{_slug(platform.machine())}",
        # Every compiler setting by name; its value only when known harmless (envpolicy), else a digest.
        "env": {k: fingerprint_value(k, v) for k, v in sorted(env.items())
                if keyed(k)},
    }
    return Fingerprint(parts)
