"""The reuse of torch's CPU vector-ISA load check (pytest_megacache/isaprobe.py).

Most tests drive :class:`ProbeProxy` with real child processes and a template of the two forms torch has used
(torch <= 2.12: ``check_call`` and ``import torch`` in the child; torch 2.13: ``run`` without it), with a stand-in
for torch's build identity, so they need no torch. The ``torch`` test compares what real torch decides (valid
ISAs, the pick, its compile flags) in fresh processes without the reuse, recording, and reusing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pytest_megacache import isaprobe
from pytest_megacache.isaprobe import MARKER_SUFFIX, ProbeProxy

from .helpers_torch import skip_without_torch

# The child reads the library (so a missing one fails, as a dlopen would) and exits 0.
OLD_FORM = '\nimport sys\nopen("__lib_path__", "rb").read()\n'  # torch <= 2.12 used check_call
NEW_FORM = '\nimport sys\nif sys.platform != "linux":\n    pass\nopen("__lib_path__", "rb").read()\n'  # 2.13: run


class CountingSubprocess(ModuleType):
    """A stand-in for the subprocess module that counts the calls it passes to the real one."""

    def __init__(self) -> None:
        super().__init__("subprocess")
        self.calls: list[list[str]] = []
        self.CompletedProcess = subprocess.CompletedProcess
        self.CalledProcessError = subprocess.CalledProcessError
        self.DEVNULL = subprocess.DEVNULL
        self.TimeoutExpired = subprocess.TimeoutExpired

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(list(args[0] if args else kwargs["args"]))
        return subprocess.run(*args, **kwargs)

    def check_call(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(list(args[0] if args else kwargs["args"]))
        return subprocess.check_call(*args, **kwargs)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isaprobe, "_torch_build", lambda: ["2.99.0", "abc123", "/opt/torch", [("libtorch_cpu.so", 7)]])
    isaprobe.reset_counts()


def library(tmp_path: Path, data: bytes = b"\x7fELF a probe library") -> str:
    path = tmp_path / "ab" / "cabcdef.so"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def marker(lib: str) -> Path:
    """The record written for ``lib`` (exactly one)."""
    found = list(Path(lib).parent.glob(Path(lib).name + ".*" + MARKER_SUFFIX))
    assert len(found) == 1, found
    return found[0]


def check(proxy: ProbeProxy, template: str, lib: str, *, old: bool) -> Any:
    """What torch's check does: the exact command, its keyword arguments, its way of failing."""
    argv = [sys.executable, "-c", template.replace("__lib_path__", lib)]
    if old:
        return proxy.check_call(argv, cwd=os.path.dirname(lib), stderr=subprocess.DEVNULL)
    return proxy.run(argv, stderr=subprocess.DEVNULL, timeout=60, check=True)


@pytest.mark.parametrize("old", [True, False], ids=["check_call-torch<=2.12", "run-torch2.13"])
def test_a_successful_check_runs_once_then_is_taken_from_its_record(tmp_path: Path, old: bool) -> None:
    template = OLD_FORM if old else NEW_FORM
    real = CountingSubprocess()
    lib = library(tmp_path)
    first = check(ProbeProxy(real, template), template, lib, old=old)
    assert len(real.calls) == 1 and marker(lib).is_file()
    assert isaprobe.counts() == {"reused": 0, "run": 1, "recorded": 1}
    ran = isaprobe.check_seconds()
    assert ran > 0  # a child process's seconds: the per-process table's isa_check phase
    # A new process (a new proxy, the identity computed again): the record stands for the check.
    isaprobe.reset_counts()
    assert isaprobe.check_seconds() == 0.0
    second = check(ProbeProxy(real, template), template, lib, old=old)
    assert len(real.calls) == 1  # no child this time
    assert isaprobe.counts() == {"reused": 1, "run": 0, "recorded": 0}
    assert 0 < isaprobe.check_seconds() < ran  # reading a record and hashing a library, no child
    if old:
        assert first == second == 0
    else:
        assert first.returncode == second.returncode == 0


