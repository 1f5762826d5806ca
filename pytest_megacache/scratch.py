"""The session's scratch directory: the objects it fetches and the compiled files it restores or collects, each in a
file of its own, so that they are never all in memory. Made on first use, removed when the session ends (or at
interpreter exit).

A scratch directory has an owner: its ``owner`` file, locked (``flock``) by the session for its whole life and
released by the system whenever the process ends, even killed. So has every directory the plugin makes in TMPDIR
(:func:`owned_dir`, :data:`OWNED_PREFIXES`: the scratch, an xdist controller's staging, the child processes' spool).
A session making one removes those of sessions that are gone (an unlocked owner file), never one whose owner still
holds the lock: sessions sharing a temporary directory (xdist workers, parallel jobs on one machine) leave each
other's alone. A directory without an owner file (being made this instant, or by an older version) is removed only
once it is a day old.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time
import weakref
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: scratch directories are removed by their own session only
    fcntl = None  # type: ignore[assignment]

from .errors import LocalDiskError, note_free
from .layout import OBJECT_SUFFIX

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .stores import Store

PREFIX = "pytest-megacache-scratch-"
STAGE_PREFIX = "pytest-megacache-xdist-"  # an xdist controller's staging (xdist.staging)
SPOOL_PREFIX = "megacache-children-"  # the child processes' spool (children.hook)
OWNED_PREFIXES = (PREFIX, STAGE_PREFIX, SPOOL_PREFIX)
OWNER = "owner"  # "<pid> <start time>", locked by the owning session for its life
UNOWNED_AGE = 86_400.0  # a directory of these without an owner file is removed once it is this old (seconds)


def unlink(path: str) -> None:
    """Remove a file, if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _claim(path: str) -> int | None:
    """Lock the new scratch directory ``path`` for this process: its owner file, locked before it has its name (a
    sweeping session never sees it unlocked). The open descriptor holds the lock; None where there is no flock."""
    if fcntl is None:  # pragma: no cover - Windows
        return None
    spare = os.path.join(path, f".{OWNER}.{os.getpid()}.tmp")
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()} {time.time():.3f}\n".encode())
        os.rename(spare, os.path.join(path, OWNER))
    except BaseException:
        os.close(fd)
        unlink(spare)
        raise
    return fd


