"""The package's shape: families as folders, each entered through its ``__init__``; no import circle among its
modules (imports at module level: a function's own import runs when it is called, after every module it could need
is loaded), and none between its parts (a family counted as one, every import that runs counted); no module over 600 lines,
no class over 250; at most 32 entries at the top."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_megacache"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 80  # a function with the functions nested in it
MAX_TOP_ENTRIES = 32


def module_name(path: Path) -> str:
    """``core``, ``dynamo`` (a family's ``__init__``), ``dynamo.offers``: the name below the package."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "__init__"


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}


def families() -> set[str]:
    return {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}


def part_of(name: str) -> str:
    """The part of the package a module belongs to: its family, or itself where it is flat."""
    return name.split(".")[0]


@dataclass(frozen=True)
class Import:
    target: str  # the module imported from, a name of :func:`modules`
    names: tuple[str, ...]  # the names taken from it (for ``from . import x``: x, where x is no module)
    top: bool  # at module level (not in a function, not under ``if TYPE_CHECKING``)
    runs: bool = True  # False: under ``if TYPE_CHECKING`` (read by type checkers only)


def _statements(tree: ast.Module) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement, with whether it runs when the module is imported, and whether it ever runs."""
    stack: list[tuple[ast.stmt, bool, bool]] = [(node, True, True) for node in tree.body]
    while stack:
        node, top, runs = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, top, runs
        elif isinstance(node, ast.If):
            test = node.test
            checking = isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            stack.extend((n, top and not checking, runs and not checking) for n in node.body)
            stack.extend((n, top, runs) for n in node.orelse)
        elif isinstance(node, ast.Try):
            body = node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
            stack.extend((n, top, runs) for n in body)
        else:  # a function's body runs when it is called; a class's or a with's, when the module is imported
            now = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            stack.extend((n, now, runs) for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    """The package's modules that module ``name`` (at ``path``) imports, each with the names it takes."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "__init__":
        here = []
    out: list[Import] = []
    for node, top, runs in _statements(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                dotted = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("pytest_megacache."):
                dotted = node.module.split(".", 1)[1]
            elif node.module == "pytest_megacache":
                dotted = ""
            else:
                continue
            for alias in node.names:
                sub = f"{dotted}.{alias.name}" if dotted else alias.name
                if sub in known:  # from family import module
                    out.append(Import(sub, (), top, runs))
                else:
                    out.append(Import(dotted or "__init__", (alias.name,), top, runs))
        else:
            for alias in node.names:
                if alias.name.startswith("pytest_megacache."):
                    out.append(Import(alias.name.split(".", 1)[1], (), top, runs))
    return [i for i in out if i.target in known]


def graph(*, top_only: bool = True, collapse: bool = False) -> dict[str, set[str]]:
    """Who imports whom: at module level (``top_only``) or wherever an import runs; a family as one node
    (``collapse``)."""
    found = modules()
    edges: dict[str, set[str]] = {}
    for name, path in found.items():
        source = part_of(name) if collapse else name
        for imp in imports(name, path, set(found)):
            if imp.top or (imp.runs and not top_only):
                target = part_of(imp.target) if collapse else imp.target
                if target != source:
                    edges.setdefault(source, set()).add(target)
        edges.setdefault(source, set())
    return edges


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
    edges = graph()
    assert {"restore", "upload", "compaction", "bundle", "stores"} <= edges["core"]
    assert "plugin" not in edges["core"]
    assert {"dynamo.offers", "dynamo.repairs"} <= edges["dynamo"]  # from .offers import ..., from . import repairs
    assert {"children", "fsutil"} <= edges["children.hook"]  # from . import READY_ENV (the family's own front)
    assert "children.hook" not in edges["children"]  # imported in a function: not at module level
    assert "children.hook" in graph(top_only=False)["children"]
    assert "core" in graph(top_only=False, collapse=True)["roles"]


def test_the_package_imports_no_circle() -> None:
    assert circles(graph()) == []


def test_no_part_of_the_package_imports_one_that_imports_it_back() -> None:
    """Each family counted as one module, every import that runs counted (in functions too): no circle among the
    package's parts, so none between families, and none through a family and a flat module."""
    whole = graph(top_only=False, collapse=True)
    fams = families()
    assert sum(len(targets & fams) for part, targets in whole.items() if part in fams) >= 3  # families do import families
    assert circles(whole) == []


def test_the_rest_of_the_package_enters_a_family_through_its_init_only() -> None:
    """Outside a family, code imports the family's ``__init__`` and only names in its ``__all__``; its other modules
    are its own."""
    found = modules()
    fams = families()
    exported: dict[str, set[str]] = {}
    for fam in fams:
        tree = ast.parse((PACKAGE / fam / "__init__.py").read_text())
        [names] = [node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
        exported[fam] = {ast.literal_eval(elt) for elt in names.elts}  # type: ignore[attr-defined]
    wrong = []
    for name, path in found.items():
        for imp in imports(name, path, set(found)):
            fam = part_of(imp.target)
            if fam not in fams or part_of(name) == fam:
                continue
            if imp.target != fam:
                wrong.append(f"{name} imports {imp.target}")
            wrong += [f"{name} takes {n} from {fam}, not in its __all__" for n in imp.names if n not in exported[fam]]
    assert len(fams) >= 5 and wrong == []


def test_the_top_of_the_package_is_short() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOP_ENTRIES, entries
    assert not any(name.split(".")[0].startswith(f"{fam}_") for fam in families() for name in entries)


def test_no_module_class_or_function_is_too_long() -> None:
    long_modules, long_classes, long_functions = [], [], []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if isinstance(node, ast.ClassDef) and length > MAX_CLASS_LINES:
                    long_classes.append(f"{name}:{node.name}: {length}")
                elif not isinstance(node, ast.ClassDef) and length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.name}: {length}")
    assert len(modules()) > 50, modules()
    assert not long_modules and not long_classes and not long_functions, (long_modules, long_classes, long_functions)
