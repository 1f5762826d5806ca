"""What Dynamo reuse (:mod:`pytest_megacache.dynamo_reuse`) checks a stored entry against, without torch:

- **Code.** :func:`code_digest` is a digest of everything in a code object that decides what it does, compared
  recursively (bytecode, constants including nested code, names, variable names, flags); :func:`source_id` is a
  compiled function's entry id: its module, path relative to the rootdir, qualname, first line and code digest.
- **Identity guards on globals.** :func:`prove` builds the proof stored for a guard on the identity of a global
  reached by a path of attributes and keys from the module's globals (:func:`parse_path`, :func:`resolve`): what
  that object was (:func:`describe`). :func:`pack_guards` stores the proofs with torch's guard state and
  :func:`unpack_guards` reads them back; :func:`check_proofs` checks them against the objects the paths name now.

What cannot be proven, or no longer holds, raises :class:`Refused`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import types
from typing import Any

_MAGIC = b"megacache-guards-1\n"
_ID_PREFIX = b"pytest-megacache dynamo entry 1\0"
# A guard's source as Dynamo names it, when it is a path from the module's globals: G['name'] then .attr / ['key'].
_PATH_HEAD = re.compile(r"G\[(?P<q>['\"])(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P=q)\]")
_PATH_STEP = re.compile(r"\.(?P<attr>[A-Za-z_][A-Za-z0-9_]*)|\[(?P<q>['\"])(?P<key>[A-Za-z_][A-Za-z0-9_.]*)(?P=q)\]")


class Refused(Exception):
    """A frame's entry is not used (or not stored); ``reason`` is one of
    :data:`pytest_megacache.dynamo_reuse.REFUSALS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# --- what a code object is, compared recursively ----------------------------------------------------------------
def _feed_const(h: Any, value: object) -> None:
    if isinstance(value, types.CodeType):
        h.update(b"code{")
        _feed_code(h, value)
        h.update(b"}")
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}{len(value)}(".encode())
        for item in value:
            _feed_const(h, item)
        h.update(b")")
    elif isinstance(value, frozenset):  # a string set's order follows the hash seed
        h.update(f"frozenset{len(value)}(".encode())
        for text in sorted(_const_text(item) for item in value):
            h.update(text.encode("utf-8", "surrogatepass") + b"\0")
        h.update(b")")
    else:
        h.update(_const_text(value).encode("utf-8", "surrogatepass") + b"\0")


def _const_text(value: object) -> str:
    if isinstance(value, types.CodeType):
        h = hashlib.sha256()
        _feed_code(h, value)
        return "code:" + h.hexdigest()
    if isinstance(value, (tuple, list, frozenset)):
        h = hashlib.sha256()
        _feed_const(h, value)
        return f"{type(value).__name__}:" + h.hexdigest()
    return f"{type(value).__qualname__}:{value!r}"


def _feed_code(h: Any, code: types.CodeType) -> None:
    for attr in ("co_name", "co_qualname", "co_firstlineno", "co_argcount", "co_posonlyargcount", "co_kwonlyargcount",
                 "co_flags", "co_names", "co_varnames", "co_freevars", "co_cellvars"):
        h.update(f"{attr}={getattr(code, attr, None)!r}\0".encode("utf-8", "surrogatepass"))
    h.update(code.co_code)
    h.update(b"\0exc\0" + bytes(getattr(code, "co_exceptiontable", b"")))
    h.update(f"\0consts{len(code.co_consts)}\0".encode())
    for const in code.co_consts:
        _feed_const(h, const)


def code_digest(code: types.CodeType) -> str:
    """A digest of everything in a code object that decides what it does (not its file's absolute path, nor the
    line numbers of its body, which torch checks through its inlined sources' checksums)."""
    h = hashlib.sha256()
    _feed_code(h, code)
    return h.hexdigest()


def function_of(fn: Any) -> Any:
    """The plain function behind a bound method (an ``nn.Module``'s forward); ``fn`` is what torch's
    ``innermost_fn`` returned, the function whose code Dynamo caches on."""
    return getattr(fn, "__func__", fn)


def _relative_file(filename: str, rootdir: str) -> str:
    try:
        path = os.path.realpath(filename)
        root = os.path.realpath(rootdir)
        if rootdir and os.path.commonpath([path, root]) == root:
            return os.path.relpath(path, root)
    except ValueError:
        pass
    return ""  # outside the project: the module name stands for it (an absolute path differs between machines)


def source_id(fn: Any, rootdir: str) -> str:
    """The entry id of a compiled function (as torch's ``innermost_fn`` gives it): module, path relative to the
    rootdir, qualname, first line, code."""
    func = function_of(fn)
    code = func.__code__
    h = hashlib.sha256(_ID_PREFIX)
    for part in (getattr(func, "__module__", "") or "", _relative_file(code.co_filename, rootdir),
                 getattr(func, "__qualname__", code.co_name), str(code.co_firstlineno), code_digest(code)):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


# --- proofs for identity guards on globals ----------------------------------------------------------------------
def parse_path(name: str) -> list[tuple[str, str]] | None:
    """``G['torch'].nn['x']`` -> [("global", "torch"), ("attr", "nn"), ("key", "x")]; None for any other source."""
    head = _PATH_HEAD.match(name)
    if head is None:
        return None
    steps = [("global", head.group("name"))]
    pos = head.end()
    while pos < len(name):
        step = _PATH_STEP.match(name, pos)
        if step is None:
            return None
        steps.append(("attr", step.group("attr")) if step.group("attr") else ("key", step.group("key")))
        pos = step.end()
    return steps


def resolve(steps: list[tuple[str, str]], scope: dict[str, Any]) -> Any:
    """The object a parsed path names in a module's globals (no code runs but attribute and item lookups)."""
    kind, name = steps[0]
    obj = scope[name]
    for kind, name in steps[1:]:
        obj = getattr(obj, name) if kind == "attr" else obj[name]
    return obj


def describe(obj: Any) -> list[str] | None:
    """What an object is, as far as the same description in another process means the same object; None when
    nothing stable describes it (then its identity guard cannot be proven)."""
    if obj is None or obj is True or obj is False or obj is Ellipsis or obj is NotImplemented:
        return ["const", repr(obj)]
    if isinstance(obj, types.ModuleType):
        return ["module", obj.__name__]
    if isinstance(obj, types.CodeType):
        return ["code", code_digest(obj)]
    if isinstance(obj, types.FunctionType):
        if "<locals>" in obj.__qualname__ or obj.__closure__:
            return None
        return ["function", str(obj.__module__), obj.__qualname__, code_digest(obj.__code__)]
    if isinstance(obj, type):
        if "<locals>" in obj.__qualname__:
            return None
        return ["class", str(obj.__module__), obj.__qualname__]
    if isinstance(obj, enum.Enum):
        return ["enum", str(type(obj).__module__), type(obj).__qualname__, obj.name]
    if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodDescriptorType,
                        types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, types.ModuleType):
            module = module or owner.__name__
        elif owner is not None and not isinstance(owner, type):
            return None  # a method bound to an instance: that instance has no stable name
        if not module or not qualname:
            return None
        return ["builtin", str(type(obj).__qualname__), str(module), str(qualname)]
    return None


def prove(name: str, obj: Any, scope: dict[str, Any]) -> dict[str, Any]:
    """The proof stored for an identity guard on ``name`` (whose object is ``obj``); raises :class:`Refused`."""
    steps = parse_path(name)
    if steps is None:
        raise Refused("unsupported_guard", f"an identity guard on {name}, which is not a path from the globals")
    try:
        same = resolve(steps, scope) is obj
    except Exception:  # noqa: BLE001 - a path that does not resolve the same way cannot be proven
        same = False
    if not same:
        raise Refused("unsupported_guard", f"an identity guard on {name} that its path does not reach")
    what = describe(obj)
    if what is None:
        raise Refused("unsupported_guard", f"an identity guard on {name}, a {type(obj).__qualname__}")
    return {"path": steps, "is": what}


def check_proofs(proofs: list[dict[str, Any]], scope: dict[str, Any]) -> None:
    """Raises :class:`Refused` unless every proof's path names an object described as stored."""
    for proof in proofs:
        steps = [(str(kind), str(name)) for kind, name in proof["path"]]
        try:
            obj = resolve(steps, scope)
        except Exception as exc:  # noqa: BLE001
            raise Refused("global_changed", f"{_path_text(steps)} is gone ({type(exc).__name__})") from None
        if describe(obj) != proof["is"]:
            raise Refused("global_changed", f"{_path_text(steps)} is another object than the one traced")


def _path_text(steps: list[tuple[str, str]]) -> str:
    text = f"G[{steps[0][1]!r}]"
    for kind, name in steps[1:]:
        text += f".{name}" if kind == "attr" else f"[{name!r}]"
    return text


def pack_guards(proofs: list[dict[str, Any]], guards_state: bytes) -> bytes:
    header = json.dumps(proofs, separators=(",", ":")).encode()
    return _MAGIC + len(header).to_bytes(8, "big") + header + guards_state


def unpack_guards(data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """The proofs and torch's guard state; raises :class:`Refused` for guards stored without proofs."""
    if not isinstance(data, (bytes, bytearray)) or not bytes(data[:len(_MAGIC)]) == _MAGIC:
        raise Refused("unsupported_guard", "guards stored without the plugin's proofs")
    start = len(_MAGIC) + 8
    size = int.from_bytes(data[len(_MAGIC):start], "big")
    proofs = json.loads(bytes(data[start:start + size]))
    if not isinstance(proofs, list) or not all(isinstance(p, dict) and "path" in p and "is" in p for p in proofs):
        raise Refused("unsupported_guard", "malformed proofs")
    return proofs, bytes(data[start + size:])

