"""Compiled files carried as file entries: snapshot, collect and a restore that never escapes its root."""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import os
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.errors import BundleError
from pytest_megacache.files import (
    EXCLUDED_TOP,
    FileRoot,
    elf_problem,
    inductor_cache_dir,
    pch_dir,
    pch_enabled,
    place_dynamo,
    torch_cache_ident,
)

from .conftest import fake_elf as elf


def write(path: Path, data: bytes | None = None, mode: int = 0o644) -> Path:
    if data is None:
        data = elf(b"data") if path.name.endswith(".so") else b"data"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def tree(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root``, by relative POSIX path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def root(tmp_path: Path) -> FileRoot:
    return FileRoot("inductor", tmp_path / "cache")


# --- snapshot and collect ----------------------------------------------------------------------------


def test_kind_names_the_root(root: FileRoot) -> None:
    assert root.kind == "file/inductor"
    assert FileRoot("triton", Path("/x")).kind == "file/triton"


def test_snapshot_of_a_missing_directory_is_empty(root: FileRoot) -> None:
    assert root.snapshot() == set()


def test_collect_picks_up_only_new_files(root: FileRoot) -> None:
    write(root.path / "ab" / "old.so", elf(b"old"))
    before = root.snapshot()
    assert before == {"ab/old.so"}
    write(root.path / "ab" / "cabc.so", elf(b"\x7fELF"), 0o755)
    write(root.path / "ab" / "cabc.cpp", b"// source", 0o644)
    write(root.path / "top.json", b"{}", 0o600)

    entries, skipped = root.collect(before)

    assert skipped == []
    assert {(e.kind, e.name, e.data, e.mode) for e in entries} == {
        ("file/inductor", "ab/cabc.so", elf(b"\x7fELF"), 0o755),
        ("file/inductor", "ab/cabc.cpp", b"// source", 0o644),
        ("file/inductor", "top.json", b"{}", 0o644),
    }


@pytest.mark.parametrize("top", sorted(EXCLUDED_TOP))
def test_collect_skips_excluded_directories(root: FileRoot, top: str) -> None:
    before = root.snapshot()
    write(root.path / top / "ab" / "entry.bin")
    write(root.path / "kept" / "kernel.so")
    entries, skipped = root.collect(before)
    assert [e.name for e in entries] == ["kept/kernel.so"]
    assert skipped == []
    assert not any(name.startswith(top + "/") for name in root.snapshot())


def test_excluded_directories_are_the_expected_ones() -> None:
    # torch's own FX-graph and AOTAutograd directories travel (what a child process compiled lands there);
    # core leaves out the entries mega-cache carries under the same key.
    assert frozenset({"locks", "dynamo", "precompiled_headers", "triton"}) == EXCLUDED_TOP


@pytest.mark.parametrize(("rel", "ident"), [
    ("fxgraph/ab/fabc123/entry0", ("torch/inductor", "fabc123")),
    ("aotautograd/aabc123/entry0", ("torch/aot_autograd", "aabc123")),
    ("fxgraph/ab/fabc123", None), ("aotautograd/aabc123/x/y", None), ("ab/cabc.so", None),
])
def test_torch_cache_files_name_their_artifact(rel: str, ident: tuple[str, str] | None) -> None:
    assert torch_cache_ident(rel) == ident


@pytest.mark.parametrize(
    "name", ["ab/kernel.so.lock", "ab/tmpx8d7s", "ab/.hidden", "ab/kernel.so.tmp123", "ab/kernel.cpp~",
             ".tmp-megacache-abc", "tmpdir/kernel.so"],
)
def test_collect_skips_lock_and_temp_files(root: FileRoot, name: str) -> None:
    before = root.snapshot()
    write(root.path / name)
    write(root.path / "ab" / "kept.so")
    entries, skipped = root.collect(before)
    assert [e.name for e in entries] == ["ab/kept.so"]
    assert skipped == []


def test_collect_reports_unportable_names(root: FileRoot) -> None:
    before = root.snapshot()
    write(root.path / "ab" / "has space.so")
    entries, skipped = root.collect(before)
    assert len(entries) == 0
    assert skipped == ["ab/has space.so: name not portable"]


def test_collect_ignores_symlinks(root: FileRoot, tmp_path: Path) -> None:
    secret = write(tmp_path / "secret.txt", b"secret")
    root.path.mkdir()
    before = root.snapshot()
    (root.path / "link.so").symlink_to(secret)
    entries, _ = root.collect(before)
    assert len(entries) == 0


# --- restore -----------------------------------------------------------------------------------------


def test_restore_round_trip_with_modes(root: FileRoot, tmp_path: Path) -> None:
    before = root.snapshot()
    write(root.path / "ab" / "k.so", elf(b"shared object"), 0o755)
    write(root.path / "ab" / "k.cpp", b"source", 0o644)
    entries, _ = root.collect(before)

    fresh = FileRoot("inductor", tmp_path / "fresh" / "cache")
    assert fresh.restore(entries) == (2, 0)
    assert tree(fresh.path) == {"ab/k.so": elf(b"shared object"), "ab/k.cpp": b"source"}
    assert stat.S_IMODE((fresh.path / "ab" / "k.so").stat().st_mode) == 0o755
    assert stat.S_IMODE((fresh.path / "ab" / "k.cpp").stat().st_mode) == 0o644
    # No temp files are left behind.
    assert sorted(p.name for p in (fresh.path / "ab").iterdir()) == ["k.cpp", "k.so"]


def test_restore_never_overwrites(root: FileRoot) -> None:
    write(root.path / "ab" / "k.so", elf(b"original"), 0o644)
    entries = [Entry("file/inductor", "ab/k.so", elf(b"replacement"), 0o755),
               Entry("file/inductor", "ab/new.so", elf(b"new"), 0o644)]
    assert root.restore(entries) == (1, 1)
    assert (root.path / "ab" / "k.so").read_bytes() == elf(b"original")
    assert stat.S_IMODE((root.path / "ab" / "k.so").stat().st_mode) == 0o644
    assert (root.path / "ab" / "new.so").read_bytes() == elf(b"new")
    # A second restore finds everything present.
    assert root.restore(entries) == (0, 2)


def test_restore_drops_unsafe_mode_bits(root: FileRoot) -> None:
    root.restore([Entry("file/inductor", "k.so", elf(b"x"), 0o6777)])
    assert stat.S_IMODE((root.path / "k.so").stat().st_mode) == 0o755


def test_restore_ignores_other_roots_and_torch_entries(root: FileRoot) -> None:
    entries = Entries([Entry("file/triton", "a/b.cubin", b"t"), Entry("torch/pgo", "code_state_x", b"p"),
                       Entry("file/inductor", "a/b.so", elf(b"i"))])
    assert root.restore(entries) == (1, 0)
    assert tree(root.path) == {"a/b.so": elf(b"i")}


def test_restore_does_not_follow_an_existing_symlink(root: FileRoot, tmp_path: Path) -> None:
    victim = write(tmp_path / "victim.txt", b"untouched")
    root.path.mkdir()
    (root.path / "k.so").symlink_to(victim)
    assert root.restore([Entry("file/inductor", "k.so", elf(b"overwrite?"))]) == (0, 1)
    assert victim.read_bytes() == b"untouched"


@pytest.mark.parametrize("name", ["../x.so", "/abs/x.so", "a/../../x.so", ".hidden"])
def test_restore_refuses_unsafe_names_one_by_one(root: FileRoot, tmp_path: Path, name: str) -> None:
    refused: list[str] = []
    written = root.restore([Entry("file/inductor", "before.so", elf(b"a")), Entry("file/inductor", name, elf(b"evil")),
                            Entry("file/inductor", "after.so", elf(b"b"))], refused)
    assert written == (2, 0)
    assert len(refused) == 1 and refused[0].startswith(f"{name}: ") and "unsafe file path" in refused[0]
    assert not (tmp_path / "x.so").exists()
    assert (root.path / "before.so").read_bytes() == elf(b"a") and (root.path / "after.so").read_bytes() == elf(b"b")


@pytest.mark.parametrize("name", ["evil/x.so", "evil/sub/x.so", "evil/sub/deeper/x.so"])
def test_restore_refuses_a_symlinked_directory_leading_outside(root: FileRoot, tmp_path: Path, name: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root.path.mkdir()
    (root.path / "evil").symlink_to(outside, target_is_directory=True)
    refused: list[str] = []
    assert root.restore([Entry("file/inductor", "fine.so", elf(b"ok")), Entry("file/inductor", name, elf(b"evil")),
                         Entry("file/inductor", "later/fine.so", elf(b"ok2"))], refused) == (2, 0)
    assert len(refused) == 1 and refused[0].startswith(f"{name}: ") and "resolves outside" in refused[0]
    assert list(outside.iterdir()) == []  # not a file, not even a directory
    assert (root.path / "fine.so").read_bytes() == elf(b"ok")  # the entries around the bad one are whole files
    assert (root.path / "later" / "fine.so").read_bytes() == elf(b"ok2")


def test_restore_skips_an_entry_whose_directory_is_a_file(root: FileRoot) -> None:
    """A stray file where a directory should be costs that entry alone."""
    root.path.mkdir()
    (root.path / "ab").write_bytes(b"not a directory")
    refused: list[str] = []
    assert root.restore([Entry("file/inductor", "ab/k.so", elf(b"x")), Entry("file/inductor", "cd/k.so", elf(b"y"))],
                        refused) == (1, 0)
    assert len(refused) == 1 and refused[0].startswith("ab/k.so: ")
    assert (root.path / "cd" / "k.so").read_bytes() == elf(b"y")


def test_restore_stops_when_the_disk_is_full(root: FileRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(*_args: object, **_kwargs: object) -> tuple[int, str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    root.path.mkdir()
    monkeypatch.setattr("os.write", full)  # the data's write is where a full disk shows
    with pytest.raises(OSError, match="No space left"):
        root.restore([Entry("file/inductor", "k.so", elf(b"x"))])
    monkeypatch.undo()
    assert list(root.path.iterdir()) == []  # nor a temporary file left behind


def test_restore_allows_a_symlinked_directory_inside_the_root(root: FileRoot) -> None:
    (root.path / "real").mkdir(parents=True)
    (root.path / "alias").symlink_to(root.path / "real", target_is_directory=True)
    assert root.restore([Entry("file/inductor", "alias/k.so", elf(b"x"))]) == (1, 0)
    assert (root.path / "real" / "k.so").read_bytes() == elf(b"x")


def test_restore_through_a_symlinked_root(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    linked = FileRoot("inductor", tmp_path / "link")
    assert linked.restore([Entry("file/inductor", "a/k.so", elf(b"x"))]) == (1, 0)
    assert (tmp_path / "real" / "a" / "k.so").read_bytes() == elf(b"x")



def scratch_entry(folder: Path, name: str, data: bytes, mode: int = 0o644) -> Entry:
    """A file entry as a restore decodes it: a scratch file of its own, with its digest."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{len(list(folder.iterdir()))}.entry"
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return Entry.in_file("file/inductor", name, str(path), len(data), mode, hashlib.sha256(data).digest())


def test_a_restore_moves_scratch_files_into_place_and_reads_them_from_there(root: FileRoot, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    new, same, other = (scratch_entry(scratch, "ab/new.so", elf(b"new"), 0o755),
                        scratch_entry(scratch, "ab/same.so", elf(b"same")),
                        scratch_entry(scratch, "ab/other.so", elf(b"mine")))
    write(root.path / "ab" / "same.so", elf(b"same"))
    write(root.path / "ab" / "other.so", elf(b"else"))  # another writer's bytes: its place is not this entry's
    kept = other.path
    scratch_inode = os.stat(str(new.path)).st_ino
    assert root.restore([new, same, other], move=True) == (1, 2)
    placed = root.path / "ab" / "new.so"
    assert new.path == str(placed) and placed.stat().st_nlink == 1 and stat.S_IMODE(placed.stat().st_mode) == 0o755
    assert placed.stat().st_ino == scratch_inode  # the scratch file itself, under its new name: no copy was made
    assert same.path == str(root.path / "ab" / "same.so") and other.path == kept
    assert [p.name for p in scratch.iterdir()] == [Path(kept).name]
    assert (new.data, same.data, other.data) == (elf(b"new"), elf(b"same"), elf(b"mine"))
    # The cache directory is not the session's alone: a placed file changed since is refused, never read as the entry.
    placed.write_bytes(elf(b"nex"))
    with pytest.raises(BundleError, match="changed"):
        new.data  # noqa: B018


def test_a_restore_copies_what_it_cannot_link_into_place_and_lets_the_scratch_copy_go(
        root: FileRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def across(src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    scratch = tmp_path / "scratch"
    entry = scratch_entry(scratch, "ab/k.so", elf(b"k"))
    monkeypatch.setattr("pytest_megacache.files.os.link", across)  # the write's own link falls back to a rename
    assert root.restore([entry], move=True) == (1, 0)
    assert entry.path == str(root.path / "ab" / "k.so") and entry.data == elf(b"k") and not list(scratch.iterdir())
    # Without ``move`` (what an xdist worker hands over, a collect), nothing moves.
    kept = scratch_entry(scratch, "ab/j.so", elf(b"j"))
    assert root.restore([kept]) == (1, 0) and Path(str(kept.path)).parent == scratch

def test_dynamo_entries_are_placed_as_torch_reads_them_without_a_copy(tmp_path: Path) -> None:
    """A stored Dynamo entry becomes ``dynamo/<key>/entry`` in Inductor's cache directory, replacing what is there as
    torch's own load does: a second name of its scratch file where it has one (the entry keeps reading that name, so
    torch's later rewrite of the file changes nothing of it), else written; an unsafe key is refused alone."""
    inductor, scratch = tmp_path / "inductor", tmp_path / "scratch"
    linked = scratch_entry(scratch, "k1", b"stored entry one")
    linked = Entry.in_file("torch/precompile", "k1", str(linked.path), linked.size, digest=hashlib.sha256(
        b"stored entry one").digest())
    in_memory = Entry("torch/precompile", "k2", b"stored entry two")
    write(inductor / "dynamo" / "k2" / "entry", b"an earlier run's")
    refused: list[str] = []
    assert place_dynamo([linked, in_memory, Entry("torch/precompile", "../up", b"x")], inductor, refused) == 2
    assert len(refused) == 1 and "up" in refused[0]
    first, second = inductor / "dynamo" / "k1" / "entry", inductor / "dynamo" / "k2" / "entry"
    assert first.read_bytes() == b"stored entry one" and second.read_bytes() == b"stored entry two"
    assert os.path.samefile(first, str(linked.path)) and linked.path is not None and Path(linked.path).parent == scratch
    assert sorted(p.name for p in (inductor / "dynamo").iterdir()) == ["k1", "k2"]
    assert not [p for p in (inductor / "dynamo").rglob(".*")]  # no temporary name left
    first.unlink()
    first.write_bytes(b"torch wrote it again")  # a new file under the name
    assert linked.data == b"stored entry one"


# --- inductor_cache_dir ------------------------------------------------------------------------------


def test_inductor_cache_dir_honours_the_variable(tmp_path: Path) -> None:
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}) == tmp_path / "ind"


def test_inductor_cache_dir_makes_a_relative_setting_absolute(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": "rel/dir"}) == tmp_path / "rel" / "dir"


def test_inductor_cache_dir_reads_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "from-env"))
    assert inductor_cache_dir() == tmp_path / "from-env"


def test_inductor_cache_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    expected = Path(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}").absolute()
    assert inductor_cache_dir() == expected
    assert inductor_cache_dir({"TORCHINDUCTOR_CACHE_DIR": ""}) == expected


def test_inductor_cache_dir_sanitizes_the_user_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", lambda: "DOMAIN\\user:x")
    assert inductor_cache_dir({}).name == "torchinductor_DOMAIN_user_x"


def test_inductor_cache_dir_without_a_user_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_user() -> str:
        raise OSError("no user")

    monkeypatch.setattr(getpass, "getuser", no_user)
    assert inductor_cache_dir({}).name == f"torchinductor_uid_{os.getuid()}"


def test_triton_root_carries_kernels_but_not_autotune_benchmark_candidates(tmp_path: Path) -> None:
    from pytest_megacache.files import FileRoot

    root = FileRoot("triton", tmp_path)
    user = tmp_path / "AAAAUSERHASH"
    user.mkdir()
    (user / "fused_bias_gelu.cubin").write_bytes(b"cubin")
    (user / "__grp__fused_bias_gelu.json").write_text("{}")
    inductor = tmp_path / "BBBBINDUCTORHASH"
    inductor.mkdir()
    (inductor / "triton_poi_fused_add_0.cubin").write_bytes(b"cubin")
    (inductor / "__grp__triton_poi_fused_add_0.json").write_text("{}")
    candidate = tmp_path / "CCCCAUTOTUNECANDIDATE"  # max-autotune's benchmark choices: "triton_mm", no suffix
    candidate.mkdir()
    (candidate / "triton_mm.cubin").write_bytes(b"cubin")
    (candidate / "__grp__triton_mm.json").write_text("{}")
    entries, skipped = root.collect(set())
    # Inductor's kernels travel too: one autotuned at run time has its final binary only here.
    assert sorted(e.name for e in entries) == ["AAAAUSERHASH/__grp__fused_bias_gelu.json",
                                               "AAAAUSERHASH/fused_bias_gelu.cubin",
                                               "BBBBINDUCTORHASH/__grp__triton_poi_fused_add_0.json",
                                               "BBBBINDUCTORHASH/triton_poi_fused_add_0.cubin"]
    assert skipped == []
    # The inductor root keeps its own rules: a triton_* name there is an ordinary file.
    assert len(FileRoot("inductor", tmp_path).collect(set())[0]) == 6


# --- kernels still being built, and truncated ones ---------------------------------------------------


def a_real_shared_object() -> bytes:
    """A real .so from this Python (an extension module), so the ELF check meets a linker's output."""
    import _ctypes

    return Path(_ctypes.__file__).read_bytes()


def test_elf_check_accepts_whole_files_and_names_cut_ones() -> None:
    real = a_real_shared_object()
    assert elf_problem("k.so", real) is None
    assert elf_problem("k.so", elf()) is None
    for cut in (real[: len(real) // 2], real[:100], real[:10], b""):
        assert elf_problem("ab/k.so", cut) is not None, len(cut)
    assert elf_problem("ab/k.so", b"not elf") == "not an ELF file (7 bytes)"
    assert elf_problem("ab/k.cpp", b"int x;") is None  # only ELF files are checked
    assert elf_problem("ab/k.bin", real[:1000]) is not None  # ... recognised by their magic too


def test_collect_skips_a_truncated_kernel(root: FileRoot) -> None:
    real = a_real_shared_object()
    write(root.path / "ab" / "whole.so", real)
    write(root.path / "ab" / "cut.so", real[: len(real) // 3])
    entries, skipped = root.collect(set())
    assert [e.name for e in entries] == ["ab/whole.so"]
    assert len(skipped) == 1 and skipped[0].startswith("ab/cut.so: truncated ELF file"), skipped


def hold_torch_lock(lock: Path, seconds: float | threading.Event, then: Any = None) -> threading.Thread:
    """Hold ``lock`` the way torch's FileLock does (an exclusive flock) in a thread, as a build would: for
    ``seconds``, or until that event is set (a minute at most)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def release() -> None:
        if isinstance(seconds, threading.Event):
            seconds.wait(60)
        else:
            time.sleep(seconds)
        if then is not None:
            then()
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    thread = threading.Thread(target=release)
    thread.start()
    return thread


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_collect_waits_for_a_build_in_progress_under_torchs_lock(root: FileRoot) -> None:
    """Another process sharing the directory is mid-build (its g++ writes straight into the cache, under
    ``locks/<key>.lock``): the collector waits for the lock and reads the finished file, not a prefix."""
    real = a_real_shared_object()
    kernel = write(root.path / "ab" / "ckey.main.so", real[:100])  # what a reader sees mid-build
    thread = hold_torch_lock(root.path / "locks" / "ckey.lock", 0.5, then=lambda: kernel.write_bytes(real))
    start = time.monotonic()
    entries, skipped = root.collect(set())
    thread.join()
    assert time.monotonic() - start >= 0.4  # it waited for the lock ...
    assert [(e.name, e.data == real) for e in entries] == [("ab/ckey.main.so", True)], skipped  # ... and got it whole


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_collect_gives_up_on_a_build_that_holds_the_lock_too_long(root: FileRoot) -> None:
    write(root.path / "ab" / "ckey.so", elf())
    thread = hold_torch_lock(root.path / "locks" / "ckey.lock", 1.0)
    entries, skipped = root.collect(set(), lock_wait=0.2)
    thread.join()
    assert not entries
    assert skipped == ["ab/ckey.so: still being built by another process after 0.2 s"]


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_the_lock_wait_is_one_budget_for_the_whole_collect(root: FileRoot) -> None:
    """Many kernels locked by a long build elsewhere cost the session lock_wait once, not once per file."""
    threads = []
    build_done = threading.Event()
    for i in range(5):
        write(root.path / "ab" / f"ck{i}.so", elf())
        threads.append(hold_torch_lock(root.path / "locks" / f"ck{i}.lock", build_done))
    start = time.monotonic()
    try:
        entries, skipped = root.collect(set(), lock_wait=1.0)
        took = time.monotonic() - start
    finally:
        build_done.set()
        for thread in threads:
            thread.join()
    assert not entries and len(skipped) == 5
    # The locks stay taken throughout: a budget per file would cost 5 x 1 s at least; one budget costs 1 s.
    assert 0.9 < took < 4.5, took


# --- Inductor's CPU precompiled header ---------------------------------------------------------------

PCH = "cyowqva53xuhkr2bupk2luatvnz3ddjl3ciikh2efpplhsk2llal"
PCH_H = b"#include <torch/csrc/inductor/cpp_prefix.h>\n"


def test_pch_dir_is_under_the_default_cache_dir_whatever_torchinductor_cache_dir_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch keeps headers in ``default_cache_dir()/precompiled_headers`` (codecache._HEADER_DIR), which
    TORCHINDUCTOR_CACHE_DIR does not move; the default directory follows TMPDIR."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", env["TORCHINDUCTOR_CACHE_DIR"])
    assert pch_dir() == inductor_cache_dir({}) / "precompiled_headers"
    assert pch_dir().parent != inductor_cache_dir(env)


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("", False)])
def test_pch_enabled_follows_torchs_default_and_the_variable(value: str | None, on: bool) -> None:
    env = {} if value is None else {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": value}
    assert pch_enabled(env) is on


def test_pch_root_carries_only_new_header_pairs(tmp_path: Path) -> None:
    pch = FileRoot("pch", tmp_path / "precompiled_headers")
    write(pch.path / "olderheader1234.h", PCH_H)
    before = pch.snapshot()
    write(pch.path / f"{PCH}.h", PCH_H)
    write(pch.path / f"{PCH}.h.gch", b"gpch+014" + b"x" * 64)
    write(pch.path / "locks" / f"{PCH}.lock", b"")
    write(pch.path / "notes.txt", b"x")
    write(pch.path / "sub" / f"{PCH}.h", PCH_H)
    entries, skipped = pch.collect(before)
    assert sorted(e.name for e in entries) == [f"{PCH}.h", f"{PCH}.h.gch"]
    assert {e.kind for e in entries} == {"file/pch"} and skipped == []


@pytest.mark.parametrize(("name", "data", "why"), [
    (f"{PCH}.h.gch", b"\x7fELF" + b"x" * 64, "bad magic"),
    (f"{PCH}.h", b"#include <x.h>\nsystem();\n", "one-line #include"),
    (f"{PCH}.h", b'#include "/etc/passwd"\n', "one-line #include"),
])
def test_pch_root_refuses_what_is_not_a_header(tmp_path: Path, name: str, data: bytes, why: str) -> None:
    pch = FileRoot("pch", tmp_path / "precompiled_headers")
    write(pch.path / name, data)
    entries, skipped = pch.collect(set())
    assert len(entries) == 0 and len(skipped) == 1 and why in skipped[0]
    refused: list[str] = []
    target = FileRoot("pch", tmp_path / "fresh")
    assert target.restore([Entry("file/pch", name, data)], refused) == (0, 0)
    assert not (target.path / name).exists() and why in refused[0]


def test_pch_root_round_trip(tmp_path: Path) -> None:
    src = FileRoot("pch", tmp_path / "a")
    write(src.path / f"{PCH}.h", PCH_H)
    write(src.path / f"{PCH}.h.gch", b"gpch+014" + os.urandom(256))
    entries, _ = src.collect(set())
    dest = FileRoot("pch", tmp_path / "b")
    assert dest.restore(entries) == (2, 0)
    assert tree(dest.path) == tree(src.path)
    assert dest.restore(entries) == (0, 2)
