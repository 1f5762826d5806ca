"""pytest-megacache benchmark: cold, warm, hot and naive runs side by side, in one command.

    python benchmarks/run.py [--workload example mixed synthetic varied children ranks] [--n 10 50 200]
                             [--repeats 3] [--device cpu|cuda] [--xdist N] [--out DIR] [--plot]

Every figure is measured in this run; nothing is a constant. Each run is a fresh ``python -m pytest``
process with its own fresh TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and TMPDIR unless its mode says
otherwise:

- plain: empty caches, the plugin not loaded (``-p no:megacache``): the baseline a cold run is held to.
- cold:  empty caches; the plugin uploads to an S3 server (moto, on 127.0.0.1, in this process) into a
         fresh bucket per repeat.
- warm:  empty caches; the plugin restores from that bucket (what a fresh CI runner sees).
- hot:   the cold run's cache directories and TMPDIR still in place; the plugin in read mode on an empty
         directory store, so it restores nothing and only records compile time and counters: the floor.
- naive: the cold run's TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR packed as tar + zstd (level 3, as an
         actions/cache step would), unpacked into fresh directories; the plugin in read mode on an empty
         store, only to record compile time.
- warm-auto / warm-keep: the warm run with ``--megacache-compile-threads auto`` / ``keep`` (only when the
         installed plugin has that option).
- cold-xdist / warm-xdist (``--xdist N``): cold and warm again with ``pytest -n N`` (pytest-xdist), into and
         from a bucket of their own: the controller restores once for all workers, so the warm run's bytes
         fetched should equal what the bucket holds (one download), not N times it.
- warm-isa-off (``--isa-pair``): the warm run with ``--megacache-reuse-isa-check no``, every process running
         torch's CPU vector-ISA load checks itself, as without the plugin.

Workloads: ``example`` (example_project's CPU tests, or its GPU tests with ``--device cuda``), ``mixed`` (its CPU
and GPU tests in one session), ``synthetic`` (N generated pointwise functions), ``varied`` (N small functions of 13
kinds), ``children`` (a test whose only compile, a training step, runs in a child Python process) and ``ranks``
(example_project's 2-rank DDP test, ranks started by ``torch.multiprocessing.spawn`` and by ``torchrun``; NCCL on
two GPUs, else gloo on the CPU). In ``children`` and ``ranks`` the pytest process compiles nothing: their counters
and compile seconds are the child processes' own records (the report's ``torch.children``), which need the package
installed (its ``.pth`` file in site-packages).

Also measured: the idle cost (a one-test session that compiles nothing, with the plugin vs
``-p no:megacache``), ``import torch``, ``import torch._dynamo`` and torch's CPU vector-ISA check each in a fresh
process (apart), and the restore time of the same entries stored as 1 object vs 8 objects.

Writes ``DIR/results.json`` (every raw record) and ``DIR/results.md`` (the tables); ``--plot`` adds
``DIR/compile_seconds.png``. As it goes, each finished run is appended to ``DIR/runs.jsonl`` (what a run cut off
by a time limit leaves). Exits 1 if any pytest run failed (its output tail is printed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "example_project"
sys.path.insert(0, str(ROOT))  # pytest_megacache from this checkout, for the objects check
sys.path.insert(0, str(ROOT / "demo"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # varied.py, also when this file is imported by path (the tests)
from local_s3 import LocalS3, clean_env  # the S3 server the demo and the tests use too  # noqa: E402
from varied import make_varied_project  # benchmarks/varied.py, beside this script  # noqa: E402

from pytest_megacache.stats import PHASES  # noqa: E402 - the plugin's phases, from this checkout

THREADS_FLAG = "--megacache-compile-threads"
ISA_FLAG = "--megacache-reuse-isa-check"
CHILD_PTH = "pytest_megacache_children.pth"  # installed with the package: child processes report their counters
NAIVE_ZSTD_LEVEL = 3
TAIL_CHARS = 4000
# The example project's conftest logs each Triton compile in its processes to this file when the variable is set
# (a listener that only observes); other workloads ignore it.
TRITON_EVENTS_ENV = "EXAMPLE_TRITON_EVENTS"
TRITON_EVENTS_FILE = "triton-events.jsonl"

# Targets: (ratio name, bound, comparison); the warm/cold bound depends on the device.
WARM_COLD_TARGET = {"cuda": 0.05, "cpu": 0.2}
WARM_HOT_TARGET = 1.10
# A cold run with the plugin against plain pytest on the same machine (the plugin must not slow a cold run).
COLD_PLAIN_TARGET = 1.05
WARM_COLD_WALL_TARGET = 0.20  # GPU only; on CPU the session wall has no target
MOVED_RAW_TARGET = 0.15
XDIST_WARM_TARGET = 1.0  # a warm -n N run against a warm serial one (session wall)
# One color per phase of the plugin's per-process times (pytest_megacache.stats.PHASES), and the exit, measured
# from outside.
PHASE_COLORS = {"startup": "#95a5a6", "collect": "#bdc3c7", "imports": "#7f8c8d", "restore_wait": "#e67e22",
                "load": "#f39c12", "dynamo": "#8e44ad", "backend": "#c0392b", "isa_check": "#f1948a", "backward": "#e74c3c",
                "compile_other": "#d35400", "tests": "#27ae60", "finish": "#2980b9", "exit": "#34495e"}
IDLE_TARGET_MS = 100.0
MODE_COLORS = {"plain": "#7f8c8d",
               "cold": "#c0392b", "warm": "#27ae60", "warm-auto": "#16a085", "warm-keep": "#1abc9c", "hot": "#2980b9",
               "naive": "#8e44ad", "cold-xdist": "#e67e22", "warm-xdist": "#f1c40f",
               "warm-isa-off": "#d98880"}  # one color per mode


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# --- the S3 server ---------------------------------------------------------------------------------
class S3(LocalS3):
    """The demo's S3 server (demo/local_s3.py), with a clear message when moto is missing."""

    def __init__(self) -> None:
        try:
            super().__init__()
        except ImportError:
            sys.exit("benchmarks/run.py needs moto's server: pip install -r benchmarks/requirements.txt")


# --- workloads -------------------------------------------------------------------------------------
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


# --- running pytest --------------------------------------------------------------------------------
def plugin_args() -> tuple[list[str], list[str], bool]:
    """(args loading the plugin, args removing it, installed?): the entry point, else ``-p`` from this checkout."""
    installed = any(ep.name == "megacache" for ep in importlib.metadata.entry_points(group="pytest11"))
    if installed:
        return [], ["-p", "no:megacache"], True
    return ["-p", "pytest_megacache.plugin"], [], False


def base_env(s3: S3) -> dict[str, str]:
    env = clean_env()  # settings of the calling shell that would change what is measured are dropped
    env.update(s3.env(no_aws_files=os.devnull))
    # The local server takes any credentials. Random ones: the plugin refuses to store a compiled entry that holds
    # a credential's value, and a word such as "testing" is also in the tests' own code (torch.testing).
    env.update(AWS_ACCESS_KEY_ID="bench" + secrets.token_hex(8), AWS_SECRET_ACCESS_KEY=secrets.token_hex(20))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class Dirs:
    inductor: Path
    triton: Path
    tmp: Path

    @classmethod
    def fresh(cls, root: Path) -> Dirs:
        dirs = cls(root / "inductor-cache", root / "triton-cache", root / "tmp")
        for path in (dirs.inductor, dirs.triton, dirs.tmp):
            path.mkdir(parents=True)
        return dirs


