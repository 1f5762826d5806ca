"""What an object is, as far as another process can tell it is the same one (no torch imported):

- **Code.** :func:`code_digest` is a digest of everything in a code object that decides what it does, compared
  recursively (bytecode, constants including nested code, names, variable names, flags).
- **Named objects.** :func:`describe` says what a module, a function, a class, an enum member or a builtin is: its
  module and qualname, with a digest of what decides its behaviour (a function's code; a class's own definition
  and that of every class it inherits from). :func:`find` finds an object again by its description, through the
  modules already imported: by qualname, through a class's ``__dict__`` and through ``__wrapped__`` (a function
  behind a decorator).

What cannot be proven, or no longer holds, raises :class:`Refused`.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import json
import sys
import types
from typing import Any


class Refused(Exception):
    """A frame's entry is not used (or not stored); ``reason`` is one of
    :data:`pytest_megacache.dynamo.REFUSALS`."""

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
        return "code:" + code_digest(value)
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


# Code objects are immutable: a digest holds for as long as its code object lives (kept here, so that its id is not
# reused). A class's definition is digested from its members' digests, so its methods are digested once a process.
_CODE_DIGESTS: dict[int, tuple[types.CodeType, str]] = {}


def code_digest(code: types.CodeType) -> str:
    """A digest of everything in a code object that decides what it does (not its file's absolute path, nor the
    line numbers of its body, which torch checks through its inlined sources' checksums)."""
    known = _CODE_DIGESTS.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    h = hashlib.sha256()
    _feed_code(h, code)
    digest = h.hexdigest()
    _CODE_DIGESTS[id(code)] = (code, digest)
    return digest


def function_of(fn: Any) -> Any:
    """The plain function behind a bound method (an ``nn.Module``'s forward); ``fn`` is what torch's
    ``innermost_fn`` returned, the function whose code Dynamo caches on."""
    return getattr(fn, "__func__", fn)


# --- what a class's definition is ---------------------------------------------------------------------------------
_SIMPLE = (int, float, complex, str, bytes, bool, type(None))


def _plain(value: object) -> bool:
    return isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value))


def _member_text(value: object) -> str:
    """What a class member is, for the class's digest: code digests for what runs, values for plain constants, the
    kind alone for anything else (an object's repr may carry its address)."""
    if isinstance(value, (staticmethod, classmethod)):
        return f"{type(value).__name__}({_member_text(value.__func__)})"
    if isinstance(value, property):
        return "property(" + ",".join(_member_text(f) for f in (value.fget, value.fset, value.fdel)) + ")"
    if isinstance(value, types.FunctionType):
        defaults = ",".join(_member_text(d) for d in (value.__defaults__ or ()))
        return f"function({code_digest(value.__code__)};{defaults};{len(value.__closure__ or ())})"
    if isinstance(value, type):
        return f"class({value.__module__}.{value.__qualname__})"
    if _plain(value):
        return f"{type(value).__qualname__}:{value!r}"
    return f"instance({type(value).__module__}.{type(value).__qualname__})"


# (``__slotnames__`` is copyreg's cache, set on a class when an instance is first pickled.)
_SKIPPED_MEMBERS = frozenset({"__doc__", "__dict__", "__weakref__", "__module__", "__qualname__", "__slotnames__"})


# Members Python puts into a class's namespace where its annotations are first read, not where it is defined: an
# empty ``__annotations__`` (3.10-3.13, for a class that has none) and 3.14's ``__annotations_cache__`` (what its
# ``__annotate__`` gave) and ``__annotate_func__`` (None for a class that has none). A test that reads them would
# otherwise give the class another digest in its session than in one that did not.
def _filled_when_read(name: str, value: object) -> bool:
    if name == "__annotations__":
        return type(value) is dict and not value
    return name == "__annotations_cache__" or (name == "__annotate_func__" and value is None)


_CLASS_DIGESTS: dict[int, tuple[type, tuple[int, ...], str]] = {}


