"""fsutil: the atomic write and the no-follow, size-capped read, on their failure paths."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import fsutil
from pytest_megacache.fsutil import Refused, TooLarge, read_regular, write_atomic


@pytest.fixture
def umask() -> Iterator[Any]:
    """Set the process's umask for one test; put back after."""
    saved = os.umask(0o022)
    os.umask(saved)

    def set_(value: int) -> None:
        os.umask(value)

    yield set_
    os.umask(saved)


def _with_timeout(fn: Any, *args: Any) -> Any:
    """Run ``fn`` in a thread: a call that blocks fails the test instead of hanging it."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(("raised", exc))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert out, f"{fn.__name__} blocked"
    return out[0]


# --- read_regular ---------------------------------------------------------------------------------------------------
def test_read_regular_reads_a_whole_file_up_to_the_cap(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "exact").write_bytes(b"x" * 100)
    big = os.urandom(3 << 20)  # several read chunks
    (tmp_path / "big").write_bytes(big)
    assert read_regular(tmp_path / "empty", 0) == b""
    assert read_regular(str(tmp_path / "exact"), 100) == b"x" * 100
    assert read_regular(tmp_path / "big", len(big)) == big


def test_read_regular_refuses_a_symbolic_link(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"content")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        with pytest.raises(Refused, match=r"^a symbolic link$"):
            read_regular(tmp_path / name, 1000)


def test_read_regular_refuses_a_link_swapped_in_after_the_check(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is a regular file when looked at and a link when opened: O_NOFOLLOW refuses it at the open."""
    (tmp_path / "real").write_bytes(b"content")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda path, **kw: real_lstat(tmp_path / "real"))
    with pytest.raises(Refused, match=r"^a symbolic link$"):
        read_regular(tmp_path / "link", 1000)


def test_read_regular_refuses_a_fifo_without_blocking_and_a_directory(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "dir"):
        how, exc = _with_timeout(read_regular, tmp_path / name, 1000)
        assert how == "raised" and isinstance(exc, Refused) and str(exc) == "not a regular file"


def test_read_regular_refuses_a_file_over_the_cap(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 101)
    with pytest.raises(TooLarge, match=r"^larger than 100 bytes$") as info:
        read_regular(tmp_path / "f", 100)
    assert (info.value.size, info.value.max_bytes) == (101, 100)
    assert isinstance(info.value, OSError)  # callers that skip any unreadable file catch it as one