def test_the_record_holds_hashes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/s3cr3t-Value-0123456789")
    lib = library(tmp_path)
    check(ProbeProxy(CountingSubprocess(), OLD_FORM), OLD_FORM, lib, old=True)
    text = marker(lib).read_text()
    assert "s3cr3t" not in text and "/opt" not in text
    assert set(json.loads(text)) == {"v", "library_sha256", "library_bytes", "loader"}


def _changes() -> list[tuple[str, Any]]:
    def other_library(lib: str, mp: pytest.MonkeyPatch) -> None:
        Path(lib).write_bytes(b"\x7fELF another library")

    def other_torch(lib: str, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(isaprobe, "_torch_build", lambda: ["2.99.1", "abc124", "/opt/torch", [("libtorch_cpu.so", 7)]])

    def other_libtorch(lib: str, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(isaprobe, "_torch_build", lambda: ["2.99.0", "abc123", "/opt/torch", [("libtorch_cpu.so", 8)]])

    def other_loader_env(lib: str, mp: pytest.MonkeyPatch) -> None:
        mp.setenv("LD_PRELOAD", "/usr/lib/libfoo.so")

    def other_cpu(lib: str, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(isaprobe, "_cpu_flags", lambda: "avx2 fma sse4_2")

    def other_python(lib: str, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(isaprobe.sys, "version", sys.version + " (another build)")

    def tampered(lib: str, mp: pytest.MonkeyPatch) -> None:
        path = marker(lib)
        path.write_text(json.dumps({**json.loads(path.read_text()), "extra": 1}))

    def newer_version(lib: str, mp: pytest.MonkeyPatch) -> None:
        path = marker(lib)
        path.write_text(json.dumps({**json.loads(path.read_text()), "v": 2}))

    def not_json(lib: str, mp: pytest.MonkeyPatch) -> None:
        marker(lib).write_bytes(b"\xff{not json")

    def too_big(lib: str, mp: pytest.MonkeyPatch) -> None:
        path = marker(lib)
        path.write_text(path.read_text() + " " * isaprobe.MAX_MARKER_BYTES)

    def a_link(lib: str, mp: pytest.MonkeyPatch) -> None:
        path = marker(lib)
        real = path.with_name("elsewhere.json")
        path.rename(real)
        path.symlink_to(real)

    def copied_from_another_library(lib: str, mp: pytest.MonkeyPatch) -> None:
        Path(lib).write_bytes(b"\x7fELF another library")  # the record stays, for the library before

    def renamed_for_another_cpu(lib: str, mp: pytest.MonkeyPatch) -> None:
        old = marker(lib)
        mp.setattr(isaprobe, "_cpu_flags", lambda: "avx2 fma sse4_2")
        isaprobe.reset_counts()
        old.rename(isaprobe.marker_path(lib, OLD_FORM))  # the name fits, the content does not

    return [(f.__name__, f) for f in (other_library, other_torch, other_libtorch, other_loader_env, other_cpu,
                                      other_python, tampered, newer_version, not_json, too_big, a_link,
                                      copied_from_another_library, renamed_for_another_cpu)]


@pytest.mark.parametrize("change", [f for _, f in _changes()], ids=[n for n, _ in _changes()])
def test_anything_else_runs_the_check_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    real = CountingSubprocess()
    lib = library(tmp_path)
    check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True)
    assert len(real.calls) == 1
    change(lib, monkeypatch)
    isaprobe.reset_counts()  # a new process
    check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True)
    assert len(real.calls) == 2
    assert isaprobe.counts()["run"] == 1 and isaprobe.counts()["reused"] == 0


def test_the_same_checkout_in_another_folder_takes_the_records_made_in_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths below the current directory (the project on PYTHONPATH, a virtual environment inside the checkout) count
    relative to it; a path outside it, or another relative place, is another loader."""
    first, second = tmp_path / "a" / "repo", tmp_path / "runner" / "_work" / "repo" / "repo"

    def identity(cwd: Path, pythonpath: str) -> str:
        with monkeypatch.context() as mp:
            mp.chdir(cwd)
            mp.setenv("PYTHONPATH", pythonpath)
            mp.setattr(isaprobe.sys, "executable", str(cwd / ".venv" / "bin" / "python"))
            return isaprobe.loader_identity(OLD_FORM)

    for folder in (first, second):
        folder.mkdir(parents=True)
    here = identity(first, f"{first}{os.pathsep}{first / 'src'}")
    assert identity(second, f"{second}{os.pathsep}{second / 'src'}") == here
    assert identity(second, f"{second / 'lib'}{os.pathsep}{second / 'src'}") != here
    assert identity(second, f"{first}{os.pathsep}{first / 'src'}") != here  # the first folder's files, from elsewhere
    assert isaprobe._where("/opt/torch", str(first)) == "/opt/torch"
    assert isaprobe._where(str(first.parent / "repo2"), str(first)) == str(first.parent / "repo2")


def test_records_of_two_kinds_of_machine_live_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = CountingSubprocess()
    lib = library(tmp_path)
    check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True)
    with monkeypatch.context() as mp:
        mp.setattr(isaprobe, "_cpu_flags", lambda: "avx2 fma sse4_2")
        isaprobe.reset_counts()
        check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True)
    assert len(list(tmp_path.rglob("*" + MARKER_SUFFIX))) == 2
    isaprobe.reset_counts()  # back on the first kind: its record is still there
    check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True)
    assert len(real.calls) == 2 and isaprobe.counts()["reused"] == 1


@pytest.mark.parametrize("old", [True, False], ids=["check_call", "run"])
def test_a_failed_check_is_never_recorded_nor_skipped(tmp_path: Path, old: bool) -> None:
    template = OLD_FORM if old else NEW_FORM
    real = CountingSubprocess()
    (tmp_path / "ab").mkdir()
    missing = str(tmp_path / "ab" / "cmissing.so")  # the child fails to read it
    for _ in range(2):
        with pytest.raises(subprocess.CalledProcessError):
            check(ProbeProxy(real, template), template, missing, old=old)
    assert len(real.calls) == 2
    assert not list(tmp_path.rglob("*" + MARKER_SUFFIX))
    # run() without check=True: a non-zero exit is returned, and not recorded either.
    lib = library(tmp_path)
    argv = [sys.executable, "-c", "import sys; sys.exit(3)  # " + template.replace("__lib_path__", lib)]
    result = ProbeProxy(real, "import sys; sys.exit(3)  # " + template).run(argv)
    assert result.returncode == 3 and not list(tmp_path.rglob("*" + MARKER_SUFFIX))


@pytest.mark.parametrize("argv", [
    pytest.param(lambda lib: ["/usr/bin/python3-other", "-c", OLD_FORM.replace("__lib_path__", lib)], id="interpreter"),
    pytest.param(lambda lib: [sys.executable, "-c", OLD_FORM.replace("__lib_path__", lib), "x"], id="extra-arg"),
    pytest.param(lambda lib: [sys.executable, "-I", OLD_FORM.replace("__lib_path__", lib)], id="not-dash-c"),
    pytest.param(lambda lib: [sys.executable, "-c", "print(1)\n" + OLD_FORM.replace("__lib_path__", lib)],
                 id="other-code"),
    pytest.param(lambda lib: [sys.executable, "-c", OLD_FORM.replace("__lib_path__", "ab/cabcdef.so")],
                 id="relative-path"),
    pytest.param(lambda lib: " ".join([sys.executable, "-c", "pass"]), id="a-string"),
])
def test_other_calls_pass_through_untouched(tmp_path: Path, argv: Any) -> None:
    class Real(CountingSubprocess):
        def check_call(self, *args: Any, **kwargs: Any) -> Any:
            self.calls.append([str(args)])
            return 0

    real = Real()
    lib = library(tmp_path)
    proxy = ProbeProxy(real, OLD_FORM)
    for _ in range(2):
        assert proxy.check_call(argv(lib), cwd="/") == 0
    assert len(real.calls) == 2
    assert not list(tmp_path.rglob("*" + MARKER_SUFFIX))
    assert isaprobe.counts() == {"reused": 0, "run": 0, "recorded": 0}
    assert proxy.DEVNULL is subprocess.DEVNULL and proxy.TimeoutExpired is subprocess.TimeoutExpired


def test_its_own_faults_run_torchs_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = CountingSubprocess()
    lib = library(tmp_path)
    check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True)

    def broken(*_: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(isaprobe, "_cpu_flags", broken)  # the identity cannot be computed
    isaprobe.reset_counts()
    assert check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True) == 0
    assert len(real.calls) == 2
    monkeypatch.setattr(isaprobe, "record", broken)  # nor a record written
    assert check(ProbeProxy(real, OLD_FORM), OLD_FORM, lib, old=True) == 0
    assert len(real.calls) == 3


def fake_torch_module(template: str | None, sub: Any = subprocess) -> ModuleType:
    module = ModuleType("fake_cpu_vec_isa")
    module.VecISA = type("VecISA", (), {} if template is None else {"_avx_py_load": template})  # type: ignore[attr-defined]
    module.subprocess = sub  # type: ignore[attr-defined]
    return module


def test_install_replaces_only_the_modules_name_and_uninstall_puts_it_back() -> None:
    module = fake_torch_module(NEW_FORM)
    assert isaprobe.install(module) is None
    assert isinstance(module.subprocess, ProbeProxy) and subprocess.run.__module__ == "subprocess"
    assert isaprobe.install(module) is None and module.subprocess._real is subprocess  # idempotent
    isaprobe.uninstall(module)
    assert module.subprocess is subprocess


@pytest.mark.parametrize("module,why", [
    (fake_torch_module(None), "another form"),
    (fake_torch_module("open('__lib_path__'); open('__lib_path__')"), "another form"),
    (fake_torch_module(NEW_FORM, sub=CountingSubprocess.__new__(CountingSubprocess)), "another form"),
    (fake_torch_module(NEW_FORM, sub=object()), "does not go through subprocess"),
])
def test_install_leaves_another_form_alone(module: ModuleType, why: str) -> None:
    if isinstance(module.subprocess, CountingSubprocess):
        module.VecISA._avx_py_load = 3  # not a string
    before = module.subprocess
    assert why in (isaprobe.install(module) or "")
    assert module.subprocess is before


# torch 2.14 and later: a template naming the library twice (a retry after importing torch) and a check that keeps
# its own record of a success, reduced here to what install() reads.
TORCH214_FORM = ('\nimport sys\nif sys.platform != "linux":\n    import torch\nfrom ctypes import cdll\ntry:\n'
                 '    cdll.LoadLibrary("__lib_path__")\nexcept OSError:\n    import torch\n'
                 '    cdll.LoadLibrary("__lib_path__")\n')


class RecordingVecISA:
    _avx_py_load = TORCH214_FORM

    def check_build(self, code: str) -> bool:
        output_path = code  # torch: the library it built for this ISA
        load_ok_marker = output_path + ".load_ok"
        if os.path.isfile(load_ok_marker):
            return True
        ok = subprocess.run([sys.executable, "-c", self._avx_py_load.replace("__lib_path__", output_path)]).returncode == 0
        if ok:
            Path(load_ok_marker).write_text("")
        return ok


class UnrecordedVecISA:
    _avx_py_load = TORCH214_FORM

    def check_build(self, code: str) -> bool:
        return subprocess.run([sys.executable, "-c", self._avx_py_load.replace("__lib_path__", code)]).returncode == 0


def test_a_torch_that_records_its_checks_itself_is_left_alone_and_the_note_says_so() -> None:
    module = ModuleType("fake_cpu_vec_isa")
    module.VecISA = RecordingVecISA  # type: ignore[attr-defined]
    module.subprocess = subprocess  # type: ignore[attr-defined]
    assert isaprobe.torch_records_itself(module)
    note = isaprobe.install(module)
    assert note == isaprobe.TORCH_RECORDS_NOTE and module.subprocess is subprocess
    assert "every process" not in note and ".load_ok" in note and "travel" in note
    # The same template without torch's own record: the check would run in every process, and the note says so.
    module.VecISA = UnrecordedVecISA  # type: ignore[attr-defined]
    assert not isaprobe.torch_records_itself(module)
    assert isaprobe.install(module) == isaprobe.RUNS_EVERYWHERE + "this torch's vector-ISA check has another form"
    assert module.subprocess is subprocess


def test_arm_hands_the_session_one_whole_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_recording_isa.py").write_text(textwrap.dedent(f"""
        import subprocess
        class VecISA:
            _avx_py_load = {TORCH214_FORM!r}
            def check_build(self, code):
                return bool(code + ".load_ok")
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(isaprobe, "MODULE", "fake_recording_isa")
    notes: list[str] = []
    hook = isaprobe.arm(notes.append)
    try:
        import fake_recording_isa  # type: ignore[import-not-found]

        assert notes == [isaprobe.TORCH_RECORDS_NOTE]
        assert fake_recording_isa.subprocess is subprocess
    finally:
        isaprobe.disarm(hook)
        sys.modules.pop("fake_recording_isa", None)


def test_arm_waits_for_the_module_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_isa_module.py").write_text(textwrap.dedent(f"""
        import subprocess
        class VecISA:
            _avx_py_load = {NEW_FORM!r}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(isaprobe, "MODULE", "fake_isa_module")
    problems: list[str] = []
    hook = isaprobe.arm(problems.append)
    try:
        assert hook is not None and hook in sys.meta_path
        import fake_isa_module  # type: ignore[import-not-found]

        assert isinstance(fake_isa_module.subprocess, ProbeProxy) and problems == []
        assert hook not in sys.meta_path
    finally:
        isaprobe.disarm(hook)
        sys.modules.pop("fake_isa_module", None)
    assert fake_isa_module.subprocess is subprocess


def test_a_temporary_record_never_travels_and_a_record_does(tmp_path: Path) -> None:
    from pytest_megacache.files import FileRoot

    root = FileRoot("inductor", tmp_path)
    lib = library(tmp_path)
    before = root.snapshot()
    check(ProbeProxy(CountingSubprocess(), OLD_FORM), OLD_FORM, lib, old=True)
    Path(tmp_path, "ab", f".{marker(lib).name}.1.2.tmp").write_text("{}")  # one left by a killed writer
    entries, skipped = root.collect(before)
    assert [e.name for e in entries] == [f"ab/{marker(lib).name}"] and skipped == []


# --- real torch -----------------------------------------------------------------------------------------------
DECIDE = textwrap.dedent("""
    import json, sys
    import torch._inductor.cpu_vec_isa as m
    from pytest_megacache import isaprobe
    if sys.argv[1] == "reuse":
        assert isaprobe.install(m) is None
    valid = m.valid_vec_isa_list()
    picked = m.pick_vec_isa()
    print(json.dumps({"valid": [str(i) for i in valid], "picked": str(picked), "flags": picked.build_arch_flags(),
                      "macros": picked.build_macro(), "counts": isaprobe.counts()}))
""")


@pytest.mark.torch
def test_torch_decides_the_same_without_the_reuse_recording_and_reusing(tmp_path: Path) -> None:
    skip_without_torch()

    def decide(mode: str, cache: str) -> dict[str, Any]:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache), "TMPDIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", DECIDE, mode], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return dict(json.loads(done.stdout.splitlines()[-1]))

    plain = decide("torch", "plain")
    recording = decide("reuse", "reuse")
    reusing = decide("reuse", "reuse")
    counts = [d.pop("counts") for d in (plain, recording, reusing)]
    assert plain == recording == reusing
    assert plain["valid"], "this CPU has no vector ISA: the comparison would prove nothing"
    assert counts[0] == {"reused": 0, "run": 0, "recorded": 0}
    assert counts[1]["run"] >= 1 and counts[1]["recorded"] == counts[1]["run"] and counts[1]["reused"] == 0
    assert counts[2] == {"reused": counts[1]["run"], "run": 0, "recorded": 0}


