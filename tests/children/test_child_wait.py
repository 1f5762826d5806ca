"""A child process waits, when it imports torch, until its parent's restore has settled (childstart, from the .pth line).

Real interpreters, started as a test's child is: the installed ``.pth`` line runs at their start. A tiny ``torch``
package on PYTHONPATH stands in for torch: the wait is on the name, before anything of torch runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pytest_megacache.children import hook as childhook
from pytest_megacache.children.hook import READY_ENV, SPOOL_ENV, WAIT_ENV, WANTED_SUFFIX, RestoreSignal

CHILD = "import time; t = time.time(); import {module}; print(round(time.time() - t, 3))"


@pytest.fixture
def fake_torch(tmp_path: Path) -> Path:
    lib = tmp_path / "lib"
    (lib / "torch").mkdir(parents=True)
    (lib / "torch" / "__init__.py").write_text("")
    (lib / "other.py").write_text("")
    return lib


def run_child(lib: Path, env: dict[str, str], module: str = "torch") -> float:
    full = {k: v for k, v in os.environ.items() if k not in (SPOOL_ENV, READY_ENV, WAIT_ENV)}
    full.update(env, PYTHONPATH=str(lib))
    out = subprocess.run([sys.executable, "-c", CHILD.format(module=module)], env=full, capture_output=True, text=True,
                         check=True, timeout=60)
    return float(out.stdout.strip())


def test_a_child_importing_torch_asks_for_the_restore_and_waits(fake_torch: Path, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    requested: list[float] = []

    def restore_settles_a_second_after_the_request() -> None:  # what the plugin's restore does, slowly
        requested.append(time.monotonic())
        threading.Timer(1.0, signal.set).start()

    signal = RestoreSignal(str(spool), 30, restore_settles_a_second_after_the_request)
    try:
        env = {SPOOL_ENV: str(spool), READY_ENV: os.environ[READY_ENV], WAIT_ENV: os.environ[WAIT_ENV]}
        waited = run_child(fake_torch, env)
        # The child's import asked (nothing else sets the signal) and waited until the restore settled: at least
        # the second after its request, far less than its 30 s limit (what a child that never asked would wait).
        assert len(requested) == 1
        assert 1.0 <= waited < 20, waited
        assert run_child(fake_torch, env) < 10  # settled: no wait (a wait would be the 30 s limit)
        assert len(requested) == 1  # asked once
    finally:
        signal.close()
    assert sorted(os.listdir(spool)) == []  # the signal and the request are gone


def test_a_child_that_does_not_import_torch_never_waits_nor_asks(fake_torch: Path, tmp_path: Path) -> None:
    ready = tmp_path / "never"
    env = {SPOOL_ENV: str(tmp_path), READY_ENV: str(ready), WAIT_ENV: "30"}
    start = time.monotonic()
    assert run_child(fake_torch, env, module="other") < 10  # a wait would be the 30 s limit
    assert time.monotonic() - start < 10
    assert not Path(str(ready) + WANTED_SUFFIX).exists()


def test_the_wait_ends_at_its_limit(fake_torch: Path, tmp_path: Path) -> None:
    env = {SPOOL_ENV: str(tmp_path), READY_ENV: str(tmp_path / "never"), WAIT_ENV: "1"}
    waited = run_child(fake_torch, env)
    assert 0.8 <= waited < 5, waited
    assert run_child(fake_torch, {**env, WAIT_ENV: "0"}) < 10  # no limit would be the 60 s timeout here
    garbled = {**env, WAIT_ENV: "soon"}  # the .pth line never raises: no wait, the child goes on
    assert run_child(fake_torch, garbled) < 10


def test_the_wait_is_off_the_meta_path_before_torch_runs(fake_torch: Path, tmp_path: Path) -> None:
    """One finder at the front of sys.meta_path from the start (the .pth line may run twice: one all the same), gone
    by the time torch's own code runs."""
    count = "[getattr(f, '__name__', '') for f in sys.meta_path].count('MegacacheRestoreWait')"
    (fake_torch / "torch" / "__init__.py").write_text(f"import sys\nprint({count})\n")
    (tmp_path / "ready").touch()
    full = {k: v for k, v in os.environ.items() if k not in (SPOOL_ENV, READY_ENV, WAIT_ENV)}
    full.update({SPOOL_ENV: str(tmp_path), READY_ENV: str(tmp_path / "ready"), WAIT_ENV: "30"},
                PYTHONPATH=str(fake_torch))
    code = f"import sys; print({count}, getattr(sys.meta_path[0], '__name__', '')); import torch; print({count})"
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["1", "MegacacheRestoreWait", "0", "0"]


def test_without_a_spool_the_line_is_inert(fake_torch: Path, tmp_path: Path) -> None:
    env = {READY_ENV: str(tmp_path / "never"), WAIT_ENV: "30"}
    assert run_child(fake_torch, env) < 10  # a wait would be the 30 s limit
    assert not (tmp_path / ("never" + WANTED_SUFFIX)).exists()


def test_restore_signal_sets_and_restores_the_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(READY_ENV, "outer")
    monkeypatch.delenv(WAIT_ENV, raising=False)
    calls: list[int] = []
    signal = RestoreSignal(str(tmp_path), 12.5, lambda: calls.append(1))
    assert os.environ[READY_ENV] == signal.path and os.environ[WAIT_ENV] == "12.5"
    assert Path(signal.path).parent == tmp_path and not Path(signal.path).exists()
    signal.set()
    assert Path(signal.path).is_file()
    assert not any(name.endswith(childhook.RECORD_SUFFIX) for name in os.listdir(tmp_path))  # not read as a record
    Path(signal.path + WANTED_SUFFIX).touch()  # a request after the restore settled: nothing more to start
    time.sleep(5 * RestoreSignal.POLL)
    assert calls == []
    signal.close()
    assert os.environ[READY_ENV] == "outer" and WAIT_ENV not in os.environ
    assert os.listdir(tmp_path) == []
    signal.close()  # idempotent


def test_the_retired_children_flag_is_accepted_with_a_note(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--megacache-dir", str(pytester.path / "store"),
                                           "--megacache-children", "-v")  # -v: the summary's notes
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*--megacache-children (MEGACACHE_CHILDREN) is no longer needed*"])
    assert not (pytester.path / "store").exists()  # still nothing restored or stored: nothing imported torch
