"""Compiled files that torch's mega-cache leaves out (CPU C++ kernels), carried as ``file/<root>`` entries.

On CPU, an FX-graph cache hit still makes g++ rebuild every kernel: the ``.so`` files live only in
TORCHINDUCTOR_CACHE_DIR. This module snapshots a cache directory, collects the files a session added,
and restores files into a fresh directory: atomically (a temporary file moved into place,
:func:`.fsutil.write_atomic`), never overwriting what is there, never following a link (when reading either,
:func:`.fsutil.read_regular`), never leaving the directory.
"""

from __future__ import annotations

import errno
import getpass
import json
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from . import torchfmt
from .bundle import FILE_PREFIX, Entries, Entry, validate_file_path
from .errors import BundleError, LocalDiskError, note_free
from .fsutil import copy_regular, read_regular, stray, temp_owner, temp_path, write_atomic
from .scratch import unlink

# What must not travel (locks, temp files, the precompiled header, Inductor's copy of Triton kernels that
# travel inside FX-graph entries, dynamic-shape profiles). (Inductor's "triton" folder here is its own; a
# TRITON_CACHE_DIR is a root of its own, below.)
EXCLUDED_TOP = frozenset({"dynamo", "locks", "precompiled_headers", "triton"})
_EXCLUDED_NAME = re.compile(r"(^\.|^tmp|\.lock$|\.tmp|~$)")
MAX_FILE_BYTES = 256 << 20
# Inductor builds a kernel's .so with g++ writing straight into the cache directory, under an flock on
# ``locks/<key>.lock``; another process sharing the directory (an xdist worker, a second session) may be
# mid-build when this one collects. The collector takes the same lock (shared) before reading, waiting at
# most this long in all (per collect, not per file), and never carries an ELF file shorter than its
# own headers say.
LOCK_WAIT_SECONDS = 30.0
# What the disk says when no later file could be written either: the restore stops there.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_ELF_SUFFIXES = (".so", ".o")
ELF_HEAD = 64  # the bytes of an ELF file that say how long it must be
PCH_HEAD = 4096  # a precompiled header's one-line header file is shorter; its binary is told by its first bytes
# In TRITON_CACHE_DIR, max-autotune's benchmark candidates (kernels named after their template, "triton_mm",
# "triton_bmm", ..., never compiled again once the autotune results are restored: 47 MB raw of the example's
# 87 MB) stay behind. Everything else travels: user @triton.jit kernels, Triton's launcher modules, and Inductor's
# own kernels, because a kernel autotuned at run time (max-autotune, coordinate descent) is compiled for its
# chosen config after its FX-graph entry was saved, so only TRITON_CACHE_DIR holds that binary (measured on an
# H100: a warm run without these folders compiled 7 of the max-autotune graph's kernels again, hot runs none).
_AUTOTUNE_CANDIDATE = re.compile(r"^(__grp__)?triton_(mm|bmm)[_.]")
# Inductor's CPU precompiled header (``codecache._precompile_header``): ``<hash>.h`` holding one ``#include``
# line and g++'s ``<hash>.h.gch`` (clang: ``.h.pch``) next to it. The hash covers the compile command, the
# preprocessed header and the compiler version, so a carried header is used only where torch would have
# built the same one; anything else in the directory stays.
_PCH_NAME = re.compile(r"[a-z0-9]{8,64}\.h(\.gch|\.pch)?")
_PCH_INCLUDE = re.compile(rb"#include <[A-Za-z0-9_./]{1,200}>\n")
_PCH_MAGIC = (b"gpch", b"CPCH")
# Triton's group file for one compiled kernel, ``<hash>/__grp__<kernel>.json``: {"child_paths": {file name: absolute
# path}}, the paths in the directory it was compiled in (Triton 3.3 to 3.9: ``FileCacheManager.put_group``).
# Triton counts the kernel as cached only where every path exists (``get_group``), so a group restored into
# another directory is rewritten for it (:func:`relocate_triton_group`).
_TRITON_GROUP = re.compile(r"__grp__[^/]+\.json")
MAX_GROUP_FILES = 64
T = TypeVar("T")