@dataclass
class Run:
    """One pytest process and what it measured."""

    workload: str
    mode: str
    repeat: int
    ok: bool = False
    error: str | None = None
    returncode: int | None = None
    wall: float | None = None
    compile_seconds: float | None = None
    compiles: int | None = None
    fx_hit: int | None = None
    fx_miss: int | None = None
    aot_hit: int | None = None
    aot_miss: int | None = None
    upload_bytes: int | None = None
    upload_raw_bytes: int | None = None
    bytes_moved: int | None = None
    restore_seconds: float | None = None
    objects_used: int | None = None
    compile_threads: str | None = None
    single_thread: bool | None = None  # whether the plugin chose one compile thread (auto policy engaged)
    problems: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    log: str | None = None
    # where each process's seconds went (the report's "processes": the session's own, then xdist workers'),
    # and the session process's exit (interpreter shutdown, Inductor's pool): wall minus what its report covers
    processes: list[dict[str, Any]] = field(default_factory=list)
    exit_seconds: float | None = None
    # Triton compiles in the pytest process, from the example project's listener (EXAMPLE_TRITON_EVENTS):
    # kernels built (cache miss) and kernels Triton found in its cache; None where the workload has no listener
    triton_built: int | None = None
    triton_hits: int | None = None
    # child processes that reported their own counters (the report's torch.children); for a workload whose compiles
    # happen in children, the counters and compile seconds above are theirs, summed
    children: int | None = None