def class_digest(cls: type) -> str:
    """A digest of a class's definition: its name, its bases' names, and every member of it and of each class it
    inherits from (code digests for functions, properties and class or static methods). A member edited, added,
    removed or rebound (``monkeypatch``) gives another digest; what Python fills in where a class's annotations are
    read does not."""
    mro = cls.__mro__
    members = [vars(c) for c in mro]
    # The cache holds while no class of the MRO gained, lost or rebound a member (the ids of every member value).
    stamp = tuple(id(v) for namespace in members for v in namespace.values()) + tuple(id(c) for c in mro)
    known = _CLASS_DIGESTS.get(id(cls))
    if known is not None and known[0] is cls and known[1] == stamp:
        return known[2]
    h = hashlib.sha256()
    for c, namespace in zip(mro, members, strict=True):
        h.update(f"class {c.__module__}.{c.__qualname__}\0".encode("utf-8", "surrogatepass"))
        if c.__module__ == "builtins":
            continue  # a builtin class's members are the interpreter's
        for name in sorted(namespace):
            if name not in _SKIPPED_MEMBERS and not _filled_when_read(name, namespace[name]):
                h.update(f"{name}={_member_text(namespace[name])}\0".encode("utf-8", "surrogatepass"))
    digest = h.hexdigest()
    _CLASS_DIGESTS[id(cls)] = (cls, stamp, digest)
    return digest


# --- what an object is, and finding it again ----------------------------------------------------------------------
def _cells(fn: types.FunctionType, depth: int) -> str | None:
    if depth >= 4:
        return None
    h = hashlib.sha256(b"cells\0")
    for cell in fn.__closure__ or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        what = describe(content, depth + 1)
        if what is None and _plain(content):
            what = ["value", f"{type(content).__qualname__}:{content!r}"]
        if what is None:
            what = _plain_state(content)
        if what is None:
            return None
        h.update(json.dumps(what).encode() + b"\0")
    return h.hexdigest()


def _plain_state(obj: Any) -> list[str] | None:
    """An instance held by a closure (a decorator class's instance, say) as its class's definition and its state,
    where that state is plain values only (an equal description is an object of the same definition and state)."""
    cls = type(obj)
    state = getattr(obj, "__dict__", None)
    if (not isinstance(state, dict) or cls.__module__ == "builtins" or "<locals>" in cls.__qualname__
            or any("__slots__" in vars(c) for c in cls.__mro__)):
        return None
    if not all(isinstance(k, str) and _plain(v) for k, v in state.items()):
        return None
    return ["state", str(cls.__module__), cls.__qualname__, class_digest(cls), repr(sorted(state.items()))]


def describe(obj: Any, depth: int = 0) -> list[str] | None:
    """What an object is, as far as the same description in another process means the same object; None when
    nothing stable describes it (then its identity guard cannot be proven)."""
    if obj is None or obj is True or obj is False or obj is Ellipsis or obj is NotImplemented:
        return ["const", repr(obj)]
    if isinstance(obj, types.ModuleType):
        return ["module", obj.__name__]
    if isinstance(obj, types.CodeType):
        return ["code", code_digest(obj)]
    if isinstance(obj, types.FunctionType):
        # A function made by another one (``<locals>``, a factory's product) is the same where its code and what its
        # cells hold are; it has no name to be found again by (:func:`find` never finds it).
        what = ["function", str(obj.__module__), obj.__qualname__, code_digest(obj.__code__)]
        if obj.__closure__:  # a decorator's wrapper: what its cells hold must have names too
            cells = _cells(obj, depth)
            if cells is None:
                return None
            what.append(cells)
        return what
    if isinstance(obj, type):
        if "<locals>" in obj.__qualname__:
            return None  # a class defined in a function is a new object at every call
        return ["class", str(obj.__module__), obj.__qualname__, class_digest(obj)]
    if isinstance(obj, enum.Enum):
        return ["enum", str(type(obj).__module__), type(obj).__qualname__, obj.name]
    if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodDescriptorType,
                        types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, types.ModuleType):
            module = module or owner.__name__
        elif isinstance(owner, type):  # a class's builtin method (tuple.__new__): its class's module
            module = module or owner.__module__
        elif owner is not None:
            return None  # a method bound to an instance: that instance has no stable name
        if not module or not qualname:
            return None
        return ["builtin", str(type(obj).__qualname__), str(module), str(qualname)]
    return None


