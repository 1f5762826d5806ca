"""The local side of a session: its scratch directory has an owner (what sessions that are gone left behind is
removed by the next one, never what a running session uses), and a local disk that refuses a write (a full
TMPDIR) is named as such, apart from the store's faults, in the restore, the collect and the upload.

The full disk is the kernel's own: files of the scratch directory opened on ``/dev/full`` (every write fails with
ENOSPC). The last tests mount a small tmpfs (``small_filesystem``: a user namespace, root or passwordless sudo) and
skip, saying why, where none of these is allowed (fail, where the CI workflow says the runner can mount).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache import report as reportmod
from pytest_megacache import restore as restoremod
from pytest_megacache import scratch as scratchmod
from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.core import CacheSession
from pytest_megacache.files import FileRoot
from pytest_megacache.stores import LocalDirStore, Store

from .conftest import SmallFilesystems, fake_elf
from .test_core import FP, KEY_A, KEY_B, FakeTorch

SCRATCH = scratchmod.PREFIX


@pytest.fixture
def tmpdir_(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own TMPDIR (what ``tempfile`` hands out)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def session(store: Store, root: Path) -> CacheSession:
    return CacheSession(store_factory=lambda: store, folder=f"pytest-megacache/{FP}", fingerprint=FP,
                        roots=[FileRoot("inductor", root)], reads=True, writes=True)


def full_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file made in a scratch directory from now on fills up at once: its writes go to /dev/full (ENOSPC), as
    on a full TMPDIR (making the file itself takes no room)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    real_mkstemp, real_open = tempfile.mkstemp, open

    def mkstemp(suffix: Any = None, prefix: Any = None, dir: Any = None, text: bool = False) -> tuple[int, str]:
        fd, path = real_mkstemp(suffix, prefix, dir, text)
        if SCRATCH in str(dir):
            os.close(fd)
            fd = os.open("/dev/full", os.O_WRONLY)
        return fd, path

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if SCRATCH in str(file) and ("w" in mode or "x" in mode):
            real_open(file, mode, *args, **kwargs).close()
            return real_open("/dev/full", "r+b")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(bundlemod, "open", open_, raising=False)  # write_object's files


def scratch_files(base: Path) -> list[Path]:
    return [p for d in base.glob(SCRATCH + "*") for p in d.rglob("*") if p.is_file() and p.name != scratchmod.OWNER]


def stored(store_dir: Path) -> list[Entries]:
    """Every object of the store, each decoded whole (a partial object would fail here)."""
    return [bundlemod.decode(p.read_bytes(), FP)[1] for p in sorted(store_dir.rglob("*.mcb"))]


# --- scratch with an owner ------------------------------------------------------------------------------------------
HOLDER = """
import sys, tempfile, threading, time
from pathlib import Path
from pytest_megacache.core import CacheSession
from pytest_megacache.files import FileRoot
from pytest_megacache.fsutil import write_atomic
from pytest_megacache.stores import MemoryStore, new_object_name

tempfile.tempdir, cache = sys.argv[1], sys.argv[2]
FOLDER, FP = "pytest-megacache/fp", "fp"
writing = threading.Event()


def kernel():  # a kernel file being written into the cache directory, half done
    yield b"half a kernel"
    writing.set()
    time.sleep(600)
    yield b"never"


class Slow(MemoryStore):
    def fetch(self, folder, name, max_bytes, dest):  # an object half fetched into the scratch directory
        dest.write(b"x" * 4096)
        dest.flush()
        writing.wait()
        print(session.scratch.path(), flush=True)
        time.sleep(600)


store = Slow()
store.put(FOLDER, new_object_name(), b"an object")
threading.Thread(target=write_atomic, args=(cache + "/kernel.so", kernel()), kwargs={"lock": True}, daemon=True).start()
session = CacheSession(store_factory=lambda: store, folder=FOLDER, fingerprint=FP, roots=[FileRoot("inductor", Path(cache))],
                       reads=True, writes=True)
