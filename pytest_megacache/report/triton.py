"""Triton's kernels in a session: how many its processes loaded from Triton's cache directory, how many they compiled.

Triton 3.4 and later tell each kernel compile to one listener, ``triton.knobs.compilation.listener``:
``triton.compiler.compile`` calls it with ``cache_hit=True`` when the kernel's files were in the cache directory
and ``cache_hit=False`` after compiling it (the same call in Triton 3.4 to 3.9). :class:`TritonWatch` puts its own
listener there when Triton is imported (by Inductor or by the tests: nothing here imports Triton), in front of the
one that was set (by the user or by torch), which it calls in turn with the same arguments; at the end of the
session it puts that one back.

What the listener cannot see is counted from the cache directory instead: a kernel's folder holds a group file
(``<hash>/__grp__<kernel>.json``) once the kernel is compiled, so the folders that appeared during the session are
the kernels compiled by any process using the directory (this one, Inductor's compile workers, child processes).
A hit on such a folder is a kernel compiled earlier in the same session, not one the cache served. Hits are those
of the processes that run tests (an xdist worker's, summed by its controller), not of the processes they start;
where this process's Triton has no listener (Triton 3.3), they are unknown, and the report says so.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from ..torch_adapter import PostImportHook
from .stats import TritonStats

if TYPE_CHECKING:
    from ..bundle import Entries
    from ..files import FileRoot


class Compiled(Protocol):
    """What :func:`figures` reads of a session (:class:`pytest_megacache.core.CacheSession`): its file roots, their
    files before the tests, and what it restored."""

    @property
    def roots(self) -> list[FileRoot]: ...
    @property
    def before(self) -> dict[str, set[str]]: ...
    @property
    def restored(self) -> Entries: ...

_GROUP_FILE = re.compile(r"__grp__.+\.json")


def kernel_folders(paths: Iterable[str]) -> set[str]:
    """The kernel folders among relative paths of a Triton cache directory: those holding a group file."""
    out = set()
    for rel in paths:
        folder, _, name = rel.rpartition("/")
        if folder and "/" not in folder and _GROUP_FILE.fullmatch(name):
            out.add(folder)
    return out


class TritonWatch:
    """This process's view of Triton's compiles, through Triton's compilation listener (see the module's doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: dict[str, bool] = {}  # kernel folder (absolute) -> loaded from the cache (False: compiled)
        self.compile_seconds = 0.0  # Triton's own timings of the kernels this process compiled
        self.listener_missing: str | None = None  # why this Triton has no listener to chain to
        self.displaced = False  # another listener took the place of ours during the session
        self._hook: PostImportHook | None = None
        self._compilation: Any = None  # triton.knobs.compilation, while ours is chained there
        self._previous: Any = None
        self._ours = self._on_compile  # one bound method, so that identity tells ours from another

    def install(self) -> None:
        """Chain now if Triton is imported, else when it is."""
        module = sys.modules.get("triton")
        if module is not None:
            self._attach(module)
        elif self._hook is None:
            self._hook = PostImportHook("triton", self._attach)
            sys.meta_path.insert(0, self._hook)

    def _attach(self, module: ModuleType) -> None:
        if self._compilation is not None:
            return
        try:
            compilation = getattr(getattr(module, "knobs", None), "compilation", None)
            if compilation is None or not hasattr(compilation, "listener"):
                version = str(getattr(module, "__version__", "?"))[:40]
                self.listener_missing = f"Triton {version} has no compilation listener (Triton 3.4 and later have one)"
                return
            self._previous = compilation.listener
            compilation.listener = self._ours
            self._compilation = compilation
        except Exception as exc:  # noqa: BLE001 - Triton's own business goes on as before
            self.listener_missing = f"Triton's compilation listener could not be set ({type(exc).__name__})"

    def uninstall(self) -> None:
        """Put the listener that was there back (only where ours is still in place); stop watching imports."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        compilation, self._compilation = self._compilation, None
        if compilation is None:
            return
        try:
            if compilation.listener is self._ours:
                compilation.listener = self._previous
            else:  # someone set another listener over ours: theirs stays, and compiles after that went unseen
                self.displaced = True
        except Exception:  # noqa: BLE001
            self.displaced = True

    def _on_compile(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._record(kwargs)
        except Exception:  # noqa: BLE001 - counting never fails a compile
            pass
        previous = self._previous
        if previous is not None:
            previous(*args, **kwargs)  # the chained listener's own outcome, exceptions included, as without us

    def _record(self, kwargs: dict[str, Any]) -> None:
        group = kwargs.get("metadata_group")
        paths = [p for p in group.values() if isinstance(p, str)] if isinstance(group, dict) else []
        metadata = kwargs.get("metadata")
        if paths:
            folder = os.path.dirname(os.path.abspath(paths[0]))
        elif isinstance(metadata, dict) and metadata.get("hash"):  # not a file cache: the kernel's hash tells it
            folder = f"hash:{str(metadata['hash'])[:128]}"
        else:
            return
        hit = bool(kwargs.get("cache_hit"))
        seconds = 0.0
        if not hit:
            total = getattr(kwargs.get("times"), "total", None)  # microseconds (CompileTimes)
            seconds = total / 1e6 if isinstance(total, (int, float)) and 0 <= total < 1e13 else 0.0
        with self._lock:
            self.events[folder] = self.events.get(folder, True) and hit  # compiled once in the session: compiled
            self.compile_seconds += seconds

    def seen(self) -> dict[str, bool]:
        """A copy of :attr:`events` (the listener may be called from another thread)."""
        with self._lock:
            return dict(self.events)


def figures(watch: TritonWatch, session: Compiled) -> TritonStats | None:
    """The session's Triton figures for this process, or None when there is nothing to tell (no Triton kernel
    loaded, compiled or restored). Hits only where the listener saw every compile of this process."""
    from ..files import FileRoot

    root = next((r for r in session.roots if r.name == "triton"), None)
    before = session.before.get(root.kind) if root is not None else None
    new: set[str] = set()
    root_path = None
    if root is not None and before is not None:
        root_path = os.path.abspath(root.path)
        new = kernel_folders(FileRoot(root.name, Path(root_path)).snapshot()) - kernel_folders(before)
    restored = kernel_folders(e.name for e in session.restored if root is not None and e.kind == root.kind)
    events = watch.seen()
    hits: set[str] = set()
    compiled = set(new)
    for folder, hit in events.items():
        parent, _, name = folder.rpartition(os.sep)
        key = name if root_path is not None and parent == root_path else folder
        if not hit:
            compiled.add(key)
        elif key not in new:  # a folder that appeared this session was compiled this session
            hits.add(key)
    if not (hits or compiled or restored):
        return None
    unknown = watch.listener_missing
    if watch.displaced:
        unknown = "another compilation listener took the place of this plugin's during the session"
    return TritonStats(
        counted="cache directory" if unknown else "listener",
        hits=None if unknown else len(hits),
        hits_restored=0 if unknown else len(hits & restored),
        compiled=len(compiled),
        compile_seconds=round(watch.compile_seconds, 3),
        restored=len(restored),
        hits_unknown=unknown)