def test_read_regular_never_reads_past_the_cap_of_a_file_that_grew(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """fstat saw a small file; by the read it is larger: refused after reading cap + 1 bytes, not the rest."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * (10 << 20))
    real_fstat, reads = os.fstat, []
    real_read = os.read

    def small_fstat(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, *st[1:6], 10, *st[7:]))

    def counting_read(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(os, "fstat", small_fstat)
    monkeypatch.setattr(os, "read", counting_read)
    with pytest.raises(TooLarge) as info:
        read_regular(path, 1000)
    assert info.value.size == 1001 and sum(reads) == 1001


def test_read_regular_passes_other_errors_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 1000)
    with pytest.raises(NotADirectoryError):
        (tmp_path / "file").write_bytes(b"")
        read_regular(tmp_path / "file" / "below", 1000)


# --- write_atomic ---------------------------------------------------------------------------------------------------
def test_write_atomic_writes_and_replaces_leaving_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    assert write_atomic(target, b"first") is True
    assert write_atomic(str(target), b"second") is True
    assert target.read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["out.json"]


def test_write_atomic_without_replace_keeps_what_is_there(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_bytes(b"theirs")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert write_atomic(target, b"mine", replace=False) is False
    assert write_atomic(tmp_path / "dangling", b"mine", replace=False) is False
    assert write_atomic(tmp_path / "new", b"mine", replace=False) is True
    assert target.read_bytes() == b"theirs" and (tmp_path / "new").read_bytes() == b"mine"
    assert (tmp_path / "dangling").is_symlink() and not (tmp_path / "nowhere").exists()
    assert sorted(os.listdir(tmp_path)) == ["dangling", "new", "out"]


def test_write_atomic_without_hard_links_falls_back_to_a_rename(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(src: Any, dst: Any, **kw: Any) -> None:
        raise PermissionError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    (tmp_path / "taken").write_bytes(b"theirs")
    assert write_atomic(tmp_path / "taken", b"mine", replace=False) is False
    assert write_atomic(tmp_path / "free", b"mine", replace=False) is True
    assert (tmp_path / "taken").read_bytes() == b"theirs" and (tmp_path / "free").read_bytes() == b"mine"
    assert sorted(os.listdir(tmp_path)) == ["free", "taken"]


def test_racing_writers_without_replace_leave_exactly_one_file_whole(tmp_path: Path) -> None:
    target, results = tmp_path / "kernel.so", {}
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        results[i] = write_atomic(target, bytes([i]) * (256 << 10), replace=False)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    [winner] = [i for i, won in results.items() if won]
    assert target.read_bytes() == bytes([winner]) * (256 << 10)
    assert os.listdir(tmp_path) == ["kernel.so"]


def test_write_atomic_sets_the_mode_exactly_or_as_open_does(tmp_path: Path, umask: Any) -> None:
    umask(0o077)
    write_atomic(tmp_path / "exact", b"", mode=0o755)
    write_atomic(tmp_path / "private", b"", mode=0o600)
    write_atomic(tmp_path / "default", b"")
    umask(0o022)
    write_atomic(tmp_path / "default-022", b"")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"exact": 0o755, "private": 0o600, "default": 0o600, "default-022": 0o644}


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace", "link"])
@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["ENOSPC", "KeyboardInterrupt"])
def test_a_failed_write_removes_its_temporary_file_and_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str, exc: BaseException) -> None:
    target = tmp_path / "out"
    target.write_bytes(b"old")

    def fail(*args: Any, **kw: Any) -> Any:
        raise exc

    monkeypatch.setattr(os, fail_at, fail)
    if fail_at == "link" and isinstance(exc, OSError):  # taken for a file system without hard links: the name is
        assert write_atomic(target, b"new", replace=False) is False  # taken, so nothing is renamed over it either
    else:
        with pytest.raises(type(exc)):
            write_atomic(target, b"new" * 1000, fsync=True, replace=fail_at != "link")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["out"] and target.read_bytes() == b"old"


def test_a_short_write_that_makes_no_progress_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(OSError, match="short write"):
        write_atomic(tmp_path / "out", b"data")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    write_atomic(tmp_path / "out", b"0123456789" * 10)
    monkeypatch.undo()
    assert (tmp_path / "out").read_bytes() == b"0123456789" * 10


def test_a_long_name_still_gets_a_temporary_file(tmp_path: Path) -> None:
    name = "k" * 255  # the longest name most file systems allow
    assert write_atomic(tmp_path / name, b"data") is True
    assert os.listdir(tmp_path) == [name]


def test_write_atomic_needs_a_file_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_atomic(str(tmp_path) + "/", b"data")
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing-dir" / "out", b"data")
    assert os.listdir(tmp_path) == []


WRITER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from pytest_megacache.fsutil import write_atomic
target, mode, n = sys.argv[2], sys.argv[3], 1 << 20
for i in range(60):
    data = (b"a" if i % 2 else b"b") * n
    if mode == "atomic":
        write_atomic(target, data)
    else:  # the plain way: truncate, then write in pieces
        with open(target, "wb") as fh:
            for k in range(0, n, n // 16):
                fh.write(data[k:k + n // 16])
                fh.flush()
                time.sleep(0.001)
"""


def _watch(tmp_path: Path, mode: str) -> tuple[set[bytes], int]:
    """Read the file over and over while another process rewrites it; what was seen, and how many partial."""
    target = tmp_path / f"watched-{mode}"
    target.write_bytes(b"a" * (1 << 20))
    package_root = str(Path(fsutil.__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), package_root, str(target), mode])
    seen: set[bytes] = set()
    partial = 0
    try:
        while proc.poll() is None:
            data = read_regular(target, 2 << 20)
            if data in (b"a" * (1 << 20), b"b" * (1 << 20)):
                seen.add(data[:1])
            else:
                partial += 1
    finally:
        proc.wait(60)
    assert proc.returncode == 0
    return seen, partial


def test_a_concurrent_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    seen, partial = _watch(tmp_path, "atomic")
    assert partial == 0
    assert seen == {b"a", b"b"}  # the reads did overlap the rewrites
    assert [p.name for p in tmp_path.iterdir()] == ["watched-atomic"]
    # The same reader does catch a plain writer mid-write: the check above can fail.
    assert _watch(tmp_path, "plain")[1] > 0


def test_importing_it_loads_nothing_beyond_the_package(tmp_path: Path) -> None:
    """The child processes' exit hook imports it: it must add no module to what the package itself loads."""
    code = ("import sys; import pytest_megacache; before = set(sys.modules); import pytest_megacache.fsutil; "
            "print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['pytest_megacache.fsutil']"


def test_only_write_atomic_temporary_files_of_gone_writers_are_strays(tmp_path: Path) -> None:
    from pytest_megacache.fsutil import stray, temp_owner

    assert temp_owner(".cabc.so.123-0123456789ab.tmp") == 123
    assert [temp_owner(n) for n in ("cabc.so", ".cabc.so.123-0123.tmp", ".x.abc-0123456789ab.tmp", "tmpabc")] == [None] * 4
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    gone = tmp_path / f".cabc.so.{int(dead.stdout)}-0123456789ab.tmp"
    mine = tmp_path / f".cabc.so.{os.getpid()}-0123456789ab.tmp"
    other = tmp_path / "cabc.so.tmp"
    for path in (gone, mine, other):
        path.write_bytes(b"half")
    now = time.time()
    assert not stray(str(gone), now)  # just written: left alone whatever else is known
    later = now + 60
    assert stray(str(gone), later) and not stray(str(mine), later) and not stray(str(other), later + 7200)