def default_cache_dir() -> Path:
    """torch's default cache directory (``runtime/cache_dir_utils.default_cache_dir``), without torch:
    ``torchinductor_<user>`` under the temporary directory."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir(), "torchinductor_" + user).absolute()


def inductor_cache_dir(env: dict[str, str] | None = None) -> Path:
    """TORCHINDUCTOR_CACHE_DIR as torch resolves it (``runtime/cache_dir_utils.py``), without torch."""
    configured = (os.environ if env is None else env).get("TORCHINDUCTOR_CACHE_DIR")
    return Path(configured).absolute() if configured else default_cache_dir()


def pch_dir() -> Path:
    """Where Inductor keeps its CPU precompiled headers: ``precompiled_headers`` under torch's *default*
    cache directory, which TORCHINDUCTOR_CACHE_DIR does not move (``codecache._HEADER_DIR``)."""
    return default_cache_dir() / "precompiled_headers"


def pch_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether Inductor precompiles its CPU header (``config.cpp_cache_precompile_headers``; on by default)."""
    value = (os.environ if env is None else env).get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")
    return os.name != "nt" and value == "1"


def triton_cache_dir(env: dict[str, str] | None = None) -> Path:
    """TRITON_CACHE_DIR as Triton resolves it (``knobs.cache.dir``), without importing Triton."""
    env = dict(os.environ if env is None else env)
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"]).absolute()
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return Path(home, ".triton", "cache").absolute()


def torch_cache_ident(rel: str) -> tuple[str, str] | None:
    """The torch artifact a file of torch's own on-disk caches holds, as ``(kind, key)``: an FX graph
    (``fxgraph/<k[1:3]>/<key>/<entry>``) or an AOTAutograd entry (``aotautograd/<key>/<entry>``); None for
    other files. Such files are what torch loads on a cache hit, in any process using the directory: what a
    child process (torchrun, ``mp.spawn``, ``subprocess``) compiled lands here and travels as a file, unless
    mega-cache carries the same key already."""
    parts = rel.split("/")
    if parts[0] == "fxgraph" and len(parts) == 4:
        return ("torch/inductor", parts[2])
    if parts[0] == "aotautograd" and len(parts) == 3:
        return ("torch/aot_autograd", parts[1])
    return None


