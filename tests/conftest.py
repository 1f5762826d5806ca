"""Shared fixtures: a real S3 endpoint (moto's server mode on 127.0.0.1) and helpers to reach it."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# The one moto helper the demo and the benchmarks use too; re-exported here under the names tests import.
from demo.local_s3 import S3_ENV as S3_ENV
from demo.local_s3 import LocalS3
from demo.local_s3 import free_port as free_port
from pytest_megacache.stores import LocalDirStore, S3Store, Store

pytest_plugins = ["pytester"]

S3Server = LocalS3  # a moto S3 server over HTTP on loopback, shared by the test session

# What a test must not inherit from the machine, from GitHub Actions or from an outer pytest-xdist run (whose
# worker variables would tell a project's conftest it runs in a worker): the plugin's settings, the CI context
# its scope and fork detection read, torch's job id, pytest's own options.
HERMETIC_PREFIXES = ("MEGACACHE_", "GITHUB_", "TORCH_COMPILE_JOB_ID", "PYTEST_XDIST_", "PYTEST_ADDOPTS")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the tests that start torch in subprocesses first: they take seconds to minutes each,
    the others milliseconds, so the short ones fill the workers' ends (longest first balances the workers).
    A module's tests stay in their order; a serial run keeps pytest's order."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("torch") is None)


def _xdist_unit(nodeid: str) -> str:
    """The scheduling unit of a test under ``-n N``: its class, if it is a method (the tests of a class assert
    on one chain of sessions, a class-scoped fixture, run once), else the test itself."""
    parts = nodeid.split("[", 1)[0].split("::")
    return "::".join(parts[:2]) if len(parts) > 2 else nodeid


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist is a test extra; without it, every run is serial
    pass
else:

    class _ClassScheduling(LoadScopeScheduling):
        """``--dist load``, except that a class's tests share one worker. (``--dist loadgroup`` would do it with
        marks, but groups nothing on pytest 9.2: pytest-xdist#1386.) The classes go first (most tests first),
        then every other test in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return _xdist_unit(nodeid)

    @pytest.hookimpl(optionalhook=True)  # -p no:xdist leaves the hook unknown
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
        if config.getvalue("dist") != "load":
            return None  # an explicit --dist stands
        return _ClassScheduling(config, log)


CXX_STASH = pytest.StashKey[Path]()
FAILED_STASH = pytest.StashKey[bool]()


def removed_unless_failed(request: pytest.FixtureRequest, path: Path) -> Path:
    """``path``, removed when the scope of the fixture that asks for it ends, unless a test of this process failed
    meanwhile (kept to look at, as pytest keeps a failed test's ``tmp_path``). A torch session's folder holds a
    precompiled header of about 150 MB: the run's folders kept to its end filled a CI runner's disk."""
    failed = request.session.testsfailed

    def drop() -> None:
        if request.session.testsfailed == failed:
            shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(drop)
    return path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed:
        item.stash[FAILED_STASH] = True
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A passed test's pytester folder goes once its fixtures are torn down (``tmp_path`` goes by pytest's own
    ``tmp_path_retention_policy``); a failed test's stays for the run's end."""
    pytester = getattr(item, "funcargs", {}).get("pytester")
    result = yield  # a teardown that raises keeps the folder too
    if isinstance(pytester, pytest.Pytester) and not item.stash.get(FAILED_STASH, False):
        shutil.rmtree(pytester.path, ignore_errors=True)
    return result


def pytest_configure(config: pytest.Config) -> None:
    """The run's compiler-output cache (tests/cxxcache.py) goes first on PATH as ``g++``, for every torch session
    the tests start; xdist workers inherit it from the controller. ``TESTS_REAL_CXX=1`` runs the real compiler."""
    if hasattr(config, "workerinput") or os.environ.get("TESTS_CXX_STORE") or os.environ.get("TESTS_REAL_CXX"):
        return
    real = shutil.which("g++")
    if real is None:
        return
    folder = Path(tempfile.mkdtemp(prefix="megacache-tests-cxx-"))
    (folder / "bin").mkdir()
    (folder / "store").mkdir()
    shim = folder / "bin" / "g++"
    shim.write_text(f"#!{sys.executable} -S\n" + (Path(__file__).parent / "cxxcache.py").read_text())
    shim.chmod(0o755)
    try:  # a temporary folder mounted noexec, say: then the real compiler runs
        subprocess.run([str(shim), "--version"], env={**os.environ, "TESTS_CXX_REAL": real}, capture_output=True,
                       timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        shutil.rmtree(folder, ignore_errors=True)
        return
    os.environ.update(TESTS_CXX_REAL=real, TESTS_CXX_STORE=str(folder / "store"),
                      PATH=os.pathsep.join([str(folder / "bin"), os.environ.get("PATH", "")]))
    config.stash[CXX_STASH] = folder


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    folder = config.stash.get(CXX_STASH, None)
    builds = len(list((folder / "store").glob("[0-9a-f]*"))) if folder is not None else 0
    if folder is not None and builds:
        hits = (folder / "store" / "hits").stat().st_size if (folder / "store" / "hits").exists() else 0
        terminalreporter.write_line(f"C++ builds of the torch sessions: {builds} compiled, {hits} served from this run's "
                                    "compiler-output cache (tests/cxxcache.py; TESTS_REAL_CXX=1 turns it off)")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(CXX_STASH, None)
    if folder is not None:
        for key in ("TESTS_CXX_REAL", "TESTS_CXX_STORE"):
            os.environ.pop(key, None)
        os.environ["PATH"] = os.environ["PATH"].replace(str(folder / "bin") + os.pathsep, "", 1)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's environment pointing boto3 at it."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "MEGACACHE_BUCKET", "MEGACACHE_DIR"):
        monkeypatch.delenv(key, raising=False)
    return s3_server


@pytest.fixture(autouse=True)
def _clean_megacache_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Hermetic: no settings, scope or fork detection leaking in from the machine (or from GitHub Actions).
    for key in list(os.environ):
        if key.startswith(HERMETIC_PREFIXES):
            monkeypatch.delenv(key)
    had_torch = "torch._C" in sys.modules
    yield
    # torch runs in the tests' subprocesses only. Imported here, it would be dropped from sys.modules again by
    # pytester's module snapshot while its C extension stays loaded, and the next import in this process would
    # read freed memory (a SystemError or a segfault, in whichever test comes next on that worker).
    if not had_torch and "torch._C" in sys.modules:
        pytest.fail("this test imported torch into the pytest process: keep torch in subprocesses "
                    "(helpers_torch.skip_without_torch skips without importing it)", pytrace=False)


def fake_elf(payload: bytes = b"") -> bytes:
    """A whole (if useless) 64-bit ELF file: its header declares no tables, so any length >= 64 is complete.
    Kernel files (.so) the plugin carries must be whole ELF files; truncated ones are refused."""
    header = b"\x7fELF\x02\x01\x01" + bytes(64 - 7)
    return header + payload


def tool_path(name: str) -> str:
    """A console script of this environment (beside its python), else one on PATH; skips if neither."""
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed")
    return found


def load_benchmark(filename: str) -> ModuleType:
    """A script of benchmarks/ (not a package), imported by path under its own module name."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(f"megacache_bench_{Path(filename).stem}", root / "benchmarks" / filename)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["dir", "s3"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """One store that several sessions share: the directory store, then moto's S3 server."""
    if request.param == "dir":
        yield LocalDirStore(tmp_path / "store")
        return
    server: S3Server = request.getfixturevalue("s3_server")
    yield S3Store(server.create_bucket(), server.client())


