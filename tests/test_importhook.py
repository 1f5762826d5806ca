"""The post-import hook: a callback with a module once it is imported, for every hook waiting for that module."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from pytest_megacache.importhook import PostImportHook


def test_every_hook_on_one_module_sees_its_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two roles wait for one module (the compile callbacks and Dynamo reuse both wait for ``torch._dynamo``): the
    first hook on ``sys.meta_path`` finds the module, and the second must be told too (it was not, and a session's
    first compile went uncounted)."""
    (tmp_path / "waited_for_twice.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "waited_for_twice", raising=False)
    seen: list[tuple[str, ModuleType]] = []
    first = PostImportHook("waited_for_twice", lambda module: seen.append(("first", module)))
    second = PostImportHook("waited_for_twice", lambda module: seen.append(("second", module)))
    other = PostImportHook("another_module", lambda module: seen.append(("other", module)))
    monkeypatch.setattr(sys, "meta_path", [second, other, first, *sys.meta_path])  # the later one goes first

    import waited_for_twice  # type: ignore[import-not-found]

    assert sorted(name for name, _ in seen) == ["first", "second"]
    assert all(module is waited_for_twice for _, module in seen)
    assert first not in sys.meta_path and second not in sys.meta_path and other in sys.meta_path
    assert len(first.spans) == len(second.spans) == 1 and not other.spans
    assert waited_for_twice.__spec__.loader.__class__.__name__ != "_NotifyingLoader"


def test_a_lookup_that_imports_nothing_leaves_the_hooks_in_place(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    (tmp_path / "only_looked_up.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "only_looked_up", raising=False)
    seen: list[ModuleType] = []
    hook = PostImportHook("only_looked_up", seen.append)
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    assert importlib.util.find_spec("only_looked_up") is not None
    assert not seen and hook in sys.meta_path
