"""Compiled files that torch's mega-cache leaves out (CPU C++ kernels), carried as ``file/<root>`` entries.

On CPU, an FX-graph cache hit still makes g++ rebuild every kernel: the ``.so`` files live only in
TORCHINDUCTOR_CACHE_DIR. This module snapshots a cache directory, collects the files a session added,
and restores files into a fresh directory: atomically (temp file + ``os.replace``), never overwriting
what is there, never following a link, never leaving the directory.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .bundle import FILE_PREFIX, Entries, Entry, validate_file_path
from .errors import BundleError

# What mega-cache already carries, and what must not travel (locks, temp files, the precompiled
# header, Inductor's copy of Triton kernels that travel inside FX-graph entries).
EXCLUDED_TOP = frozenset({"fxgraph", "aotautograd", "dynamo", "locks", "precompiled_headers", "triton"})
_EXCLUDED_NAME = re.compile(r"(^\.|^tmp|\.lock$|\.tmp|~$)")
MAX_FILE_BYTES = 256 << 20
# In TRITON_CACHE_DIR, Inductor's own kernels (named triton_<kind>_...) travel inside FX-graph entries
# already; only the rest (user @triton.jit kernels, Triton's compiled launcher/driver modules) is carried.
_INDUCTOR_KERNEL = re.compile(r"^(__grp__)?triton_(poi|red|per|tem|for|spl|mm|bmm|sca|unk|helper)_")


def inductor_cache_dir(env: dict[str, str] | None = None) -> Path:
    """TORCHINDUCTOR_CACHE_DIR as torch resolves it (``runtime/cache_dir_utils.py``), without torch."""
    env = dict(os.environ if env is None else env)
    configured = env.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return Path(configured).absolute()
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tempfile.gettempdir(), "torchinductor_" + user).absolute()


def triton_cache_dir(env: dict[str, str] | None = None) -> Path:
    """TRITON_CACHE_DIR as Triton resolves it (``knobs.cache.dir``), without importing Triton."""
    env = dict(os.environ if env is None else env)
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"]).absolute()
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return Path(home, ".triton", "cache").absolute()


def triton_installed() -> bool:
    """Whether Triton is importable (looked up, not imported: importing it costs seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class FileRoot:
    """A cache directory whose files travel as ``file/<name>`` entries."""

    name: str
    path: Path

    @property
    def kind(self) -> str:
        return FILE_PREFIX + self.name

    def _carried(self, rel: str) -> bool:
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

    def collect(self, before: set[str]) -> tuple[Entries, list[str]]:
        """Entries for the files added since ``before``; also the paths skipped and why."""
        entries = Entries()
        skipped: list[str] = []
        new = sorted(self.snapshot() - before)
        inductor_dirs = {rel.split("/", 1)[0] for rel in new
                         if self.name == "triton" and "/" in rel and _INDUCTOR_KERNEL.match(rel.rsplit("/", 1)[1])}
        for rel in new:
            if not self._carried(rel) or rel.split("/", 1)[0] in inductor_dirs:
                continue
            try:
                validate_file_path(rel)
            except BundleError:
                skipped.append(f"{rel}: name not portable")
                continue
            path = self.path / rel
            try:
                st = path.lstat()
                if not path.is_file() or path.is_symlink():
                    continue
                if st.st_size > MAX_FILE_BYTES:
                    skipped.append(f"{rel}: {st.st_size} bytes")
                    continue
                data = path.read_bytes()
            except OSError as exc:
                skipped.append(f"{rel}: {exc.strerror or exc}")
                continue
            entries.add(Entry(self.kind, rel, data, 0o755 if st.st_mode & 0o111 else 0o644))
        return entries, skipped

    def restore(self, entries: Iterable[Entry]) -> tuple[int, int]:
        """Write this root's entries that are not there yet. Returns (written, already present).

        Raises OSError (a full disk, say) to the caller; a partial restore leaves only whole files.
        """
        written = present = 0
        root = self.path.resolve()
        for entry in entries:
            if entry.kind != self.kind:
                continue
            validate_file_path(entry.name)
            target = root.joinpath(*entry.name.split("/"))
            parent = target.parent
            # A symlinked directory inside the root could redirect the write: refuse it, before mkdir
            # can create directories outside the root, and again after (in case one appeared meanwhile).
            if not parent.resolve().is_relative_to(root):
                raise BundleError(f"{entry.name!r} resolves outside {root}")
            parent.mkdir(parents=True, exist_ok=True)
            if not parent.resolve().is_relative_to(root):
                raise BundleError(f"{entry.name!r} resolves outside {root}")
            if os.path.lexists(target):
                present += 1
                continue
            fd, tmp = tempfile.mkstemp(prefix=".tmp-megacache-", dir=parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(entry.data)
                os.chmod(tmp, entry.mode & 0o755)
                # link() fails if the name appeared meanwhile: never overwrite a concurrent writer.
                try:
                    os.link(tmp, target)
                    written += 1
                except FileExistsError:
                    present += 1
                except OSError:
                    if os.path.lexists(target):
                        present += 1
                    else:
                        os.replace(tmp, target)
                        tmp = ""
                        written += 1
            finally:
                if tmp:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
        return written, present