class Runner:
    def __init__(self, s3: S3, timeout: float, log_dir: Path) -> None:
        self.s3 = s3
        self.timeout = timeout
        self.log_dir = log_dir  # failed runs' logs are copied here (the scratch directory goes away)
        # Every finished run is appended here as one JSON line, so that a benchmark cut off by a time limit still
        # leaves what it measured (results.json is written only at the end).
        self.progress_file: Path | None = None
        self.load_args, self.unload_args, self.installed = plugin_args()
        self.env = base_env(s3)

    def progress(self, r: Run) -> None:
        if self.progress_file is not None:
            with open(self.progress_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(r.__dict__, default=str) + "\n")

    def pytest(self, cwd: Path, args: list[str], dirs: Dirs, log: Path) -> tuple[int, float, str]:
        env = {**self.env, "TORCHINDUCTOR_CACHE_DIR": str(dirs.inductor), "TRITON_CACHE_DIR": str(dirs.triton),
               "TMPDIR": str(dirs.tmp), TRITON_EVENTS_ENV: str(log.parent / TRITON_EVENTS_FILE)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as fh:
            fh.write(("$ " + " ".join(cmd) + "\n").encode())
            fh.flush()
            start = time.perf_counter()
            try:
                rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -1
            wall = time.perf_counter() - start
        text = log.read_text(errors="replace")
        if rc == -1:
            text += f"\n[bench] killed after the {self.timeout:g} s timeout\n"
        return rc, wall, text

    def run(self, wl: Workload, mode: str, repeat: int, root: Path, *, dirs: Dirs | None = None,
            bucket: str | None = None, store_dir: Path | None = None, read_only: bool = False,
            extra: Iterable[str] = ()) -> Run:
        dirs = dirs or Dirs.fresh(root)
        report = root / "megacache-report.json"
        args = [*wl.args, *self.load_args, "--megacache-report", str(report)]
        if bucket:
            args += ["--megacache-bucket", bucket]
        if store_dir:
            store_dir.mkdir(parents=True, exist_ok=True)
            args += ["--megacache-dir", str(store_dir)]
        if read_only:
            args += ["--megacache-mode", "read"]
        args += list(extra)
        rc, wall, text = self.pytest(wl.cwd, args, dirs, root / "pytest.log")
        r = Run(wl.name, mode, repeat, returncode=rc, wall=wall, log=str(root / "pytest.log"))
        r.triton_built, r.triton_hits = triton_events(root / TRITON_EVENTS_FILE)
        doc = _load_json(report)
        if doc is not None:
            _fill_from_report(r, doc, from_children=wl.children)
        r.error = _failure(rc, doc, wl, mode)
        r.ok = r.error is None
        if not r.ok:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            kept = self.log_dir / f"{wl.name}-{mode}-r{repeat + 1}.log"
            shutil.copyfile(root / "pytest.log", kept)
            r.log = str(kept)
            say(f"FAILED {wl.name} {mode} (repeat {repeat + 1}): {r.error}; log kept at {kept}")
            say(f"--- last {TAIL_CHARS} characters of {r.log} ---")
            print(text[-TAIL_CHARS:], flush=True)
            say("--- end of tail ---")
        return r


    def plain(self, wl: Workload, repeat: int, root: Path) -> Run:
        """The workload without the plugin at all (``-p no:megacache``, or simply not loaded): the baseline
        that a cold run with the plugin is held to."""
        dirs = Dirs.fresh(root)
        rc, wall, text = self.pytest(wl.cwd, [*wl.args, *self.unload_args], dirs, root / "pytest.log")
        r = Run(wl.name, "plain", repeat, returncode=rc, wall=wall, log=str(root / "pytest.log"))
        r.ok = rc == 0
        if not r.ok:
            r.error = f"pytest exited {rc}"
            say(f"FAILED {wl.name} plain (repeat {repeat + 1}): {r.error}")
            print(text[-TAIL_CHARS:], flush=True)
        return r


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _get(doc: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def _fill_from_report(r: Run, doc: dict[str, Any], from_children: bool = False) -> None:
    counters = _get(doc, "torch", "counters") or {}
    r.compile_seconds = _get(doc, "torch", "compile_seconds")
    r.compiles = _get(doc, "torch", "compiles")
    children = [c for c in _get(doc, "torch", "children") or [] if isinstance(c, dict)]
    r.children = len(children)
    if from_children:  # the pytest process compiled nothing: the children's own records
        counters = {}
        for child in children:
            for name, n in (child.get("counters") or {}).items():
                counters[name] = counters.get(name, 0) + int(n)
        r.compile_seconds = sum(float(c.get("compile_seconds") or 0.0) for c in children)
        r.compiles = sum(int(c.get("compiles") or 0) for c in children)
    r.fx_hit, r.fx_miss = counters.get("fxgraph_cache_hit", 0), counters.get("fxgraph_cache_miss", 0)
    r.aot_hit, r.aot_miss = counters.get("autograd_cache_hit", 0), counters.get("autograd_cache_miss", 0)
    r.upload_bytes, r.upload_raw_bytes = _get(doc, "upload", "bytes"), _get(doc, "upload", "raw_bytes")
    r.bytes_moved = _get(doc, "restore", "bytes_fetched")
    r.restore_seconds = _get(doc, "restore", "seconds")
    r.objects_used = _get(doc, "restore", "objects_used")
    r.compile_threads = _get(doc, "settings", "compile_threads")
    r.single_thread = _get(doc, "torch", "single_compile_thread")
    r.problems = list(doc.get("problems") or [])
    r.processes = [p for p in doc.get("processes") or [] if isinstance(p, dict)]
    main = r.processes[0] if r.processes else {}
    if r.wall is not None and main.get("startup") is not None and isinstance(main.get("total"), (int, float)):
        r.exit_seconds = max(0.0, r.wall - float(main["total"]))


def _failure(rc: int, doc: dict[str, Any] | None, wl: Workload, mode: str) -> str | None:
    if rc != 0:
        return "timed out" if rc == -1 else f"pytest exited {rc}"
    if doc is None:
        return "no megacache report was written (is the plugin loaded?)"
    if not doc.get("enabled"):
        return f"the plugin was not active: {doc.get('reason')}"
    if doc.get("problems"):
        return "the plugin reported problems: " + "; ".join(str(p) for p in doc["problems"])[:600]
    if wl.children:
        if not _get(doc, "torch", "children"):
            return ("no child process reported a compile (is the package installed, with its "
                    f"{CHILD_PTH} in site-packages?)")
    elif not _get(doc, "torch", "compiled"):
        return f"nothing was compiled (are the {wl.device} tests all skipped?)"
    if mode == "cold" and not _get(doc, "upload", "objects"):
        return f"the cold run uploaded nothing: {_get(doc, 'upload', 'reason')}"
    return None


def has_threads_option(runner: Runner, wl: Workload, scratch: Path) -> bool:
    dirs = Dirs.fresh(scratch / "help")
    rc, _, text = runner.pytest(wl.cwd, [*runner.load_args, "--help"], dirs, scratch / "help" / "pytest.log")
    if rc != 0:
        say(f"note: `pytest --help` exited {rc}; assuming no {THREADS_FLAG}")
    return THREADS_FLAG in text


# --- naive: tar + zstd of the cache directories ----------------------------------------------------
class _Counting:
    """A write-only file object that counts what goes through it (the tar stream's raw size)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.count = inner, 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        pass


def naive_pack(dirs: Dirs, archive: Path) -> dict[str, Any]:
    import zstandard

    start = time.perf_counter()
    with open(archive, "wb") as fh:
        with zstandard.ZstdCompressor(level=NAIVE_ZSTD_LEVEL).stream_writer(fh, closefd=False) as zw:
            counting = _Counting(zw)
            with tarfile.open(fileobj=counting, mode="w|") as tar:  # type: ignore[call-overload]
                tar.add(dirs.inductor, arcname="inductor")
                tar.add(dirs.triton, arcname="triton")
    seconds = time.perf_counter() - start
    return {"pack_seconds": seconds, "tar_bytes": counting.count, "tar_zst_bytes": archive.stat().st_size}


def naive_unpack(archive: Path, dest: Path) -> tuple[Dirs, float]:
    import zstandard

    dest.mkdir(parents=True)
    start = time.perf_counter()
    with open(archive, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh) as zr:
        with tarfile.open(fileobj=zr, mode="r|") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # pragma: no cover - Python without the extraction filters
                tar.extractall(dest)
    seconds = time.perf_counter() - start
    dirs = Dirs(dest / "inductor", dest / "triton", dest / "tmp")
    dirs.tmp.mkdir()
    return dirs, seconds


# --- one workload, every mode ----------------------------------------------------------------------
def bucket_bytes(s3: S3, bucket: str) -> tuple[int, int]:
    """(objects, bytes) of the cache objects a bucket holds."""
    sizes = [size for key, size in s3.objects(bucket) if key.endswith(".mcb")]
    return len(sizes), sum(sizes)


def bench_xdist(runner: Runner, wl: Workload, rep: int, base: Path, workers: int,
                serial_bucket: str | None = None) -> list[Run]:
    """cold then warm with ``-n workers``, into and from a bucket of their own; with ``serial_bucket`` (cold-xdist
    skipped), only warm, from the bucket the serial cold and warm runs filled."""
    args = ["-n", str(workers)]
    runs: list[Run] = []
    if serial_bucket is None:
        bucket = runner.s3.create_bucket(f"bench-{wl.name.lower()}-r{rep}-x{workers}-{os.getpid()}")
        cold = runner.run(wl, "cold-xdist", rep, base / "cold-xdist", bucket=bucket, extra=args)
        if not cold.ok:
            return [cold, Run(wl.name, "warm-xdist", rep, error="not run: the cold-xdist run failed")]
        runs.append(cold)
    else:
        bucket = serial_bucket
    objects, stored = bucket_bytes(runner.s3, bucket)
    if runs:
        runs[0].extra = {"bucket_objects": objects, "bucket_bytes": stored}
    warm = runner.run(wl, "warm-xdist", rep, base / "warm-xdist", bucket=bucket, extra=args)
    # Bytes fetched over bytes stored: 1.0 when the controller downloaded each object once for all workers.
    warm.extra = {"bucket_objects": objects, "bucket_bytes": stored,
                  "downloads": warm.bytes_moved / stored if warm.bytes_moved is not None and stored else None}
    return [*runs, warm]


# Modes a time-limited run may leave out (plain, cold and warm make the main ratios). Without cold-xdist, warm-xdist
# restores from the serial runs' bucket (what the serial cold run uploaded, and anything the serial warm run added).
SKIPPABLE = ("hot", "naive", "cold-xdist")


def bench_workload(runner: Runner, wl: Workload, repeats: int, work: Path, threads: bool,
                   xdist: int = 0, skip: Iterable[str] = (), isa_pair: bool = False) -> tuple[list[Run], str | None]:
    """Every mode (less those in ``skip``: SKIPPABLE), repeat by repeat; returns the runs and a bucket the cold
    run filled (for idle and objects)."""
    runs: list[Run] = []
    populated: str | None = None
    skipped = frozenset(skip)
    modes = ["cold", "warm", *(["warm-auto", "warm-keep"] if threads else []), *(["warm-isa-off"] if isa_pair else []),
             *(m for m in ("hot", "naive") if m not in skipped),
             *(m for m in ("cold-xdist", "warm-xdist") if xdist and m not in skipped)]

    def record(r: Run) -> Run:
        runs.append(r)
        runner.progress(r)
        if r.ok:
            say(f"  {r.mode}: wall {r.wall:.1f} s, compile {r.compile_seconds:.2f} s, FX {r.fx_hit}/{r.fx_miss} "
                f"hit/miss, AOT {r.aot_hit}/{r.aot_miss}, moved {human_bytes(r.bytes_moved)}"
                + (f", Triton built {r.triton_built} / cached {r.triton_hits}" if r.triton_built is not None else ""))
        return r

    for rep in range(repeats):
        base = work / wl.name / f"r{rep}"
        bucket = runner.s3.create_bucket(f"bench-{wl.name.lower()}-r{rep}-{os.getpid()}")
        say(f"{wl.name}: repeat {rep + 1}/{repeats}: plain, {', '.join(modes)}")
        plain = runner.plain(wl, rep, base / "plain")
        runs.append(plain)
        runner.progress(plain)
        if plain.ok:
            say(f"  plain (no plugin): wall {plain.wall:.1f} s")
        cold = record(runner.run(wl, "cold", rep, base / "cold", bucket=bucket))
        if not cold.ok:
            runs.extend(Run(wl.name, mode, rep, error="not run: the cold run failed") for mode in modes[1:])
            continue
        populated = populated or bucket
        cold_dirs = Dirs(base / "cold" / "inductor-cache", base / "cold" / "triton-cache", base / "cold" / "tmp")
        archive = base / "naive-cache.tar.zst"
        if "naive" not in skipped:
            pack = naive_pack(cold_dirs, archive)  # before anything else runs in the cold run's directories
        record(runner.run(wl, "warm", rep, base / "warm", bucket=bucket))
        if threads:
            for value in ("auto", "keep"):
                record(runner.run(wl, f"warm-{value}", rep, base / f"warm-{value}", bucket=bucket,
                                  extra=[THREADS_FLAG, value]))
        if isa_pair:  # the same restore, every process running torch's vector-ISA load checks itself
            record(runner.run(wl, "warm-isa-off", rep, base / "warm-isa-off", bucket=bucket, extra=[ISA_FLAG, "no"]))
        if "hot" not in skipped:
            record(runner.run(wl, "hot", rep, base / "hot", dirs=cold_dirs, store_dir=base / "empty-store-hot",
                              read_only=True))
        if "naive" not in skipped:
            naive_dirs, unpack_seconds = naive_unpack(archive, base / "naive")
            naive = runner.run(wl, "naive", rep, base / "naive-run", dirs=naive_dirs,
                               store_dir=base / "empty-store-naive", read_only=True)
            naive.extra = {**pack, "unpack_seconds": unpack_seconds}
            naive.bytes_moved = pack["tar_zst_bytes"]
            naive.restore_seconds = pack["pack_seconds"] + unpack_seconds
            record(naive)
        if xdist:
            for r in bench_xdist(runner, wl, rep, base, xdist, bucket if "cold-xdist" in skipped else None):
                record(r)
    return runs, populated


# --- per-process costs no cache entry covers, measured apart ---------------------------------------------
ISA_CHECK = "CPU vector-ISA check (valid_vec_isa_list)"
APART = {
    "import torch": "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)",
    "import torch._dynamo (torch already imported)":
        "import time, torch; t = time.perf_counter(); import torch._dynamo; print(time.perf_counter() - t)",
    ISA_CHECK: "import time, torch._inductor.cpu_vec_isa as m; t = time.perf_counter(); "
               "m.valid_vec_isa_list(); print(time.perf_counter() - t)",
    # With the plugin's reuse of torch's load check (pytest_megacache/isaprobe.py): the first process records each
    # check, the second takes them from the records.
    ISA_CHECK + ", the plugin's reuse": "import time, torch._inductor.cpu_vec_isa as m; "
                                        "from pytest_megacache import isaprobe; isaprobe.install(m); "
                                        "t = time.perf_counter(); m.valid_vec_isa_list(); "
                                        "print(time.perf_counter() - t)",
}


def bench_apart(runner: Runner, work: Path, repeats: int) -> list[dict[str, Any]]:
    """Each snippet in a fresh process (the benchmark's clean environment), ``repeats`` times: the vector-ISA check
    once in an empty cache directory (what a cold run pays) and once in the directory the first one filled (what a
    run pays whose restore brought the check's libraries)."""
    rows = []
    for name, code in APART.items():
        variants = ([("fresh cache dir", True), ("its libraries present", False)] if name == ISA_CHECK
                    else [("fresh cache dir: records written", True), ("libraries and records present", False)]
                    if name.startswith(ISA_CHECK) else [("", True)])
        for label, fresh in variants:
            seconds = []
            for i in range(repeats):
                root = work / "apart" / f"{len(rows)}-{i}"
                dirs = Dirs.fresh(root)
                if not fresh:
                    prev = work / "apart" / f"{len(rows) - 1}-{i}"
                    dirs = Dirs(prev / "inductor-cache", prev / "triton-cache", dirs.tmp)
                env = {**runner.env, "TORCHINDUCTOR_CACHE_DIR": str(dirs.inductor), "TRITON_CACHE_DIR": str(dirs.triton),
                       "TMPDIR": str(dirs.tmp)}
                proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      timeout=runner.timeout)
                try:
                    seconds.append(float(proc.stdout.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    say(f"apart: {name} failed: {proc.stderr.strip()[-300:]}")
            rows.append({"what": name + (f" ({label})" if label else ""), "seconds": seconds,
                         "median": statistics.median(seconds) if seconds else None})
            say(f"  {rows[-1]['what']}: " + ", ".join(f"{x:.2f} s" for x in seconds))  # as it goes: a slow host
    return rows


def apart_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### per-process costs measured apart (each a fresh process)", "",
             "| what | median s | runs |", "| --- | --- | --- |"]
    for r in rows:
        med = "n/a" if r["median"] is None else f"{r['median']:.2f}"
        lines.append(f"| {r['what']} | {med} | {', '.join(f'{x:.2f}' for x in r['seconds'])} |")
    return [*lines, ""]


# --- idle: the plugin's cost when nothing compiles --------------------------------------------------
IDLE_TEST = "def test_idle():\n    assert True\n"


def bench_idle(runner: Runner, work: Path, repeats: int, wl: Workload | None, populated: str | None) -> dict[str, Any]:
    project = work / "idle"
    project.mkdir(parents=True)
    (project / "test_idle.py").write_text(IDLE_TEST)
    empty_bucket = runner.s3.create_bucket(f"bench-idle-empty-{os.getpid()}")
    # Run from the workload's directory with its ini file, so the prefix (and any layout the plugin derives
    # from the project) matches what the populated bucket holds.
    cwd = wl.cwd if wl else project
    ini = ["-c", str(wl.ini), "--rootdir", str(wl.cwd)] if wl else []
    variants: list[tuple[str, list[str]]] = [
        ("no plugin (-p no:megacache)", runner.unload_args),
        # The directory store never imports boto3: the difference to the S3 row is the S3 client's cost.
        ("plugin, empty directory store", [*runner.load_args, "--megacache-dir", str(project / "empty-store")]),
        ("plugin, empty S3 bucket", [*runner.load_args, "--megacache-bucket", empty_bucket]),
    ]
    if populated:
        variants.append((f"plugin, S3 bucket with {wl.name if wl else '?'}'s cache",
                         [*runner.load_args, "--megacache-bucket", populated]))
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    restored: dict[str, list[int]] = {name: [] for name, _ in variants}
    failures: list[str] = []
    for i in range(repeats):
        for j, (name, args) in enumerate(variants):
            root = project / f"r{i}-v{j}"
            report = root / "megacache-report.json"
            plugged = "--megacache-bucket" in args or "--megacache-dir" in args
            extra = ["--megacache-report", str(report)] if plugged else []
            dirs = Dirs.fresh(root)
            rc, wall, text = runner.pytest(cwd, [*ini, str(project / "test_idle.py"), *args, *extra], dirs, root / "pytest.log")
            doc = _load_json(report) if extra else None
            error = None
            if rc != 0:
                error = f"pytest exited {rc}"
            elif extra and (doc is None or not doc.get("enabled") or doc.get("problems")):
                error = f"plugin not active or reported problems: {doc and (doc.get('reason') or doc.get('problems'))}"
            if error:
                first = not any(fl.startswith(f"{name},") for fl in failures)
                failures.append(f"{name}, repeat {i + 1}: {error}")
                say(f"FAILED idle {name} (repeat {i + 1}): {error}")
                if first:  # the same failure again and again: one tail is enough
                    print(text[-TAIL_CHARS:], flush=True)
                continue
            samples[name].append(wall)
            if doc is not None:
                restored[name].append(int(_get(doc, "restore", "objects_used") or 0))
    out: dict[str, Any] = {"repeats": repeats, "variants": {}, "failures": failures}
    base = samples[variants[0][0]]
    for name, _ in variants:
        walls = samples[name]
        entry: dict[str, Any] = {"walls": walls, "objects_restored": restored[name]}
        if walls:
            entry["median"] = statistics.median(walls)
            if base and name != variants[0][0]:
                entry["cost_ms"] = 1000 * (entry["median"] - statistics.median(base))
        out["variants"][name] = entry
    return out


# --- restore time vs number of objects --------------------------------------------------------------
def _synthetic_entries(count: int = 128, size: int = 128 * 1024) -> Any:
    from pytest_megacache.bundle import Entries, Entry

    entries = Entries()
    for i in range(count):
        # Half random, half repetitive: compresses roughly like compiled kernels do. Named as kernel sources
        # (.cpp travel too): random bytes named .so would be refused as cut-short ELF files, as they should.
        data = os.urandom(size // 2) + bytes(range(256)) * (size // 512)
        entries.add(Entry("file/inductor", f"bench{i % 16:02d}/kernel_{i:04d}.cpp", data, 0o644))
    return entries


def _bucket_entries(s3: S3, bucket: str) -> Any:
    from pytest_megacache import bundle
    from pytest_megacache.bundle import Entries
    from pytest_megacache.stores import S3Store

    store = S3Store(bucket, s3.client())
    merged = Entries()
    for folder, info in store.walk(_top_prefix(s3, bucket)):
        blob = store.get(folder, info.name, 1 << 31)
        if blob is not None:
            merged.update(bundle.decode(blob)[1])
    return merged


def _top_prefix(s3: S3, bucket: str) -> str:
    keys = s3.keys(bucket)
    if not keys:
        raise RuntimeError(f"bucket {bucket} is empty")
    return str(keys[0].split("/", 1)[0])


def restore_once(store: Any, folder: str, fingerprint: str, dest: Path) -> tuple[float, int, int]:
    """The plugin's own restore (pytest_megacache.core): list, fetch in parallel, validate, merge, write the
    files. Returns (seconds, objects, entries)."""
    from pytest_megacache.core import CacheSession
    from pytest_megacache.files import FileRoot

    start = time.perf_counter()
    session = CacheSession(store_factory=lambda: store, folder=folder, fingerprint=fingerprint,
                           roots=[FileRoot("inductor", dest)], reads=True, writes=False)
    session.start_restore(background=False)
    if not session.restore_stats.ok or session.problems:
        raise RuntimeError(f"restore failed: {'; '.join(session.problems)}")
    return time.perf_counter() - start, session.restore_stats.objects_used, len(session.restored)


def bench_objects(s3: S3, work: Path, repeats: int, populated: str | None, wl_name: str | None) -> list[dict[str, Any]]:
    from pytest_megacache import bundle
    from pytest_megacache.bundle import Entries
    from pytest_megacache.stores import S3Store

    datasets: list[tuple[str, Any]] = []
    if populated:
        try:
            datasets.append((f"{wl_name} bundle", _bucket_entries(s3, populated)))
        except Exception as exc:  # noqa: BLE001 - reported, the synthetic dataset still runs
            say(f"note: could not read the {wl_name} bundle back for the objects check: {exc}")
    datasets.append(("synthetic 128 x 128 KB files", _synthetic_entries()))
    bucket = s3.create_bucket(f"bench-objects-{os.getpid()}")
    store = S3Store(bucket, s3.client())
    fingerprint = "bench-objects-check"
    rows = []
    for d, (label, entries) in enumerate(datasets):
        items = list(entries)
        row: dict[str, Any] = {"dataset": label, "entries": len(items), "raw_bytes": sum(len(e.data) for e in items)}
        for split in (1, 8):
            folder = f"objects-check/d{d}/split{split}"
            stored = 0
            for k in range(split):
                part = Entries(items[k::split])
                if len(part):
                    blob = bundle.encode(part, fingerprint)
                    stored += len(blob)
                    store.put(folder, f"part-{k:02d}.mcb", blob)
            seconds = []
            for i in range(repeats):
                secs, objects, count = restore_once(store, folder, fingerprint, work / "objects" / f"d{d}-s{split}-r{i}")
                if count != len(items):
                    raise RuntimeError(f"objects check: restored {count} entries of {len(items)}")
                seconds.append(secs)
            row[f"split{split}"] = {"objects": objects, "stored_bytes": stored, "seconds": seconds,
                                    "median": statistics.median(seconds)}
        rows.append(row)
    return rows


# --- environment ------------------------------------------------------------------------------------
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


# --- summaries --------------------------------------------------------------------------------------
def _values(runs: list[Run], attr: str) -> list[float]:
    return [float(getattr(r, attr)) for r in runs if r.ok and getattr(r, attr) is not None]


def _median(runs: list[Run], attr: str) -> float | None:
    vals = _values(runs, attr)
    return statistics.median(vals) if vals else None


def _cell(runs: list[Run], attr: str, kind: str) -> str:
    vals = _values(runs, attr)
    if not vals:
        return "n/a"
    fmt: Callable[[float], str] = (lambda v: f"{v:.2f}") if kind == "s" else human_bytes if kind == "b" else (
        lambda v: f"{v:g}")
    med = fmt(statistics.median(vals))
    return med if len(vals) == 1 or min(vals) == max(vals) else f"{med} [{fmt(min(vals))}-{fmt(max(vals))}]"


def triton_events(path: Path) -> tuple[int | None, int | None]:
    """(kernels Triton built, kernels it found cached) from the example project's listener log (one JSON object
    a line, appended by each process that compiled); (None, None) where no process wrote one."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None
    hits = [bool(json.loads(line).get("cache_hit")) for line in lines if line.strip()]
    return hits.count(False), hits.count(True)


def _hits(runs: list[Run], hit: str, miss: str) -> str:
    ok = [r for r in runs if r.ok]
    if not ok:
        return "n/a"
    pairs = sorted({f"{getattr(r, hit)}/{getattr(r, miss)}" for r in ok if getattr(r, hit) is not None})
    return ", ".join(pairs) or "-"


def _check(value: float | None, bound: float, strict_less: bool = False) -> str:
    if value is None:
        return "n/a"
    good = value < bound if strict_less else value <= bound
    return "PASS" if good else "MISS"


def workload_tables(wl: Workload, runs: list[Run], repeats: int) -> tuple[list[str], dict[str, Any]]:
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        by_mode.setdefault(r.mode, []).append(r)
    lines = [f"### {wl.name} ({wl.device}; median [min-max] of {repeats})", "",
             "| mode | runs ok | session wall s | compile s | FX hit/miss | AOT hit/miss | Triton built/cached "
             "| bytes stored (zst / raw) | bytes moved | restore s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, rs in by_mode.items():
        ok = sum(r.ok for r in rs)
        stored = (f"{_cell(rs, 'upload_bytes', 'b')} / {_cell(rs, 'upload_raw_bytes', 'b')}"
                  if mode.startswith("cold") else "")
        moved = _cell(rs, "bytes_moved", "b") if mode in ("naive",) or mode.startswith("warm") else ""
        restore = _cell(rs, "restore_seconds", "s") if mode == "naive" or mode.startswith("warm") else ""
        lines.append(f"| {mode} | {ok}/{len(rs)} | {_cell(rs, 'wall', 's')} | {_cell(rs, 'compile_seconds', 's')} "
                     f"| {_hits(rs, 'fx_hit', 'fx_miss')} | {_hits(rs, 'aot_hit', 'aot_miss')} "
                     f"| {_hits(rs, 'triton_built', 'triton_hits')} | {stored} | {moved} "
                     f"| {restore} |")
    naive = [r for r in by_mode.get("naive", []) if r.ok]
    if naive:
        ex = naive[0].extra
        lines += ["", f"naive: tar {human_bytes(ex.get('tar_bytes'))} raw, tar.zst {human_bytes(ex.get('tar_zst_bytes'))}; "
                      f"pack {statistics.median(r.extra['pack_seconds'] for r in naive):.2f} s, unpack "
                      f"{statistics.median(r.extra['unpack_seconds'] for r in naive):.2f} s (median); restore s = pack + unpack"]
    med = {mode: {attr: _median(rs, attr) for attr in ("compile_seconds", "wall", "bytes_moved", "upload_raw_bytes")}
           for mode, rs in by_mode.items()}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    g = lambda mode, attr: med.get(mode, {}).get(attr)  # noqa: E731
    warm_cold = ratio(g("warm", "compile_seconds"), g("cold", "compile_seconds"))
    cold_plain = ratio(g("cold", "wall"), g("plain", "wall"))
    warm_plain = ratio(g("warm", "wall"), g("plain", "wall"))
    warm_cold_wall = ratio(g("warm", "wall"), g("cold", "wall"))
    wall_bound = WARM_COLD_WALL_TARGET if wl.device == "cuda" else None
    warm_hot = ratio(g("warm", "compile_seconds"), g("hot", "compile_seconds"))
    moved_raw = ratio(g("warm", "bytes_moved"), g("cold", "upload_raw_bytes"))
    moved_naive = ratio(g("warm", "bytes_moved"), g("naive", "bytes_moved"))
    wc_bound = WARM_COLD_TARGET["cuda" if wl.device == "cuda" else "cpu"]
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ratios = {"cold/plain wall": cold_plain, "warm/plain wall": warm_plain, "warm/cold wall": warm_cold_wall,
              "warm/cold compile": warm_cold, "warm/hot compile": warm_hot, "warm bytes moved / raw": moved_raw,
              "warm bytes moved / naive tar.zst": moved_naive}
    lines += ["", "| ratio (medians) | value | target | result |", "| --- | --- | --- | --- |",
              f"| cold/plain session wall | {f(cold_plain)} | <= {COLD_PLAIN_TARGET} "
              f"| {_check(cold_plain, COLD_PLAIN_TARGET)} |",
              f"| warm/plain session wall | {f(warm_plain)} | - | - |",
              f"| warm/cold session wall | {f(warm_cold_wall)} | "
              + (f"<= {wall_bound} ({wl.device}) | {_check(warm_cold_wall, wall_bound)} |" if wall_bound else "- | - |"),
              f"| warm/cold compile | {f(warm_cold)} | <= {wc_bound} ({wl.device}) | {_check(warm_cold, wc_bound)} |",
              f"| warm/hot compile | {f(warm_hot)} | <= {WARM_HOT_TARGET} | {_check(warm_hot, WARM_HOT_TARGET)} |",
              f"| warm bytes moved / cold raw bytes | {f(moved_raw)} | <= {MOVED_RAW_TARGET} "
              f"| {_check(moved_raw, MOVED_RAW_TARGET)} |",
              f"| warm bytes moved / naive tar.zst | {f(moved_naive)} | < 1 | {_check(moved_naive, 1.0, strict_less=True)} |"]
    xwarm = [r for r in by_mode.get("warm-xdist", []) if r.ok and r.extra.get("downloads") is not None]
    if xwarm:
        downloads = statistics.median(r.extra["downloads"] for r in xwarm)
        ratios["warm-xdist bytes fetched / bytes stored"] = downloads
        ratios["warm-xdist/warm compile"] = ratio(g("warm-xdist", "compile_seconds"), g("warm", "compile_seconds"))
        ratios["warm-xdist/cold-xdist compile"] = ratio(g("warm-xdist", "compile_seconds"),
                                                        g("cold-xdist", "compile_seconds"))
        ratios["warm-xdist/warm wall"] = ratio(g("warm-xdist", "wall"), g("warm", "wall"))
        stored = statistics.median(r.extra["bucket_bytes"] for r in xwarm)
        lines += [f"| warm-xdist bytes fetched / bytes stored ({human_bytes(stored)} in "
                  f"{statistics.median(r.extra['bucket_objects'] for r in xwarm):g} objects) | {f(downloads)} "
                  f"| 1 (one download for all workers) | {_check(abs(downloads - 1.0), 1e-9)} |",
                  f"| warm-xdist/cold-xdist compile | {f(ratios['warm-xdist/cold-xdist compile'])} "
                  f"| <= {wc_bound} ({wl.device}) | {_check(ratios['warm-xdist/cold-xdist compile'], wc_bound)} |",
                  f"| warm-xdist/warm session wall | {f(ratios['warm-xdist/warm wall'])} | <= {XDIST_WARM_TARGET} "
                  f"(never slower than serial) | {_check(ratios['warm-xdist/warm wall'], XDIST_WARM_TARGET)} |"]
    if "warm-auto" in by_mode:
        wa, wk = med["warm-auto"], med["warm-keep"]
        ratios["warm-auto/warm-keep wall"] = ratio(wa["wall"], wk["wall"])
        ratios["warm-auto/warm-keep compile"] = ratio(wa["compile_seconds"], wk["compile_seconds"])
        threads = sorted({str(r.compile_threads) for r in by_mode["warm"] if r.ok}) or ["n/a (no warm run ok)"]
        lines += [f"| warm-auto/warm-keep session wall | {f(ratios['warm-auto/warm-keep wall'])} | (no target) | |",
                  f"| warm-auto/warm-keep compile | {f(ratios['warm-auto/warm-keep compile'])} | (no target) | |",
                  "", f"worker-pool policy: the plain warm run resolved compile_threads to {', '.join(threads)}."]
    if "warm-isa-off" in by_mode:
        off = med["warm-isa-off"]
        ratios["warm/warm-isa-off wall"] = ratio(g("warm", "wall"), off["wall"])
        ratios["warm/warm-isa-off compile"] = ratio(g("warm", "compile_seconds"), off["compile_seconds"])
        lines += [f"| warm/warm-isa-off session wall | {f(ratios['warm/warm-isa-off wall'])} | (no target) | |",
                  f"| warm/warm-isa-off compile | {f(ratios['warm/warm-isa-off compile'])} | (no target) | |"]
    if wl.children:
        counts = sorted({str(r.children) for r in runs if r.ok and r.children is not None}) or ["n/a"]
        lines += ["", f"{wl.name}: the pytest process compiles nothing; compile seconds and hits/misses are the child "
                      f"processes' own records, summed ({', '.join(counts)} children per run)."]
    failures = [r for r in runs if not r.ok]
    if failures:
        lines += ["", "FAILED runs:"]
        lines += [f"- {r.mode}, repeat {r.repeat + 1}: {r.error}" + (f" (log {r.log})" if r.log else "") for r in failures]
    lines.append("")
    phases = phase_rows(runs)
    lines += phase_lines(wl, runs, phases)
    return lines, {"medians": med, "ratios": ratios, "warm_cold_target": wc_bound,
                   "phases": [{"mode": m, "process": p, **v} for m, p, v in phases]}


def _phase_medians(rs: list[Run], process: str) -> dict[str, float] | None:
    """Median seconds per phase of one process (by name: "main", "controller", "gw0", ...) over the runs."""
    rows = [next((p for p in r.processes if p.get("process") == process), None) for r in rs if r.ok]
    rows = [p for p in rows if p is not None]
    if not rows:
        return None
    out = {name: statistics.median(float(p.get(name) or 0.0) for p in rows) for name in (*PHASES, "total")}
    exits = [r.exit_seconds for r in rs if r.ok and r.exit_seconds is not None]
    if process in ("main", "controller") and exits:
        out["exit"] = statistics.median(exits)
    return out


def phase_rows(runs: list[Run]) -> list[tuple[str, str, dict[str, float]]]:
    """(mode, process, median seconds per phase) for every mode with reports, session process first."""
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        if r.processes:
            by_mode.setdefault(r.mode, []).append(r)
    out = []
    for mode, rs in by_mode.items():
        names = list(dict.fromkeys(str(p.get("process")) for r in rs for p in r.processes))
        for process in names:
            med = _phase_medians(rs, process)
            if med is not None:
                out.append((mode, process, med))
    return out


def phase_lines(wl: Workload, runs: list[Run], rows: list[tuple[str, str, dict[str, float]]]) -> list[str]:
    """The table of :func:`phase_rows` (``rows``), with each mode's session wall from ``runs``."""
    if not rows:
        return []
    cols = [*PHASES, "exit"]
    lines = [f"#### {wl.name}: where each process's seconds go (medians; the plugin's per-process times, exit "
             "measured from outside)", "",
             "| mode | process | " + " | ".join(c.replace("_", " ") for c in cols) + " | sum | session wall |",
             "| --- | --- | " + " | ".join("---" for _ in cols) + " | --- | --- |"]
    walls = {mode: _median([r for r in runs if r.mode == mode], "wall") for mode, _p, _m in rows}
    for mode, process, med in rows:
        cells = [f"{med[c]:.2f}" if c in med else "" for c in cols]
        wall = walls.get(mode)
        lines.append(f"| {mode} | {process} | " + " | ".join(cells) + f" | {sum(med.get(c, 0.0) for c in cols):.2f} "
                     f"| {'' if wall is None or process not in ('main', 'controller') else f'{wall:.2f}'} |")
    lines += ["", "startup: interpreter, pytest, plugins, first conftests (torch's import, when a conftest imports "
              "it); imports: torch and torch._dynamo when the plugin saw them; dynamo / backend / backward: torch's own "
              "split of the compile; exit: interpreter shutdown, Inductor's compile pool included.", ""]
    return lines


def idle_lines(idle: dict[str, Any]) -> list[str]:
    lines = [f"### idle: a one-test session that compiles nothing (median of {idle['repeats']})", "",
             "| variant | session wall s (median) | plugin cost ms | objects restored | target | result |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, v in idle["variants"].items():
        cost = v.get("cost_ms")
        restored = ", ".join(sorted({str(x) for x in v["objects_restored"]})) or ""
        med = f"{v['median']:.3f}" if "median" in v else "n/a"
        lines.append(f"| {name} | {med} | {'' if cost is None else f'{cost:.1f}'} | {restored} | "
                     f"{'' if cost is None else f'<= {IDLE_TARGET_MS:.0f} ms'} | "
                     f"{'' if cost is None else ('PASS' if cost <= IDLE_TARGET_MS else 'MISS')} |")
    for failure in idle["failures"]:
        lines.append(f"\nFAILED: {failure}")
    lines.append("")
    return lines


def objects_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### restore time vs objects (same entries; S3 on 127.0.0.1, list + parallel fetch + validate + write)", "",
             "| dataset | entries | raw | 1 object: stored, restore s | 8 objects: stored, restore s | 8/1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        one, eight = row["split1"], row["split8"]
        lines.append(f"| {row['dataset']} | {row['entries']} | {human_bytes(row['raw_bytes'])} "
                     f"| {human_bytes(one['stored_bytes'])}, {one['median']:.3f} "
                     f"| {human_bytes(eight['stored_bytes'])} ({eight['objects']} objects), {eight['median']:.3f} "
                     f"| {eight['median'] / one['median']:.2f} |")
    lines.append("")
    return lines


def plot(out: Path, results: dict[str, Any], runs: list[Run], env: dict[str, Any]) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install -r benchmarks/requirements.txt): no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w["name"] for w in results["workloads"]]
    if not names:
        return "no workload ran: no plot"
    fig, axes = plt.subplots(1, len(names), figsize=(max(6.0, 4.5 * len(names)), 4.8), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        modes = list(dict.fromkeys(r.mode for r in runs if r.workload == name and r.mode != "plain"))
        meds, lows, highs = [], [], []
        for mode in modes:
            vals = [r.compile_seconds for r in runs if r.workload == name and r.mode == mode and r.ok
                    and r.compile_seconds is not None]
            m = statistics.median(vals) if vals else 0.0
            meds.append(m)
            lows.append(m - min(vals) if vals else 0.0)
            highs.append(max(vals) - m if vals else 0.0)
        bars = ax.bar(modes, meds, yerr=[lows, highs], capsize=4,
                      color=[MODE_COLORS.get(m, "#7f8c8d") for m in modes])
        for bar, m in zip(bars, meds, strict=True):
            ax.annotate(f"{m:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_title(name)
        ax.set_ylabel("compile seconds (median, min-max)")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("pytest-megacache: time inside torch.compile per session\n" + env_label(env), fontsize=9)
    fig.tight_layout()
    path = out / "compile_seconds.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    plot_phases(plt, out / "phases.png", results, env)
    return None


def plot_phases(plt: Any, path: Path, results: dict[str, Any], env: dict[str, Any]) -> None:
    """Where each process's seconds go: one stacked bar per mode and process, one panel per workload."""
    panels = [(w["name"], w.get("phases") or []) for w in results["workloads"] if w.get("phases")]
    if not panels:
        return
    cols = [*PHASES, "exit"]
    height = max(3.0, 0.45 * max(len(rows) for _n, rows in panels) + 1.5)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height * len(panels)), squeeze=False)
    for ax, (name, rows) in zip(axes[:, 0], panels, strict=True):
        labels = [f"{row['mode']} {row['process']}" if row["process"] not in ("main",) else row["mode"] for row in rows]
        left = [0.0] * len(rows)
        for col in cols:
            widths = [float(row.get(col) or 0.0) for row in rows]
            if not any(widths):
                continue
            ax.barh(labels, widths, left=left, color=PHASE_COLORS[col], label=col.replace("_", " "))
            left = [a + b for a, b in zip(left, widths, strict=True)]
        for i, total in enumerate(left):
            ax.annotate(f"{total:.1f} s", (total, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("seconds (medians per phase)")
        ax.legend(fontsize=7, ncol=6, loc="lower right")
    fig.suptitle("pytest-megacache: where each process's seconds go\n" + env_label(env), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workload", nargs="+", choices=("example", "mixed", "synthetic", "varied", "children", "ranks"),
                        default=["example", "synthetic"])
    parser.add_argument("--n", nargs="+", type=int, default=[10, 50], help="synthetic workload sizes (default: 10 50)")
    parser.add_argument("--varied-n", nargs="+", type=int, default=[130],
                        help="varied workload sizes (default: 130 functions of 13 kinds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--plot", action="store_true", help="write DIR/compile_seconds.png (needs matplotlib)")
    parser.add_argument("--idle-repeats", type=int, default=None,
                        help="sessions per idle variant (default: 3 x --repeats, at least 5)")
    parser.add_argument("--idle-only", action="store_true", help="only the idle measurement")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle measurement")
    parser.add_argument("--no-apart", action="store_true",
                        help="skip the costs measured apart (import torch, torch._dynamo, the CPU vector-ISA check)")
    parser.add_argument("--no-threads-pair", action="store_true", help=f"skip the {THREADS_FLAG} auto/keep pair")
    parser.add_argument("--isa-pair", action="store_true",
                        help=f"also run warm with {ISA_FLAG} no (torch's CPU vector-ISA load checks in every process)")
    parser.add_argument("--xdist", type=int, default=0, metavar="N",
                        help="also run cold and warm with pytest-xdist -n N (default: off)")
    parser.add_argument("--skip", nargs="+", choices=SKIPPABLE, default=[],
                        help="modes not to run (each needs a run of its own per repeat; the targets that need them "
                             "print n/a)")
    parser.add_argument("--objects-repeats", type=int, default=3, help="restores per objects-check case (default: 3)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one pytest run may take (default: 3600)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (caches, logs, reports)")
    opts = parser.parse_args(argv)
    if opts.idle_repeats is None:
        opts.idle_repeats = max(5, 3 * opts.repeats)
    if opts.repeats < 1 or opts.idle_repeats < 1 or any(n < 1 for n in [*opts.n, *opts.varied_n]) or opts.xdist < 0:
        parser.error("--repeats, --idle-repeats and --n take positive numbers, --xdist zero or more")
    if opts.xdist and importlib.util.find_spec("xdist") is None:
        parser.error("--xdist needs pytest-xdist: pip install -r benchmarks/requirements.txt")

    started = time.perf_counter()
    env = environment()
    say(env_label(env))
    opts.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megacache-bench-"))
    say(f"scratch directory {work}; results to {opts.out.resolve()}")
    all_runs: list[Run] = []
    results: dict[str, Any] = {"environment": env, "argv": sys.argv[1:] if argv is None else argv,
                               "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
                               "workloads": [], "idle": None, "objects": None, "apart": None, "notes": []}
    md: list[str] = ["# pytest-megacache benchmark", "", f"{env_label(env)}; {env['date']}", "",
                     "Command: `python benchmarks/run.py " + " ".join(results["argv"]) + "`", ""]
    notes: list[str] = results["notes"]
    failed = False
    try:
        with S3() as s3:
            runner = Runner(s3, opts.timeout, opts.out / "failed-logs")
            runner.progress_file = opts.out / "runs.jsonl"
            runner.progress_file.unlink(missing_ok=True)
            if not runner.installed:
                notes.append("pytest-megacache is not installed as a pytest plugin here: loaded with "
                             "-p pytest_megacache.plugin from this checkout")
            workloads: list[Workload] = []
            if not opts.idle_only:
                if "example" in opts.workload:
                    workloads.append(make_example(opts.device))
                if "mixed" in opts.workload:
                    workloads.append(make_mixed(opts.device))
                if "synthetic" in opts.workload:
                    workloads += [make_synthetic(work / "projects", n, opts.device) for n in opts.n]
                if "varied" in opts.workload:
                    workloads += [make_varied(work / "projects", n, opts.device) for n in opts.varied_n]
                if "children" in opts.workload:
                    workloads.append(make_children(work / "projects", opts.device))
                if "ranks" in opts.workload:
                    workloads.append(make_ranks(opts.device))
                if any(wl.children for wl in workloads) and not child_records_installed():
                    notes.append(f"{CHILD_PTH} is not in this interpreter's site-packages: child processes report "
                                 "nothing and the children and ranks runs fail (pip install -e . installs it)")
            threads = False
            if workloads and not opts.no_threads_pair:
                threads = has_threads_option(runner, workloads[0], work)
                if not threads:
                    notes.append(f"the installed plugin has no {THREADS_FLAG}: the worker-pool pair "
                                 "(warm-auto / warm-keep) was skipped")
            last_populated: tuple[Workload, str] | None = None
            for wl in workloads:
                runs, populated = bench_workload(runner, wl, opts.repeats, work, threads, opts.xdist, opts.skip,
                                                 opts.isa_pair)
                all_runs += runs
                failed |= any(not r.ok for r in runs)
                if populated:
                    last_populated = (wl, populated)
                lines, summary = workload_tables(wl, runs, opts.repeats)
                results["workloads"].append({"name": wl.name, "device": wl.device, "tests": wl.args,
                                             "children": wl.children, **summary,
                                             "runs": [r.__dict__ for r in runs]})
                md += lines
                print("\n".join(lines), flush=True)
            if workloads and not opts.no_apart:
                say("per-process costs measured apart ...")
                results["apart"] = bench_apart(runner, work, opts.repeats)
                lines = apart_lines(results["apart"])
                md += lines
                print("\n".join(lines), flush=True)
            if not opts.no_idle:
                say(f"idle: {opts.idle_repeats} sessions per variant ...")
                wl_idle, bucket = last_populated if last_populated else (None, None)
                idle = bench_idle(runner, work, opts.idle_repeats, wl_idle, bucket)
                results["idle"] = idle
                failed |= bool(idle["failures"])
                lines = idle_lines(idle)
                md += lines
                print("\n".join(lines), flush=True)
            if not opts.idle_only:
                say("restore time vs objects ...")
                wl_obj, bucket = last_populated if last_populated else (None, None)
                rows = bench_objects(s3, work, opts.objects_repeats, bucket, wl_obj.name if wl_obj else None)
                results["objects"] = rows
                lines = objects_lines(rows)
                md += lines
                print("\n".join(lines), flush=True)
    finally:
        if opts.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if opts.plot:
        note = plot(opts.out, results, all_runs, env)
        if note:
            notes.append(note)
        else:
            say(f"plot: {opts.out / 'compile_seconds.png'}")
    if failed:
        notes.append("at least one run FAILED: see the rows with fewer runs ok, and the output tails printed above")
    for note in notes:
        say(f"note: {note}")
    md += [f"- note: {n}" for n in notes] + ["", f"Whole benchmark: {time.perf_counter() - started:.0f} s", ""]
    results["seconds"] = time.perf_counter() - started
    (opts.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (opts.out / "results.md").write_text("\n".join(md))
    say(f"wrote {opts.out / 'results.json'} and {opts.out / 'results.md'} ({results['seconds']:.0f} s in all)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