session.start_restore(background=False)
"""


def start_holder(base: Path, cache: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(base), str(cache)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder did not start"
    return proc, Path(line)


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_what_a_killed_session_left_is_removed_and_a_running_sessions_is_kept(
        tmpdir_: Path, tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    """Two sessions share a TMPDIR and a cache directory, each mid-restore (an object half fetched into its scratch,
    a kernel half written into the cache directory); one is killed. The next session's restore removes the killed
    one's scratch directory and its temporary file, and leaves the running one's alone, even once both files look
    old."""
    cache = tmp_path / "inductor"
    cache.mkdir()
    killed, killed_scratch = start_holder(tmpdir_, cache)
    running, running_scratch = start_holder(tmpdir_, cache)
    holders.extend([killed, running])
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    temps = {int(p.name.rsplit(".", 2)[-2].split("-")[0]): p for p in cache.glob(".kernel.so.*.tmp")}
    assert set(temps) == {killed.pid, running.pid}
    for path in temps.values():  # both untouched for a minute: only the lock tells the running writer
        os.utime(path, (time.time() - 60, time.time() - 60))
    unowned = tmpdir_ / (SCRATCH + "older")  # a version without owners, two days ago
    unowned.mkdir()
    os.utime(unowned, (time.time() - 2 * 86_400, time.time() - 2 * 86_400))
    fresh = tmpdir_ / (SCRATCH + "being-made")  # no owner file yet: being made this instant
    fresh.mkdir()

    store = LocalDirStore(tmp_path / "store")
    s = session(store, cache)
    s.start_restore(background=False)
    s.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]

    assert not killed_scratch.exists() and not temps[killed.pid].exists()
    assert list(running_scratch.glob("*.mcb")) and temps[running.pid].exists()
    assert not unowned.exists() and fresh.exists()
    assert s.restore_stats.strays_removed == 1 and s.scratch.swept[0] == 2
    assert s.problems == []
    s.close()
    assert sorted(p.name for p in tmpdir_.iterdir()) == sorted([running_scratch.name, fresh.name])


def test_a_scratch_directory_is_locked_from_its_first_moment(tmpdir_: Path) -> None:
    """The owner file gets its name only once it is locked: another session never finds it unlocked."""
    one = scratchmod.Scratch()
    path = Path(one.path())
    assert (path / scratchmod.OWNER).read_text().split()[0] == str(os.getpid())
    assert scratchmod.sweep(str(tmpdir_)) == (0, 0) and path.exists()  # its own process's lock is held too
    one.close()
    assert not path.exists()


# --- a full TMPDIR ----------------------------------------------------------------------------------------------------
def cold_store(tmp_path: Path, kernel: bytes = fake_elf(b"k" * 1000), store: Store | None = None) -> Store:
    """A store (a directory's unless given) holding one object: a torch entry and a kernel file."""
    store = store if store is not None else LocalDirStore(tmp_path / "store")
    cold = session(store, tmp_path / "cold")
    cold.start_restore(background=False)
    (tmp_path / "cold" / "ab").mkdir(parents=True)
    (tmp_path / "cold" / "ab" / "cabc.so").write_bytes(kernel)
    cold.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    assert cold.upload_stats.objects == 1, cold.problems
    cold.close()
    return store


def test_a_full_tmpdir_in_the_restore_is_the_local_disk_and_the_objects_are_decoded_in_memory(
        tmpdir_: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: Store) -> None:
    """On S3 and on a directory store alike: the store's read went well, writing it into scratch did not."""
    store = cold_store(tmp_path, store=shared)
    full_scratch(monkeypatch)
    warm = session(store, tmp_path / "warm")
    warm.start_restore(background=False)
    [problem] = warm.problems
    assert problem.startswith("TMPDIR full (") and "fetching" in problem and str(tmpdir_) in problem, problem
    assert "1 object(s) decoded in memory, 0 left out" in problem
    assert "cannot read" not in problem and "S3" not in problem
    assert not warm.store_down and warm.restore_stats.ok and warm.restore_stats.objects_in_memory == 1
    assert (tmp_path / "warm" / "ab" / "cabc.so").read_bytes() == fake_elf(b"k" * 1000)
    monkeypatch.undo()  # room again: the upload goes ahead (the store was never down)
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir_))
    warm.finish(FakeTorch([KEY_A, KEY_B]))  # type: ignore[arg-type]
    assert warm.upload_stats.objects == 1 and warm.upload_stats.reason is None
    assert len(store.list(f"pytest-megacache/{FP}")) == 2