# --- child processes --------------------------------------------------------------------------------------------
def test_a_child_whose_decision_differs_runs_the_check_and_records_nothing(tmp_path: Path) -> None:
    """A record exists for these exact bytes and loader; a child whose gate says no (its decision digest is not the
    session's) still runs torch's check each time, counted, and neither takes nor writes a record."""
    real = CountingSubprocess()
    lib = library(tmp_path)
    check(ProbeProxy(real, NEW_FORM), NEW_FORM, lib, old=False)
    written = marker(lib).read_bytes()
    asked: list[int] = []

    def no() -> bool:
        asked.append(1)
        return False

    def broken() -> bool:
        raise OSError("cannot read /proc/cpuinfo")

    for gate in (no, broken):
        isaprobe.reset_counts()
        proxy = ProbeProxy(real, NEW_FORM, gate)
        calls = len(real.calls)
        check(proxy, NEW_FORM, lib, old=False)
        check(proxy, NEW_FORM, lib, old=False)
        assert len(real.calls) == calls + 2  # torch's check ran both times
        assert isaprobe.counts() == {"reused": 0, "run": 2, "recorded": 0}
        assert isaprobe.check_seconds() > 0
    assert asked == [1]  # asked once per process (proxy), at its first check
    assert marker(lib).read_bytes() == written

    # The same record with a gate that says yes: taken, no child.
    isaprobe.reset_counts()
    calls = len(real.calls)
    check(ProbeProxy(real, NEW_FORM, lambda: True), NEW_FORM, lib, old=False)
    assert len(real.calls) == calls and isaprobe.counts() == {"reused": 1, "run": 0, "recorded": 0}


