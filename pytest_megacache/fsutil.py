"""Small files written whole or not at all, and read only when they are what they claim to be.

:func:`write_atomic` writes a file as a temporary file beside it (``.<name>.<pid>-<random>.tmp``, created with
``O_EXCL`` and without following a link) that is renamed into place, so a reader sees the old file, the new one or
none, never a part; the temporary file is removed on any failure. With ``replace=False`` an existing name is never
overwritten (a hard link that fails when the name is taken), for writers that race each other into one directory.

:func:`read_regular` reads a whole regular file of at most ``max_bytes``: never through a symbolic link, never
blocking on a FIFO, never reading past the cap (a file that grows while it is read is refused too). What it will not
read raises :class:`Refused` (an ``OSError``) with a short fixed reason that holds nothing of the file's content.

Imports ``os``, ``stat`` and ``errno`` only (loaded at every interpreter start): the child processes' exit hook
(:mod:`.children.hook`) writes its record with it.
"""

from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False  # typing is not imported at run time (see above)
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from typing import BinaryIO

__all__ = ["Refused", "TooLarge", "copy_regular", "read_regular", "stray", "temp_owner", "temp_path", "write_atomic"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_TEMP_NAME_CHARS = 64  # of the target's name in the temporary file's (a long name must not make it too long)
_READ_CHUNK = 1 << 20


class Refused(OSError):
    """A file :func:`read_regular` does not read: a symbolic link, not a regular file, or larger than the cap.
    ``str()`` is the reason alone ("a symbolic link", "not a regular file", "larger than N bytes")."""


class TooLarge(Refused):
    """A file over the cap; ``size`` is the size seen (at least ``max_bytes + 1``)."""

    def __init__(self, max_bytes: int, size: int) -> None:
        super().__init__(f"larger than {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.size = size


def _open_regular(full: str, max_bytes: int) -> tuple[int, int]:
    """An open descriptor of the regular file at ``full`` and its size, refused as :func:`read_regular` says."""
    if stat.S_ISLNK(os.lstat(full).st_mode):
        raise Refused("a symbolic link")
    try:
        fd = os.open(full, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC | _O_BINARY)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the last part became a link after lstat
            raise Refused("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file")
        if st.st_size > max_bytes:
            raise TooLarge(max_bytes, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The whole content of the regular file at ``path``, at most ``max_bytes`` long.

    Raises :class:`Refused` for a symbolic link (also one swapped in between the check and the open), anything that
    is not a regular file (a FIFO is opened without blocking and refused) and a file over ``max_bytes``
    (:class:`TooLarge`); other ``OSError`` as the system raises it (``FileNotFoundError``, ``PermissionError``)."""
    fd, st_size = _open_regular(os.fspath(path), max_bytes)
    try:
        chunks: list[bytes] = []
        size = 0
        want = max(st_size + 1, _READ_CHUNK)  # the whole file in one read, as a rule (one copy in memory)
        while size <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - size, want))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            want = _READ_CHUNK
        if size > max_bytes:  # it grew after fstat
            raise TooLarge(max_bytes, size)
        return b"".join(chunks)
    finally:
        os.close(fd)


def copy_regular(path: str | os.PathLike[str], max_bytes: int, dest: BinaryIO) -> int:
    """Copy the regular file at ``path`` into ``dest`` a chunk at a time; return how many bytes. Refuses what
    :func:`read_regular` refuses, a file that grows past ``max_bytes`` while it is copied included."""
    fd, _size = _open_regular(os.fspath(path), max_bytes)
    try:
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - size, _READ_CHUNK))
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(max_bytes, size)
            dest.write(chunk)
        return size
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | BinaryIO | Iterator[bytes], *, mode: int | None = None,
                 replace: bool = True, fsync: bool = False, lock: bool = False) -> bool:
    """Write ``data`` (bytes, chunks of bytes, or a binary file read to its end a chunk at a time) as the file
    ``path``, whole or not at all; True when written.

    ``mode``: the file's permission bits, exactly (the umask does not apply; the file is private until then), or
    None for what ``open()`` creates (0o666 less the umask). ``replace=False``: leave an existing ``path`` (even a
    dangling link) as it is and return False. ``fsync``: flush the data to disk before the rename. ``lock``: hold an
    ``flock`` on the temporary file while it is written, so that :func:`stray` tells it from one a killed writer left
    (:func:`stray` also waits for a file's first seconds, before the lock is taken). The directory
    must exist. Raises ``OSError`` (a full disk, no permission); whatever is raised, even a ``BaseException``, the
    temporary file is gone and ``path`` is as it was."""
    target = os.fspath(path)
    tmp = temp_path(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC | _O_BINARY
    fd = os.open(tmp, flags, 0o666 if mode is None else 0o600)
    renamed = False
    try:
        try:
            if lock:
                import fcntl  # only where asked: this module is loaded at every interpreter start

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if mode is not None:
                if hasattr(os, "fchmod"):
                    os.fchmod(fd, mode)
                else:  # pragma: no cover - Windows before Python 3.13
                    os.chmod(tmp, mode)
            for piece in _pieces(data):
                view = memoryview(piece)
                while view:
                    written = os.write(fd, view)
                    if written <= 0:
                        raise OSError(errno.EIO, "short write", tmp)
                    view = view[written:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, target)
            renamed = True
            return True
        try:
            os.link(tmp, target)  # fails if the name is taken: a concurrent writer's file stays
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: rename, unless the name is taken by now
            if os.path.lexists(target):
                return False
            os.replace(tmp, target)
            renamed = True
        return True
    finally:
        if not renamed:
            try:
                os.unlink(tmp)
            except OSError:
                pass



def temp_path(target: str) -> str:
    """A new temporary name beside ``target`` (``.<name>.<pid>-<random>.tmp``): what this process writes or links
    there before it is renamed to ``target`` (:func:`temp_owner` reads the pid back, :func:`stray` tells it apart)."""
    folder, name = os.path.split(target)
    if not name:
        raise ValueError(f"not a file name: {target!r}")
    return os.path.join(folder, f".{name[:_TEMP_NAME_CHARS]}.{os.getpid()}-{os.urandom(6).hex()}.tmp")


def temp_owner(name: str) -> int | None:
    """The process id in the name of a temporary file of :func:`write_atomic` (``.<name>.<pid>-<hex12>.tmp``), or
    None for any other name."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    tail = name[:-4].rpartition(".")[2]
    pid, dash, rand = tail.partition("-")
    if not (dash and pid.isdigit() and len(rand) == 12 and all(c in "0123456789abcdef" for c in rand)):
        return None
    return int(pid)


STRAY_GRACE = 2.0  # seconds a temporary file is left alone after its last write, whatever else is known


def stray(path: str, now: float) -> bool:
    """Whether the temporary file of :func:`write_atomic` at ``path`` was left by a writer that is gone: untouched
    for :data:`STRAY_GRACE` seconds, its writer's lock (``lock=True``) not held, and its writer's process not
    running here (a writer that took no lock: an older version, a process of another machine sharing the
    directory is kept for an hour)."""
    pid = temp_owner(os.path.basename(path))
    if pid is None:
        return False
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STRAY_GRACE:
            return False
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except OSError:
        return False
    try:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its writer holds it
    except ImportError:  # pragma: no cover - Windows
        pass
    finally:
        os.close(fd)
    if now - st.st_mtime > 3600:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process of that id: running
        return False
    return False


def _pieces(data: bytes | BinaryIO | Iterator[bytes]) -> Iterable[bytes]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data]
    if hasattr(data, "read"):
        source = data
        return iter(lambda: source.read(_READ_CHUNK), b"")
    return data
