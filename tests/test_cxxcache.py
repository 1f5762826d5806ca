"""The suite's compiler-output cache (tests/cxxcache.py) against a stand-in compiler that counts its runs: a build
is shared only when every argument and every input file's bytes are the same; failures and anything unusual
always reach the real compiler."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "cxxcache.py"

# A compiler: its output is its first input's bytes and its flags; an input holding ERROR fails the build.
FAKE_CC = """\
import sys
from pathlib import Path
args = sys.argv[1:]
with open(Path(__file__).with_name("runs"), "a") as fh:
    fh.write(" ".join(args) + "\\n")
if "--version" in args:
    print("fakecc 1.0")
    sys.exit(0)
source = Path(next(a for a in args if a.endswith((".cpp", ".h"))))
if b"ERROR" in source.read_bytes():
    sys.exit(1)
out = Path(args[args.index("-o") + 1])
out.write_bytes(source.read_bytes() + b"|" + " ".join(a for a in args if a.startswith("-m")).encode())
out.chmod(0o755)
"""


class Cxx:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "store"
        self.store.mkdir()
        tool = root / "tool"
        tool.mkdir()
        (tool / "fakecc.py").write_text(FAKE_CC)
        real = tool / "fakecc"
        real.write_text(f"#!/bin/sh\nexec {sys.executable} {tool / 'fakecc.py'} \"$@\"\n")
        real.chmod(0o755)
        self.runs_file = tool / "runs"
        self.env = {**os.environ, "TESTS_CXX_REAL": str(real), "TESTS_CXX_STORE": str(self.store)}

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-S", str(SCRIPT), *args], env=self.env, capture_output=True,
                              text=True, timeout=60, check=False)

    @property
    def real_runs(self) -> int:
        return len(self.runs_file.read_text().splitlines()) if self.runs_file.exists() else 0

    @property
    def hits(self) -> int:
        path = self.store / "hits"
        return path.stat().st_size if path.exists() else 0

    @property
    def builds(self) -> int:
        return len([p for p in self.store.iterdir() if p.name != "hits" and not p.name.startswith("stat-")])


def source(folder: Path, text: str, name: str = "k.cpp") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_the_same_build_at_another_path_is_served_without_the_compiler(tmp_path: Path) -> None:
    cxx = Cxx(tmp_path)
    first, second = source(tmp_path / "a" / "57", "int k;"), source(tmp_path / "b" / "57", "int k;")
    assert cxx(str(first), "-O3", "-mavx2", "-o", str(first.with_suffix(".so"))).returncode == 0
    assert cxx.real_runs == 1
    assert cxx(str(second), "-O3", "-mavx2", "-o", str(second.with_suffix(".so"))).returncode == 0
    assert cxx.real_runs == 1  # served
    assert second.with_suffix(".so").read_bytes() == first.with_suffix(".so").read_bytes() == b"int k;|-mavx2"
    assert stat.S_IMODE(second.with_suffix(".so").stat().st_mode) == 0o755
    assert (cxx.builds, cxx.hits) == (1, 1)
    assert not [p for p in (tmp_path / "b" / "57").iterdir() if p.name.startswith(".cxxcache-")]


def test_a_served_build_shares_the_stored_file_and_one_written_in_place_is_not_served_again(tmp_path: Path) -> None:
    cxx = Cxx(tmp_path)
    builds = [source(tmp_path / d, "int k;") for d in ("a", "b", "c")]
    outputs = [b.with_suffix(".so") for b in builds]
    for build, output in zip(builds[:2], outputs[:2], strict=True):
        assert cxx(str(build), "-o", str(output)).returncode == 0
    assert (cxx.real_runs, cxx.hits) == (1, 1)
    assert outputs[0].stat().st_ino == outputs[1].stat().st_ino  # one file on disk (this file system links)
    with open(outputs[1], "r+b") as fh:  # a session rewrites its output in place: every link sees it
        fh.write(b"bad")
    assert cxx(str(builds[2]), "-o", str(outputs[2])).returncode == 0
    assert cxx.real_runs == 2  # the changed build is a miss; the compiler ran and its output is the store's now
    assert outputs[2].read_bytes() == b"int k;|"
    assert cxx(str(builds[0]), "-o", str(outputs[0])).returncode == 0
    assert (cxx.real_runs, cxx.hits, outputs[0].read_bytes()) == (2, 2, b"int k;|")


@pytest.mark.parametrize("change", ["source bytes", "a flag", "the output's name"])
def test_any_other_input_is_another_build(tmp_path: Path, change: str) -> None:
    cxx = Cxx(tmp_path)
    first = source(tmp_path / "a", "int k;")
    assert cxx(str(first), "-mavx2", "-o", str(tmp_path / "a" / "k.so")).returncode == 0
    text, flag, out = "int k;", "-mavx2", "k.so"
    if change == "source bytes":
        text = "int j;"
    elif change == "a flag":
        flag = "-mavx512f"
    else:
        out = "j.so"
    other = source(tmp_path / "b", text)
    assert cxx(str(other), flag, "-o", str(tmp_path / "b" / out)).returncode == 0
    assert cxx.real_runs == 2 and cxx.hits == 0 and cxx.builds == 2
    assert (tmp_path / "b" / out).read_bytes() == f"{text}|{flag}".encode()


def test_a_failed_build_is_never_kept(tmp_path: Path) -> None:
    cxx = Cxx(tmp_path)
    bad = source(tmp_path / "a", "ERROR")
    for _ in range(2):
        assert cxx(str(bad), "-o", str(tmp_path / "a" / "k.so")).returncode == 1
    assert cxx.real_runs == 2 and not (tmp_path / "a" / "k.so").exists()
    assert sorted(p.name for p in cxx.store.iterdir()) == []


@pytest.mark.parametrize("args", [["--version"], ["-E", "-o", "h.i"], ["-MD", "-o", "k.so"], ["-c"]])
def test_queries_preprocessing_and_builds_without_one_output_reach_the_compiler(
        tmp_path: Path, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cxx = Cxx(tmp_path)
    src = source(tmp_path / "a", "int k;")
    monkeypatch.chdir(tmp_path / "a")
    full = [str(src), *args] if args != ["--version"] else args
    for _ in range(2):
        cxx(*full)
    assert cxx.real_runs == 2 and cxx.hits == 0 and cxx.builds == 0


def test_the_suite_runs_its_torch_sessions_through_it() -> None:
    store = os.environ.get("TESTS_CXX_STORE")
    if not store:
        pytest.skip("no usable g++ on this machine, or TESTS_REAL_CXX is set: the real compiler runs")
    shim = shutil.which("g++")
    assert shim is not None and Path(shim).parent == Path(store).parent / "bin"
    assert Path(shim).read_text().splitlines()[1:] == SCRIPT.read_text().splitlines()
