"""The workloads: the test suites a benchmark runs in every mode, from the example project or generated into a
scratch directory, and the check that child processes can report their compiles."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from varied import make_varied_project  # benchmarks/varied.py, on the path the package sets

from . import ROOT

EXAMPLE = ROOT / "example_project"
CHILD_PTH = "pytest_megacache_children.pth"  # installed with the package: child processes report their counters


@dataclass
class Workload:
    name: str
    cwd: Path
    args: list[str]  # pytest arguments selecting the tests
    ini: Path  # the workload's ini file (the idle run uses it so prefix and layout match)
    device: str
    # The pytest process compiles nothing: the compiles happen in child processes, whose own records (the report's
    # torch.children) give the counters and compile seconds.
    children: bool = False


# Pointwise ops that Inductor fuses into one kernel; each function picks a chain and bakes its own
# constants into the graph, so every function has its own FX graph key and its own compiled kernel.
_OPS = ("torch.sin({})", "torch.cos({})", "torch.tanh({})", "torch.sigmoid({})", "torch.relu({})",
        "torch.abs({})", "torch.erf({})", "torch.neg({})")


def synthetic_source(n: int, device: str) -> str:
    out = ["import torch", "", f"DEVICE = {device!r}", ""]
    for i in range(n):
        a, b, c = _OPS[i % len(_OPS)], _OPS[(i // len(_OPS) + 3) % len(_OPS)], _OPS[(i * 5 + 1) % len(_OPS)]
        k1, k2, k3 = 1 + (i + 1) / 1000, 0.25 + i / 997, 0.5 + i / 991
        out += ["", f"def f_{i}(x):",
                f"    y = {a.format(f'x * {k1!r}')} + {k2!r}",
                f"    y = {b.format('y')} * {k3!r}"]
        if i % 2:
            out.append(f"    y = {c.format('y')} - {k2!r}")
        out += ["    return y", "", "",
                f"def test_f_{i}():",
                f"    torch.manual_seed({i})",
                "    x = torch.randn(1024, device=DEVICE)",
                f"    torch.testing.assert_close(torch.compile(f_{i})(x), f_{i}(x), atol=1e-4, rtol=1e-4)", ""]
    return "\n".join(out) + "\n"


def make_synthetic(base: Path, n: int, device: str) -> Workload:
    project = base / f"synthetic-{n}"
    project.mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    ignore:Failed to initialize NumPy:UserWarning\n")
    source = synthetic_source(n, device)
    compile(source, "test_synthetic.py", "exec")  # a generator bug fails here, loudly
    (project / "test_synthetic.py").write_text(source)
    return Workload(f"synthetic-{n}", project, ["test_synthetic.py"], project / "pytest.ini", device)


def make_varied(base: Path, n: int, device: str) -> Workload:
    """``n`` small compiled functions of varied kinds (benchmarks/varied.py): a suite with many small graphs."""
    project, args, ini = make_varied_project(base, n, device)
    return Workload(f"varied-{n}", project, args, ini, device)


def make_example(device: str) -> Workload:
    marker = "gpu" if device == "cuda" else "not gpu"
    return Workload("example", EXAMPLE, ["tests", "-m", marker], EXAMPLE / "pyproject.toml", device)


def make_mixed(device: str) -> Workload:
    """The example project's CPU and GPU tests in one session (on ``cuda``; on ``cpu`` the GPU tests skip), without
    the 2-rank distributed test, whose wall is process start-up: a suite that compiles for both devices."""
    return Workload("mixed", EXAMPLE, ["tests", "-k", "not distributed"], EXAMPLE / "pyproject.toml", device)


def make_ranks(device: str) -> Workload:
    """The example project's 2-rank DDP + torch.compile test, the ranks started by ``torch.multiprocessing.spawn``
    and by ``torchrun``: NCCL when two GPUs are present, gloo on the CPU otherwise (the test decides)."""
    return Workload("ranks", EXAMPLE, ["tests/test_distributed.py"], EXAMPLE / "pyproject.toml", device, children=True)


# A child process's compile: an MLP training step (forward and backward) under torch.compile, checked against eager.
CHILD_SCRIPT = """\
import sys

import torch

device = torch.device(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                            torch.nn.Linear(512, 64)).to(device)
x = torch.randn(32, 256, device=device)


def step(x):
    loss = model(x).square().mean()
    loss.backward()
    return loss


expected = step(x).detach()
model.zero_grad()
torch.testing.assert_close(torch.compile(step)(x).detach(), expected, atol=1e-4, rtol=1e-4)
"""

CHILD_TEST = """\
import subprocess
import sys
from pathlib import Path

import torch  # the pytest process imports torch (the restore starts at collection) but compiles nothing

DEVICE = {device!r}


def test_a_training_step_compiled_in_a_child_process():
    assert DEVICE == "cpu" or torch.cuda.is_available()
    subprocess.run([sys.executable, str(Path(__file__).with_name("child_step.py")), DEVICE], check=True, timeout=900)
"""


def make_children(base: Path, device: str) -> Workload:
    """A test whose only compile runs in a child Python process (``subprocess``): a training step on ``device``."""
    project = base / "children"
    project.mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    ignore:Failed to initialize NumPy:UserWarning\n")
    (project / "child_step.py").write_text(CHILD_SCRIPT)
    (project / "test_children.py").write_text(CHILD_TEST.format(device=device))
    return Workload("children", project, ["test_children.py"], project / "pytest.ini", device, children=True)


def child_records_installed() -> bool:
    """Whether this interpreter's site-packages hold the package's ``.pth`` (child processes report their counters)."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(Path(d, CHILD_PTH).is_file() for d in dirs)