def triton_installed() -> bool:
    """Whether Triton is importable (looked up, not imported: importing it costs seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def elf_problem(name: str, data: bytes, size: int | None = None) -> str | None:
    """Why ``data`` is not a whole ELF file, for names that must be one (``.so``, ``.o``); else None. ``data`` may be
    the file's first :data:`ELF_HEAD` bytes only, when ``size`` says how long the whole file is.

    A truncated build (``file too short`` when Python imports it) ends before the program or
    section header table its ELF header declares."""
    size = len(data) if size is None else size
    if not name.endswith(_ELF_SUFFIXES) and not data.startswith(b"\x7fELF"):
        return None
    if size < 52 or len(data) < 52 or not data.startswith(b"\x7fELF") or data[4] not in (1, 2) or data[5] not in (1, 2):
        return f"not an ELF file ({size} bytes)"
    order = "<" if data[5] == 1 else ">"
    if data[4] == 2:  # 64-bit
        if size < 64 or len(data) < 64:
            return f"ELF header cut short ({size} bytes)"
        phoff, shoff = struct.unpack_from(order + "QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, 0x36)
    else:
        phoff, shoff = struct.unpack_from(order + "II", data, 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, 0x2A)
    need = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if size < need:
        return f"truncated ELF file ({size} of at least {need} bytes)"
    return None


def pch_problem(name: str, data: bytes) -> str | None:
    """Why ``data`` is not what a precompiled-header file of that name holds; else None."""
    if not _PCH_NAME.fullmatch(name):
        return "not a precompiled-header name"
    if name.endswith(".h"):
        return None if _PCH_INCLUDE.fullmatch(data) else "not a one-line #include header"
    return None if data[:4] in _PCH_MAGIC else "not a precompiled header (bad magic)"


def relocate_triton_group(rel: str, data: bytes, root: Path) -> bytes:
    """A Triton group file (``<hash>/__grp__<kernel>.json``) written for the cache directory ``root``: each file it
    names, at the path of the file of that name in the group's own folder there. The stored paths are not read (they
    are the compiling machine's), so no group points Triton outside its folder. Raises BundleError for anything
    that is not such a group file."""
    folder, _, _name = rel.rpartition("/")
    try:
        doc = json.loads(data)
    except ValueError:
        raise BundleError("not a Triton group file (not JSON)") from None
    children = doc.get("child_paths") if isinstance(doc, dict) else None
    if not isinstance(children, dict) or not 0 < len(children) <= MAX_GROUP_FILES or not folder or "/" in folder:
        raise BundleError("not a Triton group file")
    out: dict[str, str] = {}
    for name in children:
        validate_file_path(f"{folder}/{name}")
        if "/" in name:
            raise BundleError(f"Triton group file names {name[:80]!r}, not a file of its folder")
        out[name] = str(root / folder / name)
    return json.dumps({"child_paths": out}).encode()


def _read_under_torch_lock(root: Path, rel: str, timeout: float, read: Callable[[Path], T]) -> T | None:
    """``read`` of the file, called while holding (shared) the flock Inductor builds it under, if it has one.
    None when the lock stays taken past ``timeout`` (a build still running elsewhere). ``read`` raises OSError, also
    for a link or anything but a regular file of at most MAX_FILE_BYTES (:func:`.fsutil.read_regular`)."""
    key = rel.rsplit("/", 1)[-1].split(".", 1)[0]
    try:
        if fcntl is None:  # pragma: no cover - Windows: no flock, read as is
            raise OSError("no flock")
        fd = os.open(root / "locks" / f"{key}.lock", os.O_RDONLY)
    except OSError:  # no lock file: nothing of Inductor's builds this file
        return read(root / rel)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
        try:
            return read(root / rel)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _entry_of(kind: str, rel: str, mode: int, scratch_dir: str | None, path: Path) -> Entry:
    """The file at ``path`` as an entry: read into memory, or copied into ``scratch_dir`` (a chunk at a time)."""
    if scratch_dir is None:
        return Entry(kind, rel, read_regular(path, MAX_FILE_BYTES), mode)
    try:
        fd, copy = tempfile.mkstemp(dir=scratch_dir, suffix=".entry")
    except OSError as exc:
        raise LocalDiskError.of(exc, scratch_dir, f"copying {rel}") from exc
    dest: _Written | None = None
    try:
        with os.fdopen(fd, "wb") as raw:
            dest = _Written(raw)
            size = copy_regular(path, MAX_FILE_BYTES, dest)  # type: ignore[arg-type]
    except OSError as exc:
        note_free(exc, copy)  # before the copy that filled the disk goes
        os.unlink(copy)
        if dest is None or dest.failed is not None or exc.errno in _DISK_FULL:  # the copy's write (or its close)
            raise LocalDiskError.of(exc, copy, f"copying {rel}") from exc
        raise
    except BaseException:
        os.unlink(copy)
        raise
    return Entry.in_file(kind, rel, copy, size, mode)


class Skipped(str):
    """A file left out of an upload: ``"<path>: <why>"``, with its ``size`` in bytes (0 when unknown) and whether the
    local disk refused it (``local``: the scratch directory full, say)."""

    size: int = 0
    local: str | None = None

    @classmethod
    def of(cls, text: str, size: int = 0, local: str | None = None) -> Skipped:
        out = cls(text)
        out.size, out.local = size, local
        return out


class _Written:
    """A file being written that remembers whether a write failed (the local disk, not the file read)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.failed: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.raw.write(data)
        except OSError as exc:
            self.failed = exc
            raise


