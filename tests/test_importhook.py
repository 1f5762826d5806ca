"""The post-import hook: a callback with a module once it is imported, for every hook waiting for that module; and
the callback once imports under way are over."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from pytest_megacache.importhook import AfterImports, PostImportHook, initializing


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


def test_a_module_imported_half_way_through_its_package_waits_until_that_import_is_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package whose own import imports the module a hook waits for (torch._inductor's modules import torch._dynamo
    half way): the hook sees the package's import under way, and a callback waiting for it runs at the first import
    looked up once it is over, once; one that ``poll`` finds over runs there."""
    package = tmp_path / "halfway_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import first\nfrom . import waited\nfrom . import last\n")
    for name in ("first", "waited", "last"):
        (package / f"{name}.py").write_text("")
    (tmp_path / "halfway_later.py").write_text("")
    (tmp_path / "halfway_after_that.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("halfway_pkg", "halfway_pkg.first", "halfway_pkg.waited", "halfway_pkg.last", "halfway_later",
                 "halfway_after_that"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    under_way: list[list[str]] = []
    ran: list[list[str]] = []
    hooks: list[AfterImports] = []

    def waited(_module: ModuleType) -> None:
        under_way.append(initializing("halfway_pkg", besides="halfway_pkg.waited"))
        hooks.append(AfterImports(under_way[-1], lambda: ran.append(initializing("halfway_pkg"))))
        sys.meta_path.insert(0, hooks[-1])

    monkeypatch.setattr(sys, "meta_path", [PostImportHook("halfway_pkg.waited", waited), *sys.meta_path])
    import halfway_pkg  # type: ignore[import-not-found]  # noqa: F401

    assert under_way == [["halfway_pkg"]]  # "first" is done, "last" not started: the package's own code is running
    assert ran == [] and hooks[0] in sys.meta_path  # the package's "last" was looked up while it was still under way
    import halfway_later  # type: ignore[import-not-found]  # noqa: F401

    assert ran == [[]] and hooks[0] not in sys.meta_path
    import halfway_after_that  # type: ignore[import-not-found]  # noqa: F401

    assert ran == [[]] and not hooks[0].poll()
    fired: list[str] = []
    polled = AfterImports(["halfway_pkg"], lambda: fired.append("after"))
    sys.meta_path.insert(0, polled)
    assert polled.over() and polled.poll() and fired == ["after"] and polled not in sys.meta_path
    assert not polled.poll() and fired == ["after"]