def test_a_child_with_no_record_yet_records_only_when_its_gate_allows(tmp_path: Path) -> None:
    real = CountingSubprocess()
    denied, allowed = library(tmp_path / "denied"), library(tmp_path / "allowed")
    check(ProbeProxy(real, OLD_FORM, lambda: False), OLD_FORM, denied, old=True)
    assert list(Path(denied).parent.glob("*" + MARKER_SUFFIX)) == []
    check(ProbeProxy(real, OLD_FORM, lambda: True), OLD_FORM, allowed, old=True)
    assert marker(allowed).is_file()
    assert isaprobe.counts() == {"reused": 0, "run": 2, "recorded": 1}


def test_the_gate_is_asked_at_the_first_check_not_before(tmp_path: Path) -> None:
    asked: list[int] = []
    proxy = ProbeProxy(CountingSubprocess(), NEW_FORM, lambda: bool(asked.append(1)) or True)
    proxy.run(["true"])  # another call of torch's module: not the check, the gate is not asked
    assert asked == []
    check(proxy, NEW_FORM, library(tmp_path), old=False)
    check(proxy, NEW_FORM, library(tmp_path), old=False)
    assert asked == [1]


def _base_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("g++", "clang++"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": str(bin_dir), "HOME": "/root", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}


@pytest.mark.parametrize("change", [
    {"ATEN_CPU_CAPABILITY": "default"}, {"ATEN_CPU_CAPABILITY": "avx2"}, {"CXX": "clang++"}, {"CXXFLAGS": "-O0"},
    {"CPATH": "/opt/include"}, {"LD_PRELOAD": "/lib/x.so"}, {"LD_LIBRARY_PATH": "/opt/lib"}, {"PYTHONPATH": "/x"},
    {"TORCHINDUCTOR_FREEZING": "1"}, {"TORCHINDUCTOR_CPP_WRAPPER": "1"}, {"TORCHINDUCTOR_VEC_ISA_OK": "0"},
    {"TORCH_COMPILE_DEBUG": "1"}, {"TORCHINDUCTOR_REDIS_URL": "redis://u:pw@host"},
], ids=lambda change: next(iter(change)))
def test_the_decision_digest_follows_what_decides_the_check(tmp_path: Path, change: dict[str, str]) -> None:
    env = _base_env(tmp_path)
    assert isaprobe.decision_digest({**env, **change}) != isaprobe.decision_digest(env)


def test_the_decision_digest_follows_the_compiler_found_on_path(tmp_path: Path) -> None:
    env = _base_env(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "g++").write_text("#!/bin/sh\n")
    (other / "g++").chmod(0o755)
    assert isaprobe.decision_digest({**env, "PATH": str(other)}) != isaprobe.decision_digest(env)
    # The same compiler through another directory on PATH: the same digest.
    assert isaprobe.decision_digest({**env, "PATH": f"/nonexistent:{env['PATH']}"}) == isaprobe.decision_digest(env)


@pytest.mark.parametrize("change", [
    {"OMP_NUM_THREADS": "1"}, {"TORCHINDUCTOR_COMPILE_THREADS": "1"}, {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"},
    {"TRITON_CACHE_DIR": "/elsewhere"}, {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"},
    {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, {"TORCH_COMPILE_JOB_ID": "x"}, {"CUDA_VISIBLE_DEVICES": "1"},
], ids=lambda change: next(iter(change)))
def test_the_decision_digest_ignores_what_decides_neither_the_check_nor_the_isa(
        tmp_path: Path, change: dict[str, str]) -> None:
    env = _base_env(tmp_path)
    assert isaprobe.decision_digest({**env, **change}) == isaprobe.decision_digest(env)


def test_the_decision_digest_shows_no_value(tmp_path: Path) -> None:
    digest = isaprobe.decision_digest({**_base_env(tmp_path), "TORCHINDUCTOR_REDIS_URL": "redis://u:s3cr3t@host"})
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_arm_offers_the_digest_to_children_and_disarm_takes_it_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isaprobe, "MODULE", "not_imported_isa_module")
    for before in (None, "an-outer-session's"):
        if before is None:
            monkeypatch.delenv(isaprobe.CHILD_ENV, raising=False)
        else:
            monkeypatch.setenv(isaprobe.CHILD_ENV, before)
        hook = isaprobe.arm(lambda why: None)
        try:
            assert os.environ[isaprobe.CHILD_ENV] == isaprobe.decision_digest()
        finally:
            isaprobe.disarm(hook)
        assert os.environ.get(isaprobe.CHILD_ENV) == before


def test_arm_child_puts_a_gated_proxy_in_at_the_module_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_child_isa.py").write_text(textwrap.dedent(f"""
        import subprocess
        class VecISA:
            _avx_py_load = {NEW_FORM!r}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(isaprobe, "MODULE", "fake_child_isa")
    lib = library(tmp_path)
    check(ProbeProxy(CountingSubprocess(), NEW_FORM), NEW_FORM, lib, old=False)  # the session's record
    for offered, reused in ((isaprobe.decision_digest(), 1), ("0" * 64, 0), ("not a digest", 0)):
        isaprobe.reset_counts()
        hook = isaprobe.arm_child(offered)
        try:
            assert hook is not None and hook in sys.meta_path
            import fake_child_isa  # type: ignore[import-not-found]

            proxy = fake_child_isa.subprocess
            assert isinstance(proxy, ProbeProxy) and hook not in sys.meta_path
            check(proxy, NEW_FORM, lib, old=False)
            assert isaprobe.counts() == {"reused": reused, "run": 1 - reused, "recorded": 0}, offered
        finally:
            isaprobe.disarm(hook)
            sys.modules.pop("fake_child_isa", None)


def test_a_session_in_a_child_takes_its_own_records_whoever_installed_first(tmp_path: Path) -> None:
    """A pytest process started by another session's test: the start-up module's gated proxy may be in torch's
    module first; the session's own arming lifts the gate (its records are its own), and a gated install after
    the session's changes nothing."""
    module = ModuleType("fake_cpu_vec_isa")
    module.subprocess = CountingSubprocess()  # type: ignore[attr-defined]
    module.VecISA = type("VecISA", (), {"_avx_py_load": NEW_FORM})  # type: ignore[attr-defined]
    lib = library(tmp_path)
    check(ProbeProxy(CountingSubprocess(), NEW_FORM), NEW_FORM, lib, old=False)
    for first, second in (((lambda: False), None), (None, (lambda: False))):
        module.subprocess = CountingSubprocess()  # type: ignore[attr-defined]
        assert isaprobe.install(module, first) is None and isaprobe.install(module, second) is None
        isaprobe.reset_counts()
        check(module.subprocess, NEW_FORM, lib, old=False)
        assert isaprobe.counts() == {"reused": 1, "run": 0, "recorded": 0}