@dataclass(frozen=True)
class FileRoot:
    """A cache directory whose files travel as ``file/<name>`` entries."""

    name: str
    path: Path

    @property
    def kind(self) -> str:
        return FILE_PREFIX + self.name

    def problem(self, entry: Entry) -> str | None:
        """Why this root must not carry or write ``entry``; else None (what is read of it: its first bytes)."""
        head = entry.head(PCH_HEAD if self.name == "pch" else ELF_HEAD)
        if self.name == "pch":
            return pch_problem(entry.name, head if entry.size <= PCH_HEAD else head[:4])
        return elf_problem(entry.name, head, entry.size)

    def _carried(self, rel: str) -> bool:
        if self.name == "pch":
            return bool(_PCH_NAME.fullmatch(rel))
        parts = rel.split("/")
        return parts[0] not in EXCLUDED_TOP and not any(_EXCLUDED_NAME.search(p) for p in parts)

    def snapshot(self) -> set[str]:
        """Relative paths of the regular files below the root now."""
        out: set[str] = set()
        if not self.path.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(self.path):
            rel_dir = os.path.relpath(dirpath, self.path)
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if d not in EXCLUDED_TOP]
            for fn in filenames:
                rel = fn if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{fn}"
                out.add(rel)
        return out

    def collect(self, before: set[str], lock_wait: float = LOCK_WAIT_SECONDS,
                scratch_dir: str | None = None) -> tuple[Entries, list[str]]:
        """Entries for the files added since ``before``; also the paths skipped and why. With ``scratch_dir``, each
        file is copied there (a chunk at a time) and its entry refers to the copy, else it is read into memory.

        Waits for builds in progress at most ``lock_wait`` seconds in all; after that, a file whose
        build lock is taken is skipped (its kernel is rebuilt by whoever misses it)."""
        deadline = time.monotonic() + lock_wait
        entries = Entries()
        skipped: list[str] = []
        new = sorted(self.snapshot() - before)
        candidates = {rel.split("/", 1)[0] for rel in new
                      if self.name == "triton" and "/" in rel and _AUTOTUNE_CANDIDATE.match(rel.rsplit("/", 1)[1])}
        for rel in new:
            if not self._carried(rel) or rel.split("/", 1)[0] in candidates:
                continue
            try:
                validate_file_path(rel)
            except BundleError:
                skipped.append(Skipped.of(f"{rel}: name not portable"))
                continue
            path = self.path / rel
            size = 0
            try:
                st = path.lstat()
                size = st.st_size
                if not path.is_file() or path.is_symlink():
                    continue
                if st.st_size > MAX_FILE_BYTES:
                    skipped.append(Skipped.of(f"{rel}: {st.st_size} bytes", size))
                    continue
                mode = 0o755 if st.st_mode & 0o111 else 0o644
                entry = _read_under_torch_lock(self.path, rel, max(0.0, deadline - time.monotonic()),
                                               partial(_entry_of, self.kind, rel, mode, scratch_dir))
            except LocalDiskError as exc:
                skipped.append(Skipped.of(f"{rel}: {exc.reason}", size, str(exc)))
                continue
            except OSError as exc:
                skipped.append(Skipped.of(f"{rel}: {exc.strerror or exc}", size))
                continue
            if entry is None:
                skipped.append(Skipped.of(f"{rel}: still being built by another process after {lock_wait:g} s", size))
                continue
            if problem := self.problem(entry):
                skipped.append(Skipped.of(f"{rel}: {problem}", size))
                continue
            entries.add(entry)
        return entries, skipped

    def sweep_strays(self, now: float | None = None) -> tuple[int, int]:
        """Remove the temporary files that writers which are gone left in this directory (a session killed while it
        restored: :func:`.fsutil.stray`); return how many and their bytes."""
        now = time.time() if now is None else now
        removed = size = 0
        if not self.path.is_dir():
            return 0, 0
        for dirpath, dirnames, filenames in os.walk(self.path):
            if dirpath == str(self.path):  # nothing of the restore's is written there (see snapshot)
                dirnames[:] = [d for d in dirnames if d not in EXCLUDED_TOP]
            for name in filenames:
                if temp_owner(name) is None:
                    continue
                path = os.path.join(dirpath, name)
                if stray(path, now):
                    try:
                        length = os.lstat(path).st_size
                        os.unlink(path)
                    except OSError:
                        continue
                    removed += 1
                    size += length
        return removed, size

    def restore(self, entries: Iterable[Entry], refused: list[str] | None = None,
                move: bool = False) -> tuple[int, int]:
        """Write this root's entries that are not there yet. Returns (written, already present).

        Each entry stands alone: one that cannot be written safely (an unsafe name, a symlink or a file in its way,
        an ELF file cut short by an older version's collect) is not written, its name and why go to ``refused``
        (torch rebuilds it), and the rest are written. Raises OSError only when the disk itself refuses (full,
        over quota, read-only), which no later entry would escape; a partial restore leaves only whole files.

        ``move``: an entry whose bytes are a scratch file of the session's (with their digest) is moved into place
        (linked there, on the same file system: no copy) and read from there from now on (:meth:`.Entry.moved`),
        and so is one whose file is already in place with the same bytes: the session no longer holds a copy of
        what its cache directory holds.
        """
        written = present = 0
        root = self.path.resolve()
        for entry in entries:
            if entry.kind != self.kind:
                continue
            try:
                validate_file_path(entry.name)
                if problem := self.problem(entry):
                    raise BundleError(problem)
                movable = move and entry.path is not None and entry.digest is not None
                if self.name == "triton" and _TRITON_GROUP.fullmatch(entry.name.rpartition("/")[2]):
                    entry, movable = entry.with_data(relocate_triton_group(entry.name, entry.data, self.path)), False
                if self._write(root, entry, movable):
                    written += 1
                else:
                    present += 1
            except BundleError as exc:
                if refused is not None:
                    refused.append(f"{entry.name}: {exc}")
            except OSError as exc:
                if exc.errno in _DISK_FULL:
                    raise
                if refused is not None:
                    refused.append(f"{entry.name}: {exc.strerror or exc}")
        return written, present

    @staticmethod
    def _write(root: Path, entry: Entry, move: bool = False) -> bool:
        """Write one entry under ``root`` unless its name is taken: True if written, False if already present. With
        ``move``, the entry's scratch file is moved into place (or, where it is there already with the same bytes,
        let go) and the entry reads from the file in place."""
        target = root.joinpath(*entry.name.split("/"))
        parent = target.parent
        # A symlinked directory inside the root could redirect the write: refuse it, before mkdir
        # can create directories outside the root, and again after (in case one appeared meanwhile).
        if not parent.resolve().is_relative_to(root):
            raise BundleError(f"resolves outside {root}")
        parent.mkdir(parents=True, exist_ok=True)
        if not parent.resolve().is_relative_to(root):
            raise BundleError(f"resolves outside {root}")
        if os.path.lexists(target):
            if move and _holds(str(target), entry):
                unlink(entry.moved(str(target)))
            return False
        if move and (linked := _link_into_place(entry, str(target))) is not None:
            return linked
        # Never over a name that appeared meanwhile (a concurrent writer's file stays).
        written = write_atomic(target, entry.chunks(), mode=entry.mode & 0o755, replace=False, lock=True)
        if written and move:
            unlink(entry.moved(str(target)))
        return written


