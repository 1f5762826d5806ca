"""Child processes report their own torch counters: the .pth line, the exit handler, and the spool reader.

Most children here are real Python interpreters started from this venv (so the installed
``pytest_megacache_children.pth`` runs in them) that fake torch's counters module instead of importing torch:
the handler reads ``sys.modules["torch._dynamo.utils"]`` and nothing else of torch. The tests marked ``torch``
share one run of real ``torch.compile`` children (one compiling cold, its ``torch.multiprocessing.spawn`` child
hitting the cache it wrote, one importing ``torch._dynamo`` without compiling).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
import signal
import site
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import children as childstart
from pytest_megacache import isaprobe
from pytest_megacache.children import PTH_LINE
from pytest_megacache.children import hook as childhook
from pytest_megacache.children.hook import MAX_FILES, MAX_RECORD_BYTES, SPOOL_ENV, ChildRecord, read_spool
from pytest_megacache.torch_adapter import COUNTER_NAMES

from ..conftest import removed_unless_failed

ROOT = Path(__file__).resolve().parents[2]
PTH_NAME = "pytest_megacache_children.pth"
ALL_COUNTERS = sorted(name for names in COUNTER_NAMES.values() for name in names)
RECORD_KEYS = {"v", "pid", "ppid", "rank", "local_rank", "world_size", "compiled", "compiles", "graphs",
               "compile_seconds", "counters", "isa_run", "isa_reused", "isa_seconds", "phases"}
SECRET = "hunter2-s3cr3t"

# Imported by the children (PYTHONPATH): a stand-in for torch._dynamo.utils, and a way to say who they are.
KIDLIB = textwrap.dedent(
    """
    import collections, json, os, subprocess, sys, types

    def fake_torch(misses=2, hits=0, seconds=(0.5, 0.25), graphs=1, counters=None):
        m = types.ModuleType("torch._dynamo.utils")
        if counters is None:
            counters = collections.defaultdict(collections.Counter)
            if misses:
                counters["inductor"]["fxgraph_cache_miss"] = misses
            if hits:
                counters["inductor"]["fxgraph_cache_hit"] = hits
            if graphs:
                counters["stats"]["unique_graphs"] = graphs
        m.counters = counters
        m.compilation_time_metrics = {"_compile.compile_inner": list(seconds)} if seconds else {}
        sys.modules["torch._dynamo.utils"] = m

    def report(path, **extra):
        with open(path, "w") as fh:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), **extra}, fh)

    def spawned(out):
        fake_torch(misses=0, hits=3)
        report(out)
    """
)


@dataclass
class Kid:
    proc: subprocess.CompletedProcess[str]
    spool: Path
    facts: dict[str, Any]

    def records(self) -> list[ChildRecord]:
        records, rejects = read_spool(self.spool)
        assert rejects == []
        return records

    def files(self) -> list[str]:
        return sorted(os.listdir(self.spool)) if self.spool.exists() else []


@pytest.fixture
def kid(tmp_path: Path) -> Iterator[Any]:
    """Run ``code`` in a fresh interpreter of this venv, with the spool variable set unless ``spool=None``."""
    (tmp_path / "kidlib.py").write_text(KIDLIB)

    def run(code: str, spool: Path | str | None = tmp_path / "spool", env: Mapping[str, str] | None = None,
            args: tuple[str, ...] = (), interpreter: tuple[str, ...] = (sys.executable,), create_spool: bool = True,
            ) -> Kid:
        facts = tmp_path / "facts.json"
        facts.unlink(missing_ok=True)
        full_env = child_env(spool, **{"PYTHONPATH": str(tmp_path), "FACTS": str(facts), **(env or {})})
        if spool is not None and os.path.isabs(spool) and create_spool:
            with contextlib.suppress(OSError):  # some tests give a spool that cannot exist
                Path(spool).mkdir(mode=0o700, parents=True, exist_ok=True)  # the session creates it (plugin.py)
        proc = subprocess.run([*interpreter, "-c", textwrap.dedent(code), *args], env=full_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        spool_path = Path(spool) if spool is not None else tmp_path / "spool"
        return Kid(proc, spool_path, json.loads(facts.read_text()) if facts.exists() else {})

    yield run


def child_env(spool: Path | str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (SPOOL_ENV, childstart.ISA_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH",
                        "COVERAGE_PROCESS_START")}
    if spool is not None:
        env[SPOOL_ENV] = str(spool)
    env.update(extra)
    return env


def valid_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "v": childhook.RECORD_VERSION, "pid": 4242, "ppid": 1, "rank": 0, "local_rank": 0, "world_size": 2,
        "compiled": True, "compiles": 3, "graphs": 2, "compile_seconds": 1.5,
        "counters": {name: 0 for name in ALL_COUNTERS}, "isa_run": 0, "isa_reused": 2, "isa_seconds": 0.01,
        "phases": {"_compile.compile_inner": 1.5, "compile_fx.<locals>.fw_compiler_base": 0.5},
    }
    doc["counters"]["fxgraph_cache_miss"] = 2
    doc.update(changes)
    return doc


def write_doc(spool: Path, name: str, doc: Any) -> Path:
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / name
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return path


# --- the .pth file, in the repository and installed ---------------------------------------------------------------
def test_pth_file_is_one_import_line_that_matches_the_module() -> None:
    text = (ROOT / PTH_NAME).read_text()
    assert text == PTH_LINE
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.startswith("import ")  # site runs only lines that start with "import"


def test_pth_file_is_installed_in_site_packages() -> None:
    """bootstrap.sh installs the package (editable) into this venv: the .pth must be there, and not stale."""
    found = [Path(d) / PTH_NAME for d in site.getsitepackages() if (Path(d) / PTH_NAME).is_file()]
    assert found, f"{PTH_NAME} is in none of {site.getsitepackages()}: reinstall the package (pip install -e .)"
    assert found[0].read_text() == PTH_LINE


def test_inert_without_the_variable(kid: Any) -> None:
    """Without the variable the line registers nothing and imports nothing. With it, one exit handler (Python 3.11
    runs a venv's .pth files twice: site.venv() and site.main() both add site-packages), and the only modules it
    loads are the package's ``__init__``, ``childstart`` and ``atexit`` (built in): no typing, no re, nothing of
    childhook (that waits for an exit with torch loaded)."""
    code = """
        import atexit, json, os, sys
        from kidlib import report
        report(os.environ["FACTS"], handlers=atexit._ncallbacks(), modules=sorted(sys.modules),
               imported=sorted(m for m in sys.modules if m.startswith("pytest_megacache")))
    """
    absent, present = kid(code, spool=None), kid(code)
    assert absent.proc.returncode == present.proc.returncode == 0, absent.proc.stderr + present.proc.stderr
    assert absent.proc.stderr == present.proc.stderr == ""
    assert absent.facts["imported"] == []
    assert present.facts["imported"] == ["pytest_megacache", "pytest_megacache.children"]
    assert set(present.facts["modules"]) - set(absent.facts["modules"]) == {
        "pytest_megacache", "pytest_megacache.children"}
    assert present.facts["handlers"] == absent.facts["handlers"] + 1


@pytest.mark.parametrize("init", ["", "raise RuntimeError('broken')\n"], ids=["no-childstart", "init-raises"])
def test_the_line_is_silent_when_the_package_cannot_be_imported(kid: Any, tmp_path: Path, init: str) -> None:
    """Another copy of the package first on the path (without childstart, or one that fails to import): no
    traceback in the child's stderr, its exit status its own."""
    other = tmp_path / "other" / "pytest_megacache"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text(init)
    k = kid("import sys; sys.exit(5)", env={"PYTHONPATH": f"{other.parent}{os.pathsep}{tmp_path}"})
    assert (k.proc.returncode, k.proc.stderr) == (5, "")


def test_the_line_runs_start_from_the_installed_package(kid: Any) -> None:
    k = kid("""
        import os, sys
        import pytest_megacache.children as c
        from kidlib import report
        report(os.environ["FACTS"], started=c._started, file=c.__file__)
    """)
    assert k.proc.returncode == 0, k.proc.stderr
    assert k.facts["started"] is True
    assert Path(k.facts["file"]).resolve() == Path(childstart.__file__).resolve()


# --- childstart, in this process ------------------------------------------------------------------------------------
class _Atexit:
    def __init__(self) -> None:
        self.registered: list[tuple[Any, ...]] = []

    def register(self, fn: Any, *args: Any) -> None:
        self.registered.append((fn, *args))


@pytest.fixture
def fresh_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> _Atexit:
    """childstart as in a new interpreter: not started, its own sys.meta_path and a stand-in for atexit."""
    fake = _Atexit()
    monkeypatch.setattr(childstart, "_started", False)
    monkeypatch.setattr(childstart, "atexit", fake)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    monkeypatch.setenv(childstart.READY_ENV, str(tmp_path / "ready"))
    monkeypatch.setenv(childstart.WAIT_ENV, "30")
    monkeypatch.delenv(childstart.ISA_ENV, raising=False)
    return fake


def _waits() -> list[Any]:
    return [f for f in sys.meta_path if getattr(f, "__name__", "") == "MegacacheRestoreWait"]


def test_start_arms_once(fresh_start: _Atexit, tmp_path: Path) -> None:
    childstart.start()
    childstart.start()
    assert fresh_start.registered == [(childstart._at_exit, os.getpid(), os.getppid(), str(tmp_path / "spool"))]
    assert sys.meta_path[0] is childstart.MegacacheRestoreWait and len(_waits()) == 1


def test_start_without_the_spool_or_the_ready_file(fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(childstart.READY_ENV)
    childstart.start()
    assert len(fresh_start.registered) == 1 and _waits() == []  # the exit handler, no wait
    monkeypatch.setattr(childstart, "_started", False)
    monkeypatch.delenv(SPOOL_ENV)
    monkeypatch.setenv(childstart.READY_ENV, "/ready")
    childstart.start()
    assert len(fresh_start.registered) == 1 and _waits() == []  # nothing at all


def test_start_adds_no_wait_once_torch_is_imported_or_a_wait_is_there(
        fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", type(sys)("torch"))
    childstart.start()
    assert _waits() == [] and len(fresh_start.registered) == 1
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(childstart, "_started", False)
    other_copy = type("MegacacheRestoreWait", (), {})  # from another copy of the module (a reload)
    sys.meta_path.insert(0, other_copy)
    childstart.start()
    assert _waits() == [other_copy]


def test_start_never_raises(fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise OSError("no")

    monkeypatch.setattr(fresh_start, "register", broken)
    childstart.start()  # returns
    assert _waits() == []


def test_the_wait_removes_itself_at_torch_and_ignores_other_names(fresh_start: _Atexit, tmp_path: Path) -> None:
    (tmp_path / "ready").touch()  # settled: no request, no wait
    childstart.start()
    assert childstart.MegacacheRestoreWait.find_spec("torchvision") is None
    assert childstart.MegacacheRestoreWait.find_spec("torch.nn") is None
    assert len(_waits()) == 1
    assert childstart.MegacacheRestoreWait.find_spec("torch") is None
    assert _waits() == []
    assert not (tmp_path / ("ready" + childstart.WANTED_SUFFIX)).exists()


@pytest.mark.parametrize("wait", ["soon", "nan", "-5", "0"])
def test_the_wait_on_a_garbled_limit_returns_at_once(
        fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, wait: str) -> None:
    """A limit that is not a number: no request, no wait; not positive: the request, no wait. (NaN: the cap.)"""
    monkeypatch.setenv(childstart.WAIT_ENV, wait)
    if wait == "nan":
        monkeypatch.setattr(childstart, "MAX_CHILD_WAIT", 0.05)
    childstart.start()
    childstart.MegacacheRestoreWait.find_spec("torch")
    assert _waits() == []
    assert (tmp_path / ("ready" + childstart.WANTED_SUFFIX)).exists() == (wait != "soon")


def test_the_wait_lets_no_exception_out(fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any) -> bool:
        raise KeyboardInterrupt

    childstart.start()
    monkeypatch.setattr(childstart.os.path, "exists", interrupted)
    assert childstart.MegacacheRestoreWait.find_spec("torch") is None
    assert _waits() == []


def test_the_isa_digest_alone_arms_at_torch_and_asks_for_no_restore(
        fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pytest_megacache import isaprobe

    armed: list[str] = []
    monkeypatch.setattr(isaprobe, "arm_child", armed.append)
    monkeypatch.delenv(childstart.READY_ENV)
    monkeypatch.setenv(childstart.ISA_ENV, "ab" * 32)
    childstart.start()
    assert len(_waits()) == 1
    assert childstart.MegacacheRestoreWait.find_spec("numpy") is None and armed == []
    assert childstart.MegacacheRestoreWait.find_spec("torch") is None
    assert armed == ["ab" * 32] and _waits() == []
    assert not (tmp_path / ("ready" + childstart.WANTED_SUFFIX)).exists()


def test_a_failing_isa_arming_still_asks_for_the_restore(
        fresh_start: _Atexit, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pytest_megacache import isaprobe

    def broken(offered: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(isaprobe, "arm_child", broken)
    monkeypatch.setenv(childstart.ISA_ENV, "ab" * 32)
    monkeypatch.setenv(childstart.WAIT_ENV, "0")
    childstart.start()
    assert childstart.MegacacheRestoreWait.find_spec("torch") is None
    assert (tmp_path / ("ready" + childstart.WANTED_SUFFIX)).exists() and _waits() == []


def test_the_variable_names_agree() -> None:
    from pytest_megacache import isaprobe

    assert childstart.ISA_ENV == isaprobe.CHILD_ENV


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), ImportError()], ids=lambda e: type(e).__name__)
def test_the_exit_handler_lets_no_exception_out(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    calls: list[tuple[Any, ...]] = []

    def raising(*args: Any) -> None:
        calls.append(args)
        raise exc

    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", type(sys)("torch._dynamo.utils"))
    monkeypatch.setattr(childhook, "exit_handler", raising)
    childstart._at_exit(os.getpid(), os.getppid(), "/spool")  # returns
    assert calls == [(os.getpid(), os.getppid(), "/spool")]  # the handler ran, and what it raised stayed inside


def test_the_exit_handler_imports_childhook_only_with_torch_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(childhook, "exit_handler", lambda *args: calls.append(args))
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils", raising=False)
    childstart._at_exit(1, 2, "/spool")
    assert calls == []
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", type(sys)("torch._dynamo.utils"))
    childstart._at_exit(1, 2, "/spool")
    assert calls == [(1, 2, "/spool")]


# --- what a child writes ------------------------------------------------------------------------------------------
def test_a_child_that_compiled_writes_one_valid_record(kid: Any, tmp_path: Path) -> None:
    spool = tmp_path / "deep" / "spool"
    k = kid("""
        import os
        from kidlib import fake_torch, report
        from pytest_megacache import isaprobe
        fake_torch(misses=2, hits=1, seconds=(0.5, 0.25), graphs=2)
        isaprobe._count("run", 1.25)  # what the proxy counts in a child that armed it
        isaprobe._count("reused", 0.25)
        isaprobe._count("reused", 0.0)
        report(os.environ["FACTS"])
    """, spool=spool, env={"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert k.proc.returncode == 0 and k.proc.stderr == "", k.proc.stderr
    [name] = k.files()
    assert re.fullmatch(rf"{k.facts['pid']}-[0-9a-f]{{16}}\.json", name), name
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    assert stat.S_IMODE((spool / name).stat().st_mode) == 0o600
    [record] = k.records()
    counters = dict.fromkeys(ALL_COUNTERS, 0) | {"fxgraph_cache_miss": 2, "fxgraph_cache_hit": 1}
    assert record == ChildRecord(
        file=name, pid=k.facts["pid"], ppid=os.getpid(), rank=3, local_rank=1, world_size=4, compiled=True,
        compiles=2, graphs=2, compile_seconds=0.75, counters=counters, isa_run=1, isa_reused=2, isa_seconds=1.5,
        phases={"_compile.compile_inner": 0.75})
    assert record.label() == f"rank 3 (pid {record.pid})"
    assert record.row() == {"label": f"rank 3 (pid {record.pid})", "pid": record.pid, "ppid": os.getpid(), "rank": 3,
                            "local_rank": 1, "world_size": 4, "compiles": 2, "graphs": 2, "compile_seconds": 0.75,
                            "counters": counters, "isa_checks": {"run": 1, "reused": 2, "seconds": 1.5},
                            "phases": {"_compile.compile_inner": 0.75}}


def test_a_child_outliving_its_session_writes_nothing_and_creates_no_spool(kid: Any, tmp_path: Path) -> None:
    """The session removed its spool (it ended): the child's record has nowhere to go, and no directory is left."""
    spool = tmp_path / "gone"
    k = kid("""
        import os
        from kidlib import fake_torch, report
        fake_torch(misses=1, hits=0, seconds=(0.5,), graphs=1)
        report(os.environ["FACTS"])
    """, spool=spool, create_spool=False)
    assert k.proc.returncode == 0 and k.proc.stderr == "", k.proc.stderr
    assert not spool.exists()


def test_the_record_holds_no_argv_and_no_environment(kid: Any) -> None:
    k = kid("""
        from kidlib import fake_torch
        fake_torch()
    """, env={"SECRET_TOKEN": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET}, args=(SECRET,))
    [name] = k.files()
    raw = (k.spool / name).read_text()
    assert SECRET not in raw
    assert set(json.loads(raw)) == RECORD_KEYS


@pytest.mark.parametrize(("value", "expected"), [
    ("0", 0), ("7", 7), ("1000000", 1_000_000), ("1000001", None), ("-1", None), ("1e3", None), (" 2", None),
    ("0x1", None), ("", None), ("\u0663", None), ("12345678", None), (SECRET, None),
])
def test_rank_fields_are_small_non_negative_integers_or_null(
        value: str, expected: int | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "kidlib.py").write_text(KIDLIB)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = sys.modules.get("torch._dynamo.utils")
    import kidlib  # type: ignore[import-not-found]

    try:
        kidlib.fake_torch()
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.setenv(name, value)
        record = childhook.collect()
    finally:
        if saved is None:
            sys.modules.pop("torch._dynamo.utils", None)
        else:
            sys.modules["torch._dynamo.utils"] = saved
        sys.modules.pop("kidlib", None)
    assert record is not None
    assert (record["rank"], record["local_rank"], record["world_size"]) == (expected, expected, expected)


def test_a_child_that_never_imports_torch_writes_nothing(kid: Any) -> None:
    k = kid("import json; json.dumps({})")
    assert k.proc.returncode == 0 and k.files() == []


def test_a_child_that_loaded_torch_but_compiled_nothing_writes_nothing(kid: Any) -> None:
    k = kid("""
        from kidlib import fake_torch
        fake_torch(misses=0, seconds=(), graphs=0)
    """)
    assert k.proc.returncode == 0 and k.files() == []


def test_disarm_writes_nothing(kid: Any) -> None:
    code = """
        import sys
        from kidlib import fake_torch
        fake_torch()
        if sys.argv[1:] == ["disarm"]:
            import pytest_megacache.children.hook
            pytest_megacache.children.hook.disarm()
    """
    armed = kid(code)
    assert len(armed.files()) == 1
    for path in armed.spool.iterdir():
        path.unlink()
    disarmed = kid(code, args=("disarm",))
    assert disarmed.proc.returncode == 0 and disarmed.files() == []


def test_bootstrap_arms_a_process_once(kid: Any) -> None:
    """bootstrap() arms an interpreter that skipped the .pth (python -S); with the .pth armed too, one record."""
    code = """
        import pytest_megacache.children.hook as c
        from kidlib import fake_torch
        fake_torch()
        c.bootstrap()
        c.bootstrap()
    """
    both = kid(code)
    assert both.proc.returncode == 0, both.proc.stderr
    assert len(both.records()) == 1
    for path in both.spool.iterdir():
        path.unlink()
    package_root = str(Path(childhook.__file__).resolve().parents[2])
    no_site = kid(f"import sys; sys.path.insert(0, {package_root!r})\n" + textwrap.dedent(code),
                  interpreter=(sys.executable, "-S"))
    assert no_site.proc.returncode == 0, no_site.proc.stderr
    assert len(no_site.records()) == 1


def test_the_spool_is_the_one_set_at_start(kid: Any, tmp_path: Path) -> None:
    """A child that points the variable elsewhere (for its own children) still writes into its own spool."""
    k = kid(f"""
        import os
        from kidlib import fake_torch
        fake_torch()
        os.environ["{SPOOL_ENV}"] = {str(tmp_path / "other")!r}
    """)
    assert len(k.records()) == 1
    assert not (tmp_path / "other").exists()


def test_a_relative_spool_writes_nothing(kid: Any, tmp_path: Path) -> None:
    k = kid("""
        from kidlib import fake_torch
        fake_torch()
    """, spool="relative-spool")
    assert k.proc.returncode == 0
    assert not (tmp_path / "relative-spool").exists()


def test_a_child_of_a_child_writes_its_own_record(kid: Any, tmp_path: Path) -> None:
    k = kid("""
        import json, os, subprocess, sys
        from kidlib import fake_torch, report
        fake_torch(misses=1)
        grandchild = "from kidlib import fake_torch, report; fake_torch(misses=0, hits=5); report(sys.argv[1])"
        subprocess.run([sys.executable, "-c", "import sys; " + grandchild, os.environ["FACTS"] + ".gc"], check=True)
        with open(os.environ["FACTS"] + ".gc") as fh:
            report(os.environ["FACTS"], grandchild=json.load(fh))
    """)
    assert k.proc.returncode == 0, k.proc.stderr
    by_pid = {r.pid: r for r in k.records()}
    assert set(by_pid) == {k.facts["pid"], k.facts["grandchild"]["pid"]}
    child, grandchild = by_pid[k.facts["pid"]], by_pid[k.facts["grandchild"]["pid"]]
    assert (child.ppid, grandchild.ppid) == (os.getpid(), child.pid)
    assert (child.counters["fxgraph_cache_miss"], grandchild.counters["fxgraph_cache_hit"]) == (1, 5)


def test_a_multiprocessing_spawn_child_writes_a_record(kid: Any) -> None:
    """A spawn child ends in sys.exit() after multiprocessing's own exit function: atexit handlers still run."""
    k = kid("""
        import multiprocessing, os
        import kidlib
        p = multiprocessing.get_context("spawn").Process(target=kidlib.spawned, args=(os.environ["FACTS"] + ".sp",))
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
        kidlib.report(os.environ["FACTS"], spawned=p.pid)
    """)
    assert k.proc.returncode == 0, k.proc.stderr
    [record] = k.records()  # the launcher loaded no torch: it writes nothing
    assert (record.pid, record.ppid) == (k.facts["spawned"], k.facts["pid"])
    assert record.counters["fxgraph_cache_hit"] == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_writes_nothing(kid: Any) -> None:
    """Out of scope (its counters began as its parent's): even one that ends through interpreter shutdown."""
    k = kid("""
        import os
        from kidlib import fake_torch, report
        fake_torch()
        child = os.fork()
        if child:
            _, status = os.waitpid(child, 0)
            report(os.environ["FACTS"], status=status)
    """)
    assert k.proc.returncode == 0 and k.facts["status"] == 0, k.proc.stderr
    [record] = k.records()
    assert record.pid == k.facts["pid"]


def test_a_sigkilled_child_writes_nothing(kid: Any) -> None:
    k = kid("""
        import os, signal
        from kidlib import fake_torch
        fake_torch()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert k.proc.returncode == -signal.SIGKILL
    assert k.files() == []


def test_a_child_killed_while_writing_leaves_nothing_read_spool_sees(kid: Any) -> None:
    k = kid("""
        import os, signal
        from kidlib import fake_torch
        fake_torch()
        os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # dies between write and rename
    """)
    assert k.proc.returncode == -signal.SIGKILL
    [leftover] = k.files()
    assert leftover.startswith(".") and leftover.endswith(".tmp")
    assert (k.spool / leftover).stat().st_size > 0
    assert read_spool(k.spool) == ([], [])


FAILURES = {
    # the spool's parent is a regular file: makedirs fails
    "unwritable-spool": ("", "{tmp}/a-file/spool"),
    # torch's counters object raises a BaseException that is not an Exception
    "counters-raise-systemexit": ("""
        class Evil(dict):
            def get(self, *args):
                raise SystemExit(99)
        fake_torch(counters=Evil())
    """, None),
    "counters-raise-keyboardinterrupt": ("""
        class Evil(dict):
            def get(self, *args):
                raise KeyboardInterrupt
        fake_torch(counters=Evil())
    """, None),
    # the rename fails after the temporary file was written: it is removed
    "rename-fails": ("""
        def broken(*args):
            raise SystemExit(99)
        os.replace = broken
    """, None),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("exit_code", [0, 7])
def test_a_failing_hook_changes_neither_exit_status_nor_stderr(
        kid: Any, tmp_path: Path, failure: str, exit_code: int) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    setup, spool = FAILURES[failure]
    code = "import os, sys\nfrom kidlib import fake_torch\nfake_torch()\n" + textwrap.dedent(setup)
    if exit_code:
        code += f"\nsys.exit({exit_code})\n"
    k = kid(code, spool=spool.format(tmp=tmp_path) if spool else tmp_path / "spool")
    assert (k.proc.returncode, k.proc.stderr) == (exit_code, "")
    assert k.files() == []  # nor any temporary file left behind


def test_a_failing_hook_armed_by_bootstrap_is_silent_too(kid: Any) -> None:
    """Without the .pth line's own guard around it (python -S), exit_handler alone keeps a SystemExit in."""
    package_root = str(Path(childhook.__file__).resolve().parents[2])
    k = kid(f"""
        import sys
        sys.path.insert(0, {package_root!r})
        import pytest_megacache.children.hook as c
        from kidlib import fake_torch
        class Evil(dict):
            def get(self, *args):
                raise SystemExit(99)
        fake_torch(counters=Evil())
        c.bootstrap()
        sys.exit(7)
    """, interpreter=(sys.executable, "-S"))
    assert (k.proc.returncode, k.proc.stderr) == (7, "")


class _Raising(dict[str, Any]):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def get(self, *args: Any) -> Any:
        raise self.exc


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), GeneratorExit(), MemoryError(), RuntimeError()],
                         ids=lambda e: type(e).__name__)
def test_exit_handler_lets_no_exception_out(exc: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = type(sys)("torch._dynamo.utils")
    fake.counters = _Raising(exc)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", fake)
    monkeypatch.setattr(childhook, "_done", False)
    monkeypatch.setattr(childhook, "_disarmed", False)
    childhook.exit_handler(os.getpid(), os.getppid(), str(tmp_path / "spool"))  # returns, whatever happens inside
    assert not (tmp_path / "spool").exists()


def test_the_hook_imports_no_torch_pytest_or_boto3(kid: Any) -> None:
    """At import and in the exit handler. A finder at the front of sys.meta_path notes any attempt, up to the
    handler's run (it runs last: registered at interpreter start)."""
    k = kid("""
        import atexit, os, sys
        FORBIDDEN = ("torch", "pytest", "_pytest", "boto3", "botocore", "pluggy")
        class Tripwire:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in FORBIDDEN:
                    with open(os.environ["FACTS"] + ".trip", "a") as fh:
                        fh.write(name + "\\n")
                return None
        sys.meta_path.insert(0, Tripwire())
        import pytest_megacache.children.hook as c
        from kidlib import fake_torch, report
        fake_torch()
        assert c.collect() is not None
        c.read_spool(os.environ["FACTS"] + ".nowhere")
        report(os.environ["FACTS"], loaded=sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN))
    """)
    assert k.proc.returncode == 0, k.proc.stderr
    assert k.facts["loaded"] == ["torch._dynamo.utils"]  # the fake one
    assert len(k.records()) == 1  # the handler ran with the tripwire in place
    assert not Path(str(k.spool.parent / "facts.json") + ".trip").exists()


# --- the reader -----------------------------------------------------------------------------------------------------
def _dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


HOSTILE: dict[str, tuple[bytes, str]] = {
    "huge": (b'{"v": 1, "pad": "' + b"x" * MAX_RECORD_BYTES + b'"}', "larger than"),
    "not-json": (f"{SECRET} {{".encode(), "not JSON"),
    "empty": (b"", "not JSON"),
    "not-utf8": (b'{"v": 1, "x": "\xff\xfe"}', "not UTF-8"),
    "array": (_dumps([SECRET]), "not a JSON object"),
    "nested": (b"[" * 8000 + b"]" * 8000, "not JSON"),
    "no-version": (_dumps({k: v for k, v in valid_doc().items() if k != "v"}), "version"),
    "version-1": (_dumps(valid_doc(v=1)), "version"),
    "version-3": (_dumps(valid_doc(v=3)), "version"),
    "version-true": (_dumps(valid_doc(v=True)), "version"),
    "version-float": (_dumps(valid_doc(v=2.0)), "version"),
    "unknown-key": (_dumps(valid_doc(argv=[SECRET])), "1 unknown and 0 missing keys"),
    "missing-key": (_dumps({k: v for k, v in valid_doc().items() if k != "graphs"}), "0 unknown and 1 missing"),
    "duplicate-key": (b'{"v": 1, "v": 1}', "a key given twice"),
    "pid-string": (_dumps(valid_doc(pid="4242")), "pid is not an integer"),
    "pid-bool": (_dumps(valid_doc(pid=True)), "pid is not an integer"),
    "pid-huge": (_dumps(valid_doc(pid=2**40)), "pid is not an integer"),
    "graphs-huge": (_dumps(valid_doc(graphs=10**30)), "graphs is not an integer"),
    "compiles-negative": (_dumps(valid_doc(compiles=-1)), "compiles is not an integer"),
    "rank-negative": (_dumps(valid_doc(rank=-1)), "rank is not an integer"),
    "rank-huge": (_dumps(valid_doc(world_size=10**7)), "world_size is not an integer"),
    "rank-string": (_dumps(valid_doc(local_rank="0")), "local_rank is not an integer"),
    "compiled-int": (_dumps(valid_doc(compiled=1)), "compiled is not true or false"),
    "seconds-nan": (b'{"v": 1, "compile_seconds": NaN}', "NaN or Infinity"),
    "seconds-infinity": (_dumps(valid_doc()).replace(b'"compile_seconds": 1.5', b'"compile_seconds": -Infinity'),
                         "NaN or Infinity"),
    "seconds-overflow": (_dumps(valid_doc()).replace(b'"compile_seconds": 1.5', b'"compile_seconds": 1e400'),
                         "compile_seconds"),
    "seconds-negative": (_dumps(valid_doc(compile_seconds=-0.5)), "compile_seconds"),
    "seconds-string": (_dumps(valid_doc(compile_seconds="1.5")), "compile_seconds"),
    "counters-list": (_dumps(valid_doc(counters=[1, 2])), "counters is not an object"),
    "isa-run-negative": (_dumps(valid_doc(isa_run=-1)), "isa_run is not an integer"),
    "isa-reused-float": (_dumps(valid_doc(isa_reused=1.5)), "isa_reused is not an integer"),
    "isa-seconds-string": (_dumps(valid_doc(isa_seconds="0.1")), "isa_seconds is not a number"),
    "phases-list": (_dumps(valid_doc(phases=[1.5])), "phases is not an object"),
    "phases-odd-name": (_dumps(valid_doc(phases={SECRET + " /x": 1.0})), "phases is not an object"),
    "phases-too-many": (_dumps(valid_doc(phases={f"p{i}": 1.0 for i in range(13)})), "phases is not an object"),
    "phase-negative": (_dumps(valid_doc(phases={"compile_fx": -1.0})), "a phase is not a number"),
    "phase-string": (_dumps(valid_doc(phases={"compile_fx": "1"})), "a phase is not a number"),
    "counter-unknown": (_dumps(valid_doc(counters={SECRET: 1})), "1 unknown counter names"),
    "counter-negative": (_dumps(valid_doc(counters={"fxgraph_cache_hit": -1})), "a counter is not an integer"),
    "counter-float": (_dumps(valid_doc(counters={"fxgraph_cache_hit": 1.5})), "a counter is not an integer"),
    "counter-null": (_dumps(valid_doc(counters={"fxgraph_cache_hit": None})), "a counter is not an integer"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_read_spool_rejects_a_hostile_file_and_keeps_the_good_one(tmp_path: Path, case: str) -> None:
    data, reason = HOSTILE[case]
    spool = tmp_path / "spool"
    write_doc(spool, "1-good.json", valid_doc())
    write_doc(spool, f"2-{case}.json", data)
    records, rejects = read_spool(spool)
    assert [r.file for r in records] == ["1-good.json"]
    assert len(rejects) == 1 and rejects[0].startswith(f"2-{case}.json: ") and reason in rejects[0], rejects
    assert SECRET not in rejects[0] and len(rejects[0]) < 120


def _with_timeout(fn: Any, *args: Any) -> Any:
    """Run ``fn`` in a thread: a read that blocks fails the test instead of hanging it."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(10)
    assert out, "read_spool blocked"
    return out[0]


def test_read_spool_rejects_what_is_not_a_regular_file(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    good = write_doc(spool, "1-good.json", valid_doc())
    (spool / "2-link.json").symlink_to(good)
    (spool / "3-dangling.json").symlink_to(tmp_path / "nowhere")
    os.mkfifo(spool / "4-fifo.json")
    (spool / "5-dir.json").mkdir()
    records, rejects = _with_timeout(read_spool, spool)
    assert [r.file for r in records] == ["1-good.json"]
    assert rejects == ["2-link.json: a symbolic link", "3-dangling.json: a symbolic link",
                       "4-fifo.json: not a regular file", "5-dir.json: not a regular file"]


def test_read_spool_skips_files_being_written_and_other_names(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    write_doc(spool, ".123-abcdef.tmp", b'{"v": 1, "half": ')
    write_doc(spool, ".hidden.json", b"garbage")
    write_doc(spool, "notes.txt", b"garbage")
    write_doc(spool, "123.json.tmp", b"garbage")
    assert read_spool(spool) == ([], [])


def test_read_spool_shows_odd_file_names_escaped(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    write_doc(spool, "evil\x1b[31m\nname.json", b"garbage")
    [], [reason] = read_spool(spool)
    assert reason.startswith("'evil\\x1b[31m\\nname.json': ") and "\n" not in reason and "\x1b" not in reason


def test_read_spool_reads_at_most_max_files(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    data = _dumps(valid_doc())
    for i in range(MAX_FILES + 3):
        write_doc(spool, f"{i:05d}-x.json", data)
    records, rejects = read_spool(spool)
    assert len(records) == MAX_FILES and records[-1].file == f"{MAX_FILES - 1:05d}-x.json"
    assert rejects == [f"3 more record files not read (at most {MAX_FILES})"]


def test_read_spool_on_a_missing_spool_or_a_file(tmp_path: Path) -> None:
    assert read_spool(tmp_path / "missing") == ([], [])
    (tmp_path / "file").write_text("x")
    records, rejects = read_spool(tmp_path / "file")
    assert records == [] and rejects == ["spool: cannot list (NotADirectoryError)"]


def test_read_spool_never_raises_on_mangled_records(tmp_path: Path) -> None:
    rng = random.Random(1234)
    base = _dumps(valid_doc())
    spool = tmp_path / "spool"
    n = 400
    for i in range(n):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            op, at = rng.randrange(3), rng.randrange(len(data))
            if op == 0:
                data[at] = rng.randrange(256)
            elif op == 1:
                del data[at:at + rng.randint(1, 8)]
            else:
                data[at:at] = bytes(rng.choice(b'{}[]",:-0123456789.eEtrufalsn \\') for _ in range(rng.randint(1, 4)))
        write_doc(spool, f"{i:04d}.json", bytes(data))
    records, rejects = read_spool(spool)
    assert len(records) + len(rejects) == n
    assert rejects  # the mutations do reach the validation
    for record in records:  # what passes is within bounds
        assert all(0 <= v <= 10**12 for v in record.counters.values()) and 0 <= record.compile_seconds


# --- real torch.compile children -------------------------------------------------------------------------------------
TORCH_LIB = textwrap.dedent(
    """
    import torch

    def fn(x):
        return torch.sin(x) * 3 + 1

    def compile_once():
        assert torch.compile(fn)(torch.zeros(4)).shape == (4,)
        from torch._dynamo.utils import counters
        return {name: n for group in ("inductor", "aot_autograd") for name, n in counters[group].items()}

    def spawned(rank, out):
        import json, os
        with open(out, "w") as fh:
            json.dump({"pid": os.getpid(), "counters": compile_once()}, fh)
    """
)

COMPILING_CHILD = """
import json, os, sys
import torch.multiprocessing as mp
import torchlib

counters = torchlib.compile_once()
os.environ["MEGACACHE_CHILD_SPOOL"] = sys.argv[2]  # the spawn child's own spool
mp.spawn(torchlib.spawned, args=(sys.argv[1] + ".spawned",), nprocs=1, join=True)
with open(sys.argv[1] + ".spawned") as fh:
    spawned = json.load(fh)
with open(sys.argv[1], "w") as fh:
    json.dump({"pid": os.getpid(), "counters": counters, "spawned": spawned}, fh)
"""


# After the compiling child: torch's vector-ISA decision in a child of the same session, over the records it left.
ISA_CHILD = """
import json
import torch._inductor.cpu_vec_isa as m
valid, picked = [str(isa) for isa in m.valid_vec_isa_list()], str(m.pick_vec_isa())
from pytest_megacache import isaprobe  # imported by the .pth line's start-up module at `import torch`, armed
print(json.dumps({"counts": isaprobe.counts(), "valid": valid, "picked": picked}))
"""


@dataclass
class TorchRun:
    root: Path
    facts: dict[str, Any]
    compiling: subprocess.CompletedProcess[str]
    idle: subprocess.CompletedProcess[str]
    isa: dict[str, dict[str, Any]]  # ISA_CHILD's output: "same" environment, "forced" ATEN_CPU_CAPABILITY


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> TorchRun:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    root = removed_unless_failed(request, tmp_path_factory.mktemp("torch-children"))
    (root / "torchlib.py").write_text(TORCH_LIB)
    env = child_env(None, PYTHONPATH=str(root), TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
                    TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    env.pop("TORCH_COMPILE_JOB_ID", None)
    # What a session that reuses the check sets for its children: the digest of its own decision (this one's).
    env[isaprobe.CHILD_ENV] = isaprobe.decision_digest(env)
    for spool in ("spool-compiling", "spool-spawned", "spool-idle", "spool-isa"):  # the session creates its spool (plugin.py)
        (root / spool).mkdir(mode=0o700)
    compiling = subprocess.Popen(
        [sys.executable, "-c", COMPILING_CHILD, str(root / "facts.json"), str(root / "spool-spawned")],
        env={**env, SPOOL_ENV: str(root / "spool-compiling")}, cwd=root, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # torch._dynamo (and its counters module) loaded, nothing compiled
    idle = subprocess.Popen([sys.executable, "-c", "import torch._dynamo.utils"],
                            env={**env, SPOOL_ENV: str(root / "spool-idle")}, cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = []
    for proc in (compiling, idle):
        out, err = proc.communicate(timeout=540)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    assert results[1].returncode == 0, results[1].stderr[-3000:]
    # Two more children once the records exist: the session's environment, and one that forces an ISA by itself.
    isa_env = {**env, SPOOL_ENV: str(root / "spool-isa")}
    procs = {"same": subprocess.Popen([sys.executable, "-c", ISA_CHILD], env=isa_env, cwd=root, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE),
             "forced": subprocess.Popen([sys.executable, "-c", ISA_CHILD], env={**isa_env, "ATEN_CPU_CAPABILITY": "default"},
                                        cwd=root, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)}
    isa = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        isa[name] = json.loads(out.splitlines()[-1])
    return TorchRun(root, json.loads((root / "facts.json").read_text()), results[0], results[1], isa)


@pytest.mark.torch
def test_a_real_compiling_child_writes_one_record_of_its_own_counters(torch_run: TorchRun) -> None:
    records, rejects = read_spool(torch_run.root / "spool-compiling")
    assert rejects == []
    [record] = records  # Inductor's compile workers, children of this child, loaded torch but compiled nothing
    assert record.pid == torch_run.facts["pid"] and record.ppid == os.getpid()
    assert record.counters["fxgraph_cache_miss"] > 0
    own = torch_run.facts["counters"]  # what the child read from torch itself after compiling
    for name in ("fxgraph_cache_miss", "fxgraph_cache_hit", "autograd_cache_miss", "autograd_cache_hit"):
        assert record.counters[name] == own.get(name, 0), name
    assert record.compiled and record.compiles >= 1 and record.graphs >= 1 and record.compile_seconds > 0


@pytest.mark.torch
def test_a_real_spawn_child_writes_its_own_record(torch_run: TorchRun) -> None:
    records, rejects = read_spool(torch_run.root / "spool-spawned")
    assert rejects == []
    [record] = records
    spawned = torch_run.facts["spawned"]
    assert record.pid == spawned["pid"] and record.ppid == torch_run.facts["pid"]
    # It found its parent's FX graph in the shared cache directory: its own counters say hit, not miss.
    assert record.counters["fxgraph_cache_hit"] >= 1 and record.counters["fxgraph_cache_miss"] == 0
    assert record.counters["fxgraph_cache_hit"] == spawned["counters"].get("fxgraph_cache_hit", 0)


@pytest.mark.torch
def test_real_children_run_the_isa_checks_once_and_take_the_records_after(torch_run: TorchRun) -> None:
    """The compiling child ran torch's checks (a fresh cache directory) and recorded them; its spawn child and a
    later child of the same environment took every record and ran none, and torch decided the same."""
    [compiling] = read_spool(torch_run.root / "spool-compiling")[0]
    [spawned] = read_spool(torch_run.root / "spool-spawned")[0]
    assert compiling.isa_run >= 1 and compiling.isa_reused == 0 and compiling.isa_seconds > 0, compiling
    assert (spawned.isa_run, spawned.isa_reused) == (0, compiling.isa_run), spawned
    same = torch_run.isa["same"]
    assert same["counts"] == {"reused": compiling.isa_run, "run": 0, "recorded": 0}, same
    assert same["valid"], "this CPU has no vector ISA: the comparison would prove nothing"


@pytest.mark.torch
def test_a_real_child_forcing_its_own_isa_runs_every_check_itself(torch_run: TorchRun) -> None:
    """ATEN_CPU_CAPABILITY set in the child alone: its decision digest is not the session's, so it takes no record
    (they are there: the control above took them all), runs each check as torch does, and writes no record."""
    forced, same = torch_run.isa["forced"], torch_run.isa["same"]
    assert forced["counts"] == {"reused": 0, "run": same["counts"]["reused"], "recorded": 0}, forced
    assert forced["valid"] == same["valid"] and forced["picked"] != same["picked"], (forced, same)


@pytest.mark.torch
def test_a_real_child_that_loaded_torch_dynamo_but_compiled_nothing_writes_nothing(torch_run: TorchRun) -> None:
    assert torch_run.idle.returncode == 0, torch_run.idle.stderr
    assert list((torch_run.root / "spool-idle").iterdir()) == []


# --- the session's side: the spool the plugin opens, reads and removes ------------------------------------------
def test_a_spool_sets_the_variable_and_puts_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_megacache.children.hook import Spool

    monkeypatch.setenv(SPOOL_ENV, "/outer/session/spool")
    spool = Spool()
    assert os.environ[SPOOL_ENV] == spool.path and stat.S_IMODE(os.stat(spool.path).st_mode) == 0o700
    spool.close()
    spool.close()  # idempotent
    assert os.environ[SPOOL_ENV] == "/outer/session/spool" and not os.path.exists(spool.path)
    monkeypatch.delenv(SPOOL_ENV)
    spool = Spool()
    spool.close()
    assert SPOOL_ENV not in os.environ


SESSION_TESTS = textwrap.dedent(
    """
    import os, subprocess, sys, textwrap
    from pathlib import Path

    def test_a_child_compiles():
        Path(os.environ["SEEN_SPOOL"]).write_text(os.environ["MEGACACHE_CHILD_SPOOL"])
        code = "from kidlib import fake_torch; fake_torch(misses=1, hits=0, seconds=(0.5,), graphs=1)"
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.environ["KIDLIB"]})

    def test_garbage_in_the_spool():
        if os.environ.get("GARBAGE"):
            Path(os.environ["MEGACACHE_CHILD_SPOOL"], "1-0123456789abcdef.json").write_text("{not json")
    """
)


@pytest.mark.parametrize("garbage", [False, True])
def test_a_session_reads_its_childrens_records_and_removes_its_spool(pytester: pytest.Pytester, tmp_path: Path,
                                                                     garbage: bool) -> None:
    """The parent never imports torch here, and its child fakes torch's counters without importing torch (so it never
    asks for the cache): the summary says the child compiled and that nothing was restored or stored for it; a
    garbled record is one problem. (Children that import torch: test_children.py and test_child_wait.py, beside
    this file.)"""
    (tmp_path / "kidlib.py").write_text(KIDLIB)
    pytester.makepyfile(test_kids=SESSION_TESTS)
    seen = tmp_path / "seen"
    env = {"MEGACACHE_DIR": str(tmp_path / "store"), "SEEN_SPOOL": str(seen), "KIDLIB": str(tmp_path),
           "MEGACACHE_REPORT": str(tmp_path / "report.json"), "GARBAGE": "1" if garbage else ""}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv(SPOOL_ENV, raising=False)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v")  # -v: the summary's notes
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*1 child process(es) compiled without asking for this session's cache*"])
    spool = Path(seen.read_text())
    assert spool.is_absolute() and not spool.exists()  # removed at the end
    report = json.loads((tmp_path / "report.json").read_text())
    refused = [p for p in report["problems"] if "child-process record(s) refused" in p]
    assert len(refused) == (1 if garbage else 0), report["problems"]
    if garbage:
        assert "1-0123456789abcdef.json" in refused[0] and "not json" not in refused[0]
