"""A guard's source as Dynamo names it, read as a path of steps from the frame's globals or locals (no torch
imported): ``G['torch'].nn``, ``type(L['td'])``, ``L['td'].__class__``, ``dict(type(L['s']).__dict__)['p'].fget``,
``type(L['s']).__mro__[1]``, ``list(dict.keys(G['handlers']))[0]``. :func:`parse_path` reads one, :func:`resolve`
follows it (attribute and item lookups, ``type()``, and ``dict()`` or the keys of a mapping only: nothing else runs),
:func:`path_text` writes it back."""

from __future__ import annotations

import re
import sys
import types
from typing import Any

Step = tuple[str, str]

_ROOT = re.compile(r"(?P<scope>[GL])\[(?P<q>['\"])(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P=q)\]")
_ATTR = re.compile(r"\.(?P<attr>[A-Za-z_][A-Za-z0-9_]*)")
# a key as torch writes it (repr): any text without quotes or escapes (a module dict's "<a___to___b>", say)
_KEY = re.compile(r"\[(?P<q>['\"])(?P<key>[^'\"\\\n]+)(?P=q)\]")
_IMPORT = re.compile(r"__import__\((?P<q>['\"])(?P<name>[A-Za-z_][A-Za-z0-9_.]*)(?P=q)\)")
_INDEX = re.compile(r"\[(?P<index>\d{1,4})\]")
_CALLS = ("type", "dict", "list(dict.keys")
_ROOTS = {"G": "global", "L": "local"}


def parse_path(name: str) -> list[Step] | None:
    """``dict(type(L['s']).__dict__)['p']`` -> [("local", "s"), ("type", ""), ("attr", "__dict__"), ("dict", ""),
    ("key", "p")]; None for any other source."""
    parsed = _parse(name, 0)
    if parsed is None or parsed[1] != len(name):
        return None
    return parsed[0]


def _parse(name: str, pos: int) -> tuple[list[Step], int] | None:
    steps: list[Step]
    root = _ROOT.match(name, pos)
    if root is not None:
        steps, pos = [(_ROOTS[root.group("scope")], root.group("name"))], root.end()
    elif (imported := _IMPORT.match(name, pos)) is not None:
        steps, pos = [("module", imported.group("name"))], imported.end()
    else:
        call = next((c for c in _CALLS if name.startswith(f"{c}(", pos)), None)
        if call is None:
            return None
        inner = _parse(name, pos + len(call) + 1)
        closing = ")" * (1 + call.count("("))
        if inner is None or not name.startswith(closing, inner[1]):
            return None
        steps, pos = [*inner[0], ("keys" if call.startswith("list") else call, "")], inner[1] + len(closing)
    while pos < len(name):
        if name.startswith("[list(dict.keys(", pos) and (inner := _parse(name, pos + 1)) is not None \
                and name.startswith("]", inner[1]) and inner[0][:-2] == steps and inner[0][-2] == ("keys", "") \
                and inner[0][-1][0] == "index":
            # d[list(dict.keys(d))[n]]: the value of the n-th key
            steps.append(("value", inner[0][-1][1]))
            pos = inner[1] + 1
            continue
        if (attr := _ATTR.match(name, pos)) is not None:
            steps.append(("attr", attr.group("attr")))
        elif (key := _KEY.match(name, pos)) is not None:
            steps.append(("key", key.group("key")))
        elif (index := _INDEX.match(name, pos)) is not None:
            steps.append(("index", index.group("index")))
        else:
            break
        pos = (attr or key or index).end()  # type: ignore[union-attr]
    return steps, pos


def rooted_at(steps: list[Step]) -> str:
    """"global" or "local" (a module imported by name counts as global: it is found the same way at load)."""
    return "local" if steps[0][0] == "local" else "global"


def resolve(steps: list[Step], scope: dict[str, Any]) -> Any:
    """The object a parsed path names, from ``scope`` (the globals or the locals its root names; a module root
    ``__import__('m')`` names an imported module: nothing is imported here)."""
    obj = sys.modules[steps[0][1]] if steps[0][0] == "module" else scope[steps[0][1]]
    for kind, name in steps[1:]:
        obj = step(obj, kind, name)
    return obj


def resolve_parent(steps: list[Step], scope: dict[str, Any]) -> Any:
    """The object the path's last step is taken from."""
    return resolve(steps[:-1], scope)


def step(obj: Any, kind: str, name: str) -> Any:
    if kind == "attr":
        return getattr(obj, name)
    if kind == "key":
        return obj[name]
    if kind == "index":
        if not isinstance(obj, (tuple, list)):
            raise TypeError(f"an index into a {type(obj).__qualname__}")
        return obj[int(name)]
    if kind == "type":
        return type(obj)
    if kind == "value":
        if not isinstance(obj, dict):
            raise TypeError(f"the values of a {type(obj).__qualname__}")
        return list(obj.values())[int(name)]
    if kind in ("dict", "keys"):
        if not isinstance(obj, (dict, types.MappingProxyType)):
            raise TypeError(f"{kind}() of a {type(obj).__qualname__}")
        return dict(obj) if kind == "dict" else list(obj.keys())
    raise TypeError(f"a step of kind {kind!r}")


def path_text(steps: list[Step]) -> str:
    if steps[0][0] == "module":
        text = f"__import__({steps[0][1]!r})"
    else:
        text = f"{'G' if steps[0][0] == 'global' else 'L'}[{steps[0][1]!r}]"
    for kind, name in steps[1:]:
        if kind == "attr":
            text += f".{name}"
        elif kind == "key":
            text += f"[{name!r}]"
        elif kind == "index":
            text += f"[{name}]"
        elif kind == "value":
            text = f"{text}[list(dict.keys({text}))[{name}]]"
        elif kind == "keys":
            text = f"list(dict.keys({text}))"
        else:
            text = f"{kind}({text})"
    return text