def place_dynamo(entries: Iterable[Entry], inductor: Path, refused: list[str]) -> int:
    """Dynamo's stored entries where torch's Dynamo cache reads them (``dynamo/<key>/entry`` in Inductor's cache
    directory ``inductor``), replacing what is there as torch's own load of them does; how many were placed. Each is
    a second name of its scratch file where it has one (nothing copied or held in memory; the entry keeps reading its
    own name, which torch's later rewrite of the file, a new file under the name, leaves as it was), else written a
    chunk at a time. One that cannot be placed is named in ``refused`` (torch traces its frames); a full disk
    raises."""
    placed = 0
    root = inductor / "dynamo"
    for entry in entries:
        try:
            torchfmt.validate_key("precompile", entry.name)
            folder = root / entry.name
            folder.mkdir(parents=True, exist_ok=True)
            if not folder.resolve().is_relative_to(root.resolve()):
                raise BundleError(f"resolves outside {root}")
            _link_or_write(entry, str(folder / "entry"))
            placed += 1
        except BundleError as exc:
            refused.append(f"{entry.name[:16]}: {exc}")
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise
            refused.append(f"{entry.name[:16]}: {exc.strerror or exc}")
    return placed


def _link_or_write(entry: Entry, target: str) -> None:
    if entry.path is not None:
        tmp = temp_path(target)
        try:
            os.link(entry.path, tmp)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise
        else:
            try:
                os.replace(tmp, target)
            finally:
                unlink(tmp)
            return
    write_atomic(target, entry.chunks(), mode=0o644)


def _link_into_place(entry: Entry, target: str) -> bool | None:
    """Move a file entry's scratch file to ``target`` as a second name of the same file (a hard link, then the
    scratch name removed): True when moved, False when ``target`` appeared meanwhile (a concurrent writer's file
    stays), None where the file system cannot link it there (another file system): the caller copies it then."""
    assert entry.path is not None
    try:
        os.chmod(entry.path, entry.mode & 0o755)
        os.link(entry.path, target)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise
        return None
    unlink(entry.moved(target))
    return True


def _holds(path: str, entry: Entry) -> bool:
    """Whether the regular file at ``path`` holds ``entry``'s bytes: read as an entry of that size and digest
    would be (:meth:`.Entry.chunks` checks both)."""
    try:
        if os.path.islink(path) or os.lstat(path).st_size != entry.size:
            return False
        for _chunk in Entry.in_file(entry.kind, entry.name, path, entry.size, digest=entry.digest).chunks():
            pass
    except (OSError, BundleError):
        return False
    return True