# --- a real small file system ---------------------------------------------------------------------------------------
# Set by a CI workflow whose runner can mount one (GitHub's hosted runners: passwordless sudo): there a test that needs
# a small file system fails where it cannot mount one, instead of skipping.
MOUNT_REQUIRED_ENV = "TESTS_MOUNT"
_HOLD_MOUNT = 'mount -t tmpfs -o "size=$2" tmpfs "$1" && echo mounted && exec sleep 3600'


class SmallFilesystems:
    """Real tmpfs file systems of a given size (a write past it fails with ENOSPC from the kernel), reachable by this
    test's processes and their children. Each is mounted, in order of what needs the least: in a user namespace of
    its own where the kernel allows one (``unshare -rm``: a process of that namespace holds the mount, reached through
    ``/proc/<pid>/root``); here, where this process may mount (root); with passwordless sudo (hosted CI runners). The
    test is skipped, saying why, where none works, or fails where :data:`MOUNT_REQUIRED_ENV` is ``required``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._holders: list[subprocess.Popen[str]] = []
        self._mounted: list[tuple[list[str], Path]] = []  # how to unmount (the command's prefix), where

    def __call__(self, size: str) -> Path:
        mount_point = self.tmp_path / f"fs-{size}-{len(self._holders) + len(self._mounted)}"
        mount_point.mkdir()
        reasons = []
        if shutil.which("unshare"):
            holder = subprocess.Popen(["unshare", "-rm", "sh", "-c", _HOLD_MOUNT, "sh", str(mount_point), size],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            ready, _, _ = select.select([holder.stdout], [], [], 30)
            if ready and holder.stdout is not None and holder.stdout.readline().strip() == "mounted":
                self._holders.append(holder)
                return Path(f"/proc/{holder.pid}/root") / mount_point.relative_to(mount_point.anchor)
            holder.kill()
            reasons.append(f"unshare -rm: {holder.communicate(timeout=30)[1].strip() or 'no mount'}")
        options = f"size={size},uid={os.getuid()},gid={os.getgid()},mode=0700"
        for prefix in ([], ["sudo", "-n"]):
            if prefix and shutil.which("sudo") is None:
                reasons.append("sudo: not installed")
                continue
            try:
                done = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                                      capture_output=True, text=True, check=False, timeout=60)
                refused = (done.stderr.strip() or f"exit {done.returncode}") if done.returncode else None
            except (OSError, subprocess.TimeoutExpired) as exc:
                refused = str(exc)
            if refused is None:
                self._mounted.append((prefix, mount_point))
                return mount_point
            reasons.append(f"{' '.join([*prefix, 'mount'])}: {refused}")
        why = f"no {size} file system here: " + " ".join("; ".join(reasons).split())
        if os.environ.get(MOUNT_REQUIRED_ENV) == "required":
            pytest.fail(f"{why} ({MOUNT_REQUIRED_ENV}=required)")
        pytest.skip(why)

    def close(self) -> None:
        for holder in self._holders:
            holder.kill()
            holder.communicate(timeout=30)
        for prefix, mount_point in self._mounted:
            subprocess.run([*prefix, "umount", "-l", str(mount_point)], check=False, capture_output=True, timeout=60)


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[SmallFilesystems]:
    """``small_filesystem("64k")``: the path of a new tmpfs of that size (see :class:`SmallFilesystems`)."""
    filesystems = SmallFilesystems(tmp_path)
    try:
        yield filesystems
    finally:
        filesystems.close()