def release(path: str, fd: int | None) -> None:
    """Remove an owned directory, then let its lock go."""
    shutil.rmtree(path, ignore_errors=True)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def owned_dir(prefix: str, base: str | None = None) -> tuple[str, int | None, tuple[int, int]]:
    """A new directory ``<base>/<prefix>*`` (TMPDIR's by default) owned by this process for its life: its path, the
    descriptor that holds the lock (None where there is no ``flock``), and what :func:`sweep` removed first."""
    base = base or tempfile.gettempdir()
    swept = sweep(base)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        fd = _claim(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd, swept


def owner_alive(path: str) -> bool:
    """Whether the process that owns the directory ``path`` still runs (holds its owner file's lock). True where
    it cannot be told (no ``flock``, an owner file made by an older version)."""
    if fcntl is None:  # pragma: no cover - Windows
        return True
    try:
        fd = _lock_if_gone(path)
    except FileNotFoundError:
        return os.path.isdir(path)  # no owner file: an older version's, or being made
    except OSError:
        return True
    if fd is None:
        return True  # held
    os.close(fd)  # the lock taken here goes with it
    return False


def _lock_if_gone(folder: str) -> int | None:
    """The owner file of ``folder``, open and locked by this process where its owner is gone (the caller closes it),
    None where the owner holds it (or there is no ``flock``). Raises FileNotFoundError without an owner file, and
    OSError where it cannot be opened."""
    fd = os.open(os.path.join(folder, OWNER), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if fcntl is None:  # pragma: no cover - Windows
            raise OSError("no flock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its session is running
        os.close(fd)
        return None
    return fd


def sweep(base: str, now: float | None = None) -> tuple[int, int]:
    """Remove the directories of :data:`OWNED_PREFIXES` under ``base`` whose sessions are gone; return how many and
    their bytes."""
    now = time.time() if now is None else now
    removed = size = 0
    try:
        names = [n for n in os.listdir(base) if n.startswith(OWNED_PREFIXES)]
    except OSError:
        return 0, 0
    for name in names:
        folder = os.path.join(base, name)
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                continue
            fd = _lock_if_gone(folder)
        except FileNotFoundError:
            fd = -1
        except OSError:
            continue
        if fd is None:
            continue  # its session is running
        if fd < 0:
            try:
                if now - os.lstat(folder).st_mtime <= UNOWNED_AGE:
                    continue
            except OSError:
                continue
            bytes_ = _tree_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
        else:
            try:
                bytes_ = _tree_bytes(folder)
                shutil.rmtree(folder, ignore_errors=True)  # under its owner's lock, now this process's
            finally:
                os.close(fd)
        if not os.path.lexists(folder):
            removed += 1
            size += bytes_
    return removed, size


def _tree_bytes(folder: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


class Scratch:
    """A temporary directory, ``pytest-megacache-scratch-*``, with an owner (see above); thread-safe. ``swept``:
    the scratch directories of sessions that were gone, removed when this one was made (how many, their bytes)."""

    def __init__(self, base: str | None = None) -> None:
        self._base = base
        self._path: str | None = None
        self._release: weakref.finalize[Any, Any] | None = None  # removes it and lets its lock go, once
        self._lock = threading.Lock()
        self.swept = (0, 0)

    def path(self) -> str:
        with self._lock:
            if self._path is None:
                base = self._base or tempfile.gettempdir()
                try:
                    path, fd, self.swept = owned_dir(PREFIX, base)  # its owner file: the first write there
                except OSError as exc:
                    raise _refused(exc, base) from exc
                self._release = weakref.finalize(self, release, path, fd)
                self._path = path
            return self._path

    def close(self) -> None:
        with self._lock:
            release, self._release, self._path = self._release, None, None
        if release is not None:
            release()

    def fetch(self, store: Store, folder: str, name: str, max_bytes: int) -> str | None:
        """The object in a new scratch file (its path), fetched a chunk at a time; None when it is gone. A local
        disk that refuses the write raises :class:`.errors.LocalDiskError` (not the store's fault). A store whose
        objects are files no one writes again and no one else can (an xdist controller's staging) may give the
        object a second name in the scratch directory instead (``link_object``): no copy."""
        link = getattr(store, "link_object", None)
        if link is not None:
            path = os.path.join(self.path(), f"linked-{os.urandom(8).hex()}{OBJECT_SUFFIX}")
            if link(folder, name, max_bytes, path):
                return path
        try:
            fd, path = tempfile.mkstemp(dir=self.path(), suffix=OBJECT_SUFFIX)
        except OSError as exc:
            raise LocalDiskError.of(exc, self._path or self._base or tempfile.gettempdir(),
                                    f"fetching {name}") from exc
        dest: _Watched | None = None
        try:
            with os.fdopen(fd, "wb") as raw:
                dest = _Watched(raw)
                found = store.fetch(folder, name, max_bytes, dest)  # type: ignore[arg-type]
        except Exception as exc:
            # the store's read went well; writing it here (or flushing it, at the close) did not
            fault = dest.failed if dest is not None and dest.failed is not None else local_fault(exc)
            if fault is not None:
                note_free(fault, path)  # before the partial file goes
            unlink(path)
            if fault is not None:
                raise LocalDiskError.of(fault, path, f"fetching {name}") from exc
            raise
        except BaseException:
            unlink(path)
            raise
        if not found:
            unlink(path)
            return None
        return path


def _refused(exc: OSError, path: str) -> OSError:
    """The scratch directory could not be made: the local disk's fault where it refused a write (full, ...), as
    anywhere else; any other error as it is."""
    fault = local_fault(exc)
    return LocalDiskError.of(fault, path, "making the session's scratch directory") if fault is not None else exc


class _Watched:
    """A file being written that remembers the local error a write raised (a store wraps what it catches)."""

    def __init__(self, raw: object) -> None:
        self.raw = raw
        self.failed: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.raw.write(data)  # type: ignore[attr-defined, no-any-return]
        except OSError as exc:
            self.failed = exc
            raise

    def flush(self) -> None:
        self.raw.flush()  # type: ignore[attr-defined]


def local_fault(exc: BaseException | None) -> OSError | None:
    """The local disk's refusal of a write that ``exc`` is or was caused by (full, over quota, read-only, a file
    over the size limit), or None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, LocalDiskError):
            return exc
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
