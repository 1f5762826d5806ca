"""A post-import hook: a callback with a module once it is imported (torch, Triton, torch's ``cpu_vec_isa``); and
:class:`AfterImports`, a callback once imports under way are over.

Imports only the standard library (what ``import torch`` imports anyway): a child process arms one at its first
``import torch`` (:func:`.isaprobe.arm_child`) without importing the plugin's torch machinery.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["AfterImports", "PostImportHook", "initializing"]


class _NotifyingLoader(importlib.abc.Loader):
    """Runs the real loader, then a callback with the freshly executed module; records how long the import
    took (``spans``: the perf_counter() interval, for the per-process times)."""

    def __init__(self, inner: Any, hooks: list[PostImportHook]) -> None:
        self.inner = inner
        self.hooks = hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back so nothing downstream ever sees this wrapper.
        module.__loader__ = self.inner
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        started = time.perf_counter()
        self.inner.exec_module(module)
        ended = time.perf_counter()
        for hook in self.hooks:
            hook.spans.append((started, ended))
        for hook in self.hooks:
            hook._imported(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _OnMetaPath(importlib.abc.MetaPathFinder):
    """A finder that leaves ``sys.meta_path`` by itself (:meth:`remove`, at most once)."""

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class PostImportHook(_OnMetaPath):
    """Calls ``after`` with the module ``fullname`` once it is imported, then leaves ``sys.meta_path``. A lookup
    that imports nothing (``importlib.util.find_spec``, as torch and this plugin ask whether Triton is installed)
    leaves it in place for the import that follows. Several hooks on one module all see its import: the first one
    on ``sys.meta_path`` finds it, for every hook waiting for it then (the others' finders are never asked)."""

    def __init__(self, fullname: str, after: Callable[[ModuleType], None],
                 spans: list[tuple[float, float]] | None = None) -> None:
        self.fullname = fullname
        self.after = after
        self.spans = spans if spans is not None else []  # when the import ran (start, end)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.fullname:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        waiting = [hook for hook in sys.meta_path if isinstance(hook, PostImportHook) and hook.fullname == fullname]
        spec.loader = _NotifyingLoader(spec.loader, waiting if self in waiting else [self, *waiting])
        return spec

    def _imported(self, module: ModuleType) -> None:
        self.remove()
        self.after(module)


def initializing(package: str, besides: str = "") -> list[str]:
    """The modules of ``package`` (the package and those below it), but ``besides``, whose import is under way: their
    code is running (the mark CPython's import system keeps on a module's spec meanwhile), as where one of them
    imported the module whose import hook calls this."""
    below = package + "."
    return [name for name, module in list(sys.modules.items())
            if (name == package or name.startswith(below)) and name != besides and _under_way(module)]


def _under_way(module: Any) -> bool:
    return getattr(getattr(module, "__spec__", None), "_initializing", False) is True


class AfterImports(_OnMetaPath):
    """Calls ``after`` once none of the modules ``names`` is being imported any more: at the first import looked up
    after that (it imports nothing itself), or where :meth:`poll` is called; then leaves ``sys.meta_path``."""

    def __init__(self, names: list[str], after: Callable[[], None]) -> None:
        self.names = list(names)
        self.after = after

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        self.poll()
        return None

    def over(self) -> bool:
        """Whether the imports waited for are over."""
        return not any(_under_way(sys.modules.get(name)) for name in self.names)

    def poll(self) -> bool:
        """``after`` called (once) where the imports waited for are over; whether it was."""
        if self not in sys.meta_path or not self.over():
            return False
        self.remove()
        self.after()
        return True
