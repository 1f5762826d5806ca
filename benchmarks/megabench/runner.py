"""Running pytest: the S3 server, the environment and fresh cache directories of each run, and the runner that
starts one pytest process per run and keeps its record."""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from local_s3 import LocalS3, clean_env  # the S3 server the demo and the tests use too (demo/local_s3.py)
from run_demo import load_json  # the demo's reader of the plugin's report (demo/run_demo.py)

from . import ROOT
from .console import say
from .records import Run, failure_reason, fill_from_report, triton_events
from .workloads import Workload

THREADS_FLAG = "--megacache-compile-threads"
TAIL_CHARS = 4000
# The example project's conftest logs each Triton compile in its processes to this file when the variable is set
# (a listener that only observes); other workloads ignore it.
TRITON_EVENTS_ENV = "EXAMPLE_TRITON_EVENTS"
TRITON_EVENTS_FILE = "triton-events.jsonl"


class S3(LocalS3):
    """The demo's S3 server (demo/local_s3.py), with a clear message when moto is missing."""

    def __init__(self) -> None:
        try:
            super().__init__()
        except ImportError:
            sys.exit("benchmarks/run.py needs moto's server: pip install -r benchmarks/requirements.txt")


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
        doc = load_json(report)
        if doc is not None:
            fill_from_report(r, doc, from_children=wl.children)
        r.error = failure_reason(rc, doc, wl, mode)
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


def has_threads_option(runner: Runner, wl: Workload, scratch: Path) -> bool:
    dirs = Dirs.fresh(scratch / "help")
    rc, _, text = runner.pytest(wl.cwd, [*runner.load_args, "--help"], dirs, scratch / "help" / "pytest.log")
    if rc != 0:
        say(f"note: `pytest --help` exited {rc}; assuming no {THREADS_FLAG}")
    return THREADS_FLAG in text