def describe_member(owner: Any, name: str, obj: Any) -> list[str] | None:
    """A builtin without a module of its own (an extension's function) as the attribute ``name`` of the module
    ``owner``: its kind, name and documentation (an extension's signature) say it is the one traced."""
    if not isinstance(owner, types.ModuleType) or not isinstance(obj, types.BuiltinFunctionType):
        return None
    doc = hashlib.sha256(str(getattr(obj, "__doc__", "")).encode("utf-8", "surrogatepass")).hexdigest()
    return ["member", owner.__name__, name, str(type(obj).__qualname__), str(getattr(obj, "__name__", "")), doc]


_NAMED_TUPLE_SCOPE = "namedtuple_"  # the __name__ of the scope collections.namedtuple makes a class's __new__ in


def describe_named_tuple_scope(value: Any) -> list[str] | None:
    """The scope ``collections.namedtuple`` evaluated a class's ``__new__`` in (a dict of its own per class, which
    Dynamo installs as a global where it inlines the ``__new__``), as ``["scope", <the class>]``, where the class is
    found by name among the modules imported; else None."""
    name = value.get("__name__") if isinstance(value, dict) else None
    if not isinstance(name, str) or not name.startswith(_NAMED_TUPLE_SCOPE):
        return None
    typename = name[len(_NAMED_TUPLE_SCOPE):]
    for module in list(sys.modules.values()):
        cls = getattr(module, "__dict__", {}).get(typename)
        if isinstance(cls, type) and _scope_of(cls) is value and (what := describe(cls)) is not None:
            return ["scope", *what]
    return None


def _scope_of(cls: type) -> Any:
    new = vars(cls).get("__new__")
    scope = getattr(new.__func__ if isinstance(new, staticmethod) else new, "__globals__", None)
    return scope if isinstance(scope, dict) and str(scope.get("__name__", "")).startswith(_NAMED_TUPLE_SCOPE) else None


def find(what: list[str]) -> Any:
    """The object a description names now, among the modules already imported (importing runs code: never done
    here); None when it is not found or not the same."""
    kind = what[0] if what else ""
    if kind == "module":
        return sys.modules.get(what[1])
    if kind == "scope":
        cls = find(what[1:])
        return _scope_of(cls) if isinstance(cls, type) else None
    if kind not in ("function", "class") or len(what) < 3 or "<locals>" in what[2]:
        return None
    obj: Any = sys.modules.get(what[1])
    for part in what[2].split("."):
        if obj is None:
            return None
        namespace = vars(obj) if isinstance(obj, type) else None
        obj = namespace.get(part) if namespace is not None and part in namespace else getattr(obj, part, None)
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    if isinstance(obj, property):  # a getter, setter or deleter, named after its property
        obj = next((f for f in (obj.fget, obj.fset, obj.fdel) if f is not None and describe(f) == what), None)
    for _ in range(8):  # a decorator's wrapper names what it wraps
        if obj is None or describe(obj) == what:
            return obj
        obj = getattr(obj, "__wrapped__", None)
    return None


def missing_module(exc: BaseException) -> str | None:
    """The module whose absence failed loading an entry (an import of it by torch), else None."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name
    return None


def importable(name: str) -> bool:
    """Whether the module ``name`` is imported, or could be (its spec is found; nothing is imported)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # noqa: BLE001 - a parent package missing, say
        return False