def test_an_object_too_large_for_memory_is_left_out_with_the_same_one_warning(
        tmpdir_: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = cold_store(tmp_path)
    full_scratch(monkeypatch)
    monkeypatch.setattr(restoremod, "IN_MEMORY_BYTES", 100)
    warm = session(store, tmp_path / "warm")
    warm.start_restore(background=False)
    [problem] = warm.problems
    assert problem.startswith("TMPDIR full (") and "0 object(s) decoded in memory, 1 left out" in problem, problem
    assert not warm.store_down and warm.restore_stats.objects_left_out == 1 and not warm.restored
    line = reportmod._restore_lines(warm.restore_stats, 0)[0]
    assert "1 left out (no room in TMPDIR)" in line, line


def test_a_full_tmpdir_while_decoding_falls_back_to_memory(
        tmpdir_: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object fits in scratch, its files do not (``payload`` writes them to scratch files)."""
    store = cold_store(tmp_path)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    real = tempfile.mkstemp

    def mkstemp(suffix: Any = None, prefix: Any = None, dir: Any = None, text: bool = False) -> tuple[int, str]:
        fd, path = real(suffix, prefix, dir, text)
        if suffix == ".entry":
            os.close(fd)
            fd = os.open("/dev/full", os.O_WRONLY)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    warm = session(store, tmp_path / "warm")
    warm.start_restore(background=False)
    [problem] = warm.problems
    assert problem.startswith("TMPDIR full (") and "decoding" in problem and "1 object(s) decoded in memory" in problem
    assert (tmp_path / "warm" / "ab" / "cabc.so").exists() and warm.restore_stats.objects_in_memory == 1
    assert scratch_files(tmpdir_) == []  # no part of an entry left in scratch


def test_a_full_tmpdir_in_the_upload_says_what_was_not_uploaded(
        tmpdir_: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirStore(tmp_path / "store")
    cold = session(store, tmp_path / "cold")
    cold.start_restore(background=False)
    full_scratch(monkeypatch)
    cold.finish(FakeTorch([KEY_A, KEY_B]))  # type: ignore[arg-type]
    [problem] = cold.problems
    assert problem.startswith("TMPDIR full (") and "writing the upload's object" in problem, problem
    assert problem.endswith("No space left on device; 2 entries (116 B raw) not uploaded"), problem
    reason = cold.upload_stats.reason
    assert reason is not None and reason.startswith("TMPDIR full (") and reason.endswith("not uploaded"), reason
    assert reportmod._upload_lines(cold.upload_stats, 0) == [f"uploaded nothing: {reason}"]
    assert stored(tmp_path / "store") == [] and scratch_files(tmpdir_) == []


def test_a_file_left_out_of_the_upload_is_one_warning_and_a_summary_line(
        tmpdir_: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch directory has no room for a collected file (the precompiled header, say): the object is
    stored without it, and the session says so once, with the count, the bytes and the first path."""
    store = LocalDirStore(tmp_path / "store")
    cold = session(store, tmp_path / "cold")
    cold.start_restore(background=False)
    (tmp_path / "cold" / "ab").mkdir(parents=True)
    (tmp_path / "cold" / "ab" / "cabc.so").write_bytes(fake_elf(b"k" * 5000))
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    real = tempfile.mkstemp

    def mkstemp(suffix: Any = None, prefix: Any = None, dir: Any = None, text: bool = False) -> tuple[int, str]:
        fd, path = real(suffix, prefix, dir, text)
        if suffix == ".entry":  # the collect's copies: no room; the object itself fits
            os.close(fd)
            fd = os.open("/dev/full", os.O_WRONLY)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    cold.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    [problem] = cold.problems
    assert problem.startswith("TMPDIR full (") and "copying ab/cabc.so" in problem, problem
    assert "1 file(s) (5.1 KB) left out of the upload, first ab/cabc.so: No space left on device" in problem
    lines = reportmod._upload_lines(cold.upload_stats, 0)
    assert "left out of the upload: 1 file (5.1 KB), first ab/cabc.so: No space left on device" in lines, lines
    [entries] = stored(tmp_path / "store")
    assert [e.kind for e in entries] == ["torch/inductor"]



def test_restored_files_are_held_once_and_a_merge_never_stores_one_changed_in_its_place(
        tmpdir_: Path, tmp_path: Path) -> None:
    """A warm session holds no copy of what it wrote into its cache directory (it reads the files there when it
    merges): the file in place is the scratch file the restore decoded, under a second name, never a copy of it. A
    test that rewrote a restored file in place (the same size) does not get its bytes stored under the restored name:
    that merge is skipped, the new entries are stored alone, and nothing stored is deleted."""
    store = cold_store(tmp_path)
    warm = CacheSession(store_factory=lambda: store, folder=f"pytest-megacache/{FP}", fingerprint=FP,
                        roots=[FileRoot("inductor", tmp_path / "warm")], reads=True, writes=True, compact_after=1)
    decoded: set[int] = set()  # the inodes of the scratch files the restore decoded entries into
    real = tempfile.mkstemp

    def mkstemp(suffix: Any = None, prefix: Any = None, dir: Any = None, text: bool = False) -> tuple[int, str]:
        fd, path = real(suffix, prefix, dir, text)
        if suffix == ".entry":
            decoded.add(os.fstat(fd).st_ino)
        return fd, path

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "mkstemp", mkstemp)
        warm.start_restore(background=False)
    placed = tmp_path / "warm" / "ab" / "cabc.so"
    assert placed.read_bytes() == fake_elf(b"k" * 1000) and scratch_files(tmpdir_) == []
    assert placed.stat().st_ino in decoded, "the restored file is a copy of its scratch file"
    placed.write_bytes(fake_elf(b"j" * 1000))
    warm.finish(FakeTorch([KEY_A, KEY_B]))  # type: ignore[arg-type]
    assert warm.problems == [] and warm.upload_stats.objects == 1 and warm.upload_stats.compacted == 0
    assert any(n.startswith("compaction skipped: the copy of 'ab/cabc.so'") for n in warm.notes), warm.notes
    objects = stored(tmp_path / "store")
    assert len(objects) == 2 and [e.data for o in objects for e in o if e.name == "ab/cabc.so"] == [
        fake_elf(b"k" * 1000)]
    warm.close()


@pytest.mark.parametrize("staged_kept", [True, False])
def test_an_xdist_controller_holds_no_copy_of_what_it_staged_and_reads_it_back_to_merge(
        tmpdir_: Path, tmp_path: Path, staged_kept: bool) -> None:
    """The controller writes no files into place: once its restore is staged for the workers, its own copies go,
    and a merge reads them back from the staged object. Without it (removed meanwhile), the merge is skipped and
    nothing stored is lost."""
    from functools import partial

    from pytest_megacache.xdist import staging

    store = cold_store(tmp_path)
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    controller = CacheSession(store_factory=lambda: store, folder=f"pytest-megacache/{FP}", fingerprint=FP, roots=[],
                              reads=True, writes=True, compact_after=1, stage=partial(staging.stage, stage_dir))
    controller.start_restore(background=False)
    [staged] = (stage_dir / staging.STAGE_FOLDER).glob("*.mcb")
    assert scratch_files(tmpdir_) == [] and controller.problems == []
    # A worker takes the staged object without copying it (a second name of its file), and leaves it there.
    worker = CacheSession(store_factory=lambda: staging.StagedStore(stage_dir, 5), folder=staging.STAGE_FOLDER,
                          fingerprint=FP, roots=[FileRoot("inductor", tmp_path / "gw0")], reads=True, writes=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalDirStore, "fetch", lambda *a: pytest.fail("the staged object was copied"))
        worker.start_restore(background=False)
    assert worker.problems == [] and worker.restore_stats.files_written == 1 and staged.stat().st_nlink == 1
    assert (tmp_path / "gw0" / "ab" / "cabc.so").read_bytes() == fake_elf(b"k" * 1000)
    worker.close()
    if not staged_kept:
        staged.unlink()
    controller.finish(FakeTorch([KEY_A, KEY_B]))  # type: ignore[arg-type]
    objects = stored(tmp_path / "store")
    files = [e.data for o in objects for e in o if e.name == "ab/cabc.so"]
    if staged_kept:
        assert controller.problems == [] and controller.upload_stats.compacted == 1
        assert len(objects) == 1 and files == [fake_elf(b"k" * 1000)] and len(objects[0]) == 3
    else:
        [problem] = controller.problems
        assert problem.startswith("reading back the staged restore for a merge: "), problem
        assert any(n.startswith("compaction skipped: the copy of 'ab/cabc.so'") for n in controller.notes)
        assert len(objects) == 2 and files == [fake_elf(b"k" * 1000)]
    controller.close()

# --- a Dynamo entry traced again in place of a refused one --------------------------------------------------------------
class Precompile(FakeTorch):
    """Saves one Dynamo entry under a fixed key, with the bytes given; ``refused``: the stored one was refused when
    loaded (as Dynamo reuse counts it)."""

    def __init__(self, data: bytes, refused: str | bool = False) -> None:
        self.data, self.refused = data, "load_failed" if refused is True else refused
        super().__init__([KEY_A])

    def save(self) -> bytes | None:
        from pytest_megacache import torchfmt

        return torchfmt.serialize([("inductor", KEY_A, b"graph"), ("precompile", "p" * 64, self.data)])

    def counters(self) -> dict[str, int]:
        return {**super().counters(), **({f"dynamo_refused_{self.refused}": 1} if self.refused else {})}


def precompile_copies(store_dir: Path) -> list[bytes]:
    return [e.data for entries in stored(store_dir) for e in entries if e.kind == "torch/precompile"]


def test_a_dynamo_entry_traced_again_replaces_the_refused_one_at_once(tmpdir_: Path, tmp_path: Path) -> None:
    """A stored Dynamo entry that was refused at load is traced again under its key: the fresh one is uploaded, and
    the upload merges, dropping the refused copy at once (else every warm run would fetch it, refuse it and
    trace)."""
    store = LocalDirStore(tmp_path / "store")
    for name, torch in (("cold", Precompile(b"refused when loaded")), ("warm", Precompile(b"traced again", True))):
        s = session(store, tmp_path / name)
        s.start_restore(background=False)
        s.finish(torch)  # type: ignore[arg-type]
        assert s.problems == [], s.problems
        s.close()
    assert s.upload_stats.new_entries == {"torch/precompile": 1}
    assert precompile_copies(tmp_path / "store") == [b"traced again"]
    again = session(store, tmp_path / "again")
    again.start_restore(background=False)
    again.finish(Precompile(b"traced again"))  # type: ignore[arg-type]
    assert again.upload_stats.reason == "nothing new"


@pytest.mark.parametrize("refused", [False, "global_changed"])
def test_a_dynamo_entry_that_grew_is_uploaded_and_wins_merged_at_the_next_merge(tmpdir_: Path, tmp_path: Path,
                                                                                 refused: str | bool) -> None:
    """Without a refusal (a variant added to an installed entry), the grown entry is uploaded and is the one a
    restore takes; the older copy goes at the next merge, as overlapping objects do. So too where a stored variant
    was refused because a global names another object in this process: the entry written keeps that variant for the
    processes where it holds, so the older copy holds nothing the new one lacks (merging the scope at once stored
    the whole scope, compiled kernels included, again at the end of every warm run)."""
    store = LocalDirStore(tmp_path / "store")
    for name, data in (("cold", b"one variant"), ("warm", b"two variants")):
        s = session(store, tmp_path / name)
        s.start_restore(background=False)
        s.finish(Precompile(data, refused if name == "warm" else False))  # type: ignore[arg-type]
        s.close()
    assert sorted(precompile_copies(tmp_path / "store")) == [b"one variant", b"two variants"]
    merge = session(store, tmp_path / "merge")
    merge.start_restore(background=False)
    assert merge.restored.get(("torch/precompile", "p" * 64)) == Entry("torch/precompile", "p" * 64, b"two variants")
    merge.finish(Precompile(b"two variants"))  # type: ignore[arg-type]
    assert merge.upload_stats.converged == 2 and precompile_copies(tmp_path / "store") == [b"two variants"]


def test_entries_whose_newest_copy_wins() -> None:
    old, new = Entry("torch/precompile", "k", b"old"), Entry("torch/precompile", "k", b"new")
    merged = Entries([old])
    merged.merge([new])
    assert merged.get(old.ident) == new
    assert list(Entries([new]).minus(Entries([old]))) == [new]
    assert list(Entries([Entry("torch/inductor", "k", b"b")]).minus(Entries([Entry("torch/inductor", "k", b"a")]))) == []


# --- a real small file system -----------------------------------------------------------------------------------------
def test_on_a_small_tmpfs_restore_and_upload_each_warn_once_and_store_nothing_partial(
        small_filesystem: SmallFilesystems, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_tmpfs = small_filesystem("2m")
    big = fake_elf(os.urandom(3 << 20))  # incompressible: its object does not fit in 2 MB either
    store = cold_store(tmp_path, big)
    monkeypatch.setattr(tempfile, "tempdir", str(small_tmpfs))
    warm = session(store, tmp_path / "warm")
    warm.start_restore(background=False)
    [problem] = warm.problems
    assert problem.startswith("TMPDIR full (0 MB free)"), problem  # read at the failure (the partial file gone, 2 MB)
    assert "1 object(s) decoded in memory, 0 left out (nothing of the cache lost" in problem, problem
    assert (tmp_path / "warm" / "ab" / "cabc.so").read_bytes() == big and not warm.store_down
    (tmp_path / "warm" / "cd").mkdir()
    (tmp_path / "warm" / "cd" / "cdef.so").write_bytes(fake_elf(os.urandom(3 << 20)))
    warm.finish(FakeTorch([KEY_A, KEY_B]))  # type: ignore[arg-type]
    [_, left_out] = warm.problems
    assert left_out.startswith("TMPDIR full (0 MB free)"), left_out  # read at the failure, not once the copy has gone
    assert "1 file(s) (3.1 MB) left out of the upload, first cd/cdef.so" in left_out
    assert warm.upload_stats.objects == 1
    objects = stored(tmp_path / "store")  # each one whole
    assert len(objects) == 2 and not any(e.name == "cd/cdef.so" for entries in objects for e in entries)
    warm.close()
    assert list(small_tmpfs.iterdir()) == []


def test_a_tmpdir_full_before_the_scratch_exists_is_said_as_the_local_disk_fault(
        small_filesystem: SmallFilesystems, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that restored nothing (an empty store) makes its scratch directory only at its end, to collect what
    it compiled: TMPDIR filled during the tests refuses its owner file, the first write there. That is the local
    disk's fault as anywhere else: one warning naming TMPDIR, and what was not uploaded, in the summary too."""
    small_tmpfs = small_filesystem("2m")
    store = LocalDirStore(tmp_path / "store")
    monkeypatch.setattr(tempfile, "tempdir", str(small_tmpfs))
    cold = session(store, tmp_path / "cold")
    cold.start_restore(background=False)
    assert cold.problems == [] and list(small_tmpfs.iterdir()) == []  # nothing restored: no scratch yet
    filler = small_tmpfs / "filled-during-the-tests"
    with open(filler, "wb", buffering=0) as out:
        with pytest.raises(OSError, match="No space left"):
            while True:
                out.write(b"\0" * 65536)
    (tmp_path / "cold" / "ab").mkdir(parents=True)
    (tmp_path / "cold" / "ab" / "cabc.so").write_bytes(fake_elf(b"k" * 1000))
    cold.finish(FakeTorch([KEY_A]))  # type: ignore[arg-type]
    [problem] = cold.problems
    assert problem.startswith("TMPDIR full (") and "not uploaded" in problem, problem
    reason = cold.upload_stats.reason
    assert reason is not None and reason.startswith("TMPDIR full (") and "not uploaded" in reason, reason
    assert list((tmp_path / "store").rglob("*.mcb")) == []
    filler.unlink()
    cold.close()
    assert list(small_tmpfs.iterdir()) == []


# --- what killed sessions leave in TMPDIR ---------------------------------------------------------------------------
WAITING = textwrap.dedent("""
    import os, time
    from pathlib import Path

    def test_waits_until_released():
        Path(os.environ["STARTED"], str(os.getpid())).touch()
        while not Path(os.environ["RELEASE"]).exists():
            time.sleep(0.05)

    def test_waits_too():
        test_waits_until_released()
    """)


def plugin_dirs(tmpdir: Path) -> set[str]:
    return {p.name for p in tmpdir.iterdir() if p.name.startswith(scratchmod.OWNED_PREFIXES)}


def test_killed_plain_and_xdist_sessions_leave_nothing_after_the_next_one_and_a_live_ones_stay(
        tmp_path: Path) -> None:
    """Three sessions in one TMPDIR: a plain one and an xdist one (-n 2) killed with SIGKILL while their tests run,
    one left running. The next session removes what the killed ones made (the spools, the controller's staging),
    never what the running one holds; that one removes its own when it ends."""
    tmpdir, project = tmp_path / "tmp", tmp_path / "project"
    tmpdir.mkdir()
    project.mkdir()
    (project / "test_waiting.py").write_text(WAITING)
    env = {**os.environ, "TMPDIR": str(tmpdir), "MEGACACHE_DIR": str(tmp_path / "store"), "RELEASE": str(tmp_path / "go")}

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        started = tmp_path / name
        started.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                                cwd=project, env={**env, "STARTED": str(started)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(list(started.iterdir())) < (2 if "-n" in args else 1):  # every test process is in a test
            assert proc.poll() is None and time.monotonic() < deadline, name
            time.sleep(0.05)
        return proc

    before = plugin_dirs(tmpdir)
    assert before == set()
    running = start("running", "-k", "until_released")
    live = plugin_dirs(tmpdir)
    assert any(n.startswith(scratchmod.SPOOL_PREFIX) for n in live), live
    plain = start("plain", "-k", "until_released")
    xdist = start("xdist", "-n", "2")
    left = plugin_dirs(tmpdir) - live
    assert {n[:len(scratchmod.STAGE_PREFIX)] for n in left} >= {scratchmod.STAGE_PREFIX}, left
    assert sum(n.startswith(scratchmod.SPOOL_PREFIX) for n in left) == 2, left  # the plain one's, the controller's
    for proc in (plain, xdist):
        proc.send_signal(signal.SIGKILL)  # pytest's own process: the xdist workers are left orphaned
        proc.wait()
    assert plugin_dirs(tmpdir) == live | left  # nothing removed them

    nxt = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "nothing"],
                         cwd=project, env=env, capture_output=True, timeout=300)
    assert nxt.returncode == 5, nxt.stdout[-2000:]  # no test selected: the session still starts and ends
    assert plugin_dirs(tmpdir) == live  # what the killed sessions left is gone, the running one's is there
    (tmp_path / "go").touch()
    assert running.wait(timeout=120) == 0
    assert plugin_dirs(tmpdir) == set()


def test_an_orphaned_worker_hands_nothing_over_into_a_staging_directory_whose_controller_is_gone(
        tmp_path: Path) -> None:
    """The staging directory's owner is the controller: killed, its lock goes, and a worker that finishes after it
    writes nothing there (no one would take it, and it would stay)."""
    from pytest_megacache.xdist import staging

    made = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys
        from pytest_megacache.xdist import staging
        print(staging.make_stage_dir(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert made.returncode == -signal.SIGKILL
    stage_dir = Path(made.stdout.strip())
    entries = Entries([Entry("torch/inductor", KEY_A, b"compiled")])
    assert staging.hand_over(stage_dir, "gw0", entries, FP) == {"object": None}
    assert sorted(p.name for p in stage_dir.iterdir()) == [scratchmod.OWNER]
    live = staging.make_stage_dir()  # its controller (this process) alive: handed over as before
    try:
        handed = staging.hand_over(live, "gw0", entries, FP)
        assert handed["object"] and Path(handed["object"]).is_file()
    finally:
        staging.remove_stage_dir(live)
    assert not live.exists()


class WithDynamoEntry(FakeTorch):
    """A session that also stored a Dynamo entry (larger than the small file system below holds)."""

    def save(self) -> bytes | None:
        from pytest_megacache import torchfmt

        return torchfmt.serialize([("inductor", k, f"graph {k}".encode()) for k in self.keys]
                                  + [("precompile", "fn-key", os.urandom(300 << 10))])


def test_on_a_full_torch_cache_directory_dynamo_entries_are_not_placed_and_said_once(
        small_filesystem: SmallFilesystems, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restored Dynamo entry is a file of torch's Dynamo cache: where that file system is full, torch's other
    artifacts are still loaded, the entries are named in one problem (their frames are traced), and nothing partial
    is left where torch would read it."""
    store = LocalDirStore(tmp_path / "store")
    cold = session(store, tmp_path / "cold")
    cold.start_restore(background=False)
    cold.finish(WithDynamoEntry([KEY_A]))  # type: ignore[arg-type]
    assert cold.upload_stats.objects == 1, cold.problems
    cold.close()
    full = small_filesystem("64k")
    (full / "filler").write_bytes(b"\0" * 60 * 1024)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(full))
    warm = session(store, tmp_path / "warm")
    warm.start_restore(background=False)
    torch = FakeTorch([])
    warm.load_into_torch(loader=torch.load)
    [problem] = warm.problems
    assert problem.startswith("restored Dynamo entries not placed") and "No space left" in problem, problem
    assert warm.load_stats.ok and warm.load_stats.artifacts == {"inductor": 1}, warm.load_stats
    assert [k for _t, k, _c in torch.loaded[0]] == [KEY_A]
    assert not [p for p in (full / "dynamo").rglob("*") if p.is_file()]
    warm.close()
