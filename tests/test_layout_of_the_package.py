"""The package's shape: no import circle among its modules (imports at module level: a function's own import runs
when it is called, after every module it could need is loaded), no module over 600 lines, no class over 350."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_megacache"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350


def module_imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports when it is imported (not under ``if TYPE_CHECKING``)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    nodes: list[ast.stmt] = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            test = node.test
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                nodes.extend(node.orelse)
                continue
            nodes.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            nodes.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pytest_megacache."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("pytest_megacache."))
    return {name for name in out if (PACKAGE / f"{name}.py").exists()}


def graph() -> dict[str, set[str]]:
    return {path.stem: module_imports(path) for path in sorted(PACKAGE.glob("*.py"))}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each as the path that closes it (depth-first)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return found


def test_the_circle_finder_finds_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_the_modules_a_module_imports() -> None:
    mod = PACKAGE / "core.py"
    assert {"restore", "upload", "compaction", "bundle"} <= module_imports(mod)
    assert "plugin" not in module_imports(mod)


def test_the_package_imports_no_circle() -> None:
    assert circles(graph()) == []


def test_no_module_or_class_is_too_long() -> None:
    long_modules, long_classes = [], []
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.name}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    long_classes.append(f"{path.name}:{node.name}: {length}")
    assert not long_modules and not long_classes, (long_modules, long_classes)
