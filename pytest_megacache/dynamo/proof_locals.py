"""Proofs for identity guards on objects reached from a frame's locals (no torch imported).

The guard kinds they stand for: ``ID_MATCH``, ``CLASS_MATCH``, ``FUNCTION_MATCH`` and ``CLOSURE_MATCH`` on a source
rooted at an argument or a closure cell: the class of a local (``type(L['td'])``, ``L['td'].__class__``,
``type(L['td']._tensordict['a'])``), a property's getter inlined from a local's class
(``dict(type(L['td']).__dict__)['device'].fget``, ``dict(type(L['s']).__mro__[1].__dict__)['p'].fget``), a function
held by a decorator's wrapper (``L['func']``) or passed as an argument, a class passed as an argument.

torch stores the locals its guards read (pickled: classes and functions by module and qualname, tensors as meta
tensors) and rebuilds the guards on them at load. So a path is followed in those locals as loaded, which reach the
classes and functions of the process that loads them, and must describe the object traced: a class by its module,
qualname and a digest of its definition and of every class it inherits from (an edited method, an added member or a
``monkeypatch`` refuses it), a function by module, qualname and code. A class or function defined inside a function
(``<locals>``) is a new object at every call: never proven.

A local that *is* the guarded function or class (``L['func']``) but that torch's pickle cannot name (the function
behind a decorator, whose qualname names the wrapper) is found again by its description (through ``__wrapped__``
and classes' ``__dict__``) and put in the loaded locals, so the guard is rebuilt on the object that the frame will
see; at save, such an object must be found again by that description, or the guard is not provable. Deeper in a
path (a class's member), the loaded locals reach the loading process's own objects: a function made by a factory
(``<locals>``) is described there by its code and what its cells hold.
"""

from __future__ import annotations

from typing import Any

from .objects import Refused, describe, find
from .paths import Step, path_text, resolve


def prove_local(name: str, steps: list[Step], obj: Any) -> dict[str, Any]:
    """The proof for ``obj``, which ``steps`` reach from the frame's locals."""
    what = describe(obj)
    if what is None:
        kind = getattr(obj, "__qualname__", type(obj).__qualname__)
        raise Refused("unsupported_guard", f"an identity guard on {name}, {kind}, which has no stable name")
    if len(steps) == 1 and what[0] in ("function", "class") and find(what) is not obj:
        raise Refused("unsupported_guard", f"an identity guard on {name}, which its module and qualname do not name")
    return {"path": steps, "is": what}


def check_local(proof: dict[str, Any], steps: list[Step], scope: dict[str, Any]) -> None:
    """Checks a proof against the locals torch loaded; puts the object found by name at the root of the path where
    the loaded local is not it (the pickle could not name it)."""
    try:
        now = describe(resolve(steps, scope))
    except Exception as exc:  # noqa: BLE001
        raise Refused("local_changed", f"{path_text(steps)} is not reached ({type(exc).__name__})") from None
    # torch 2.15 rebuilds by value a function its pickle cannot name (one behind functools.wraps): a copy that
    # describes the same but is not the object the frame will see, and an identity guard rebuilt on it never holds
    if len(steps) == 1 and (found := find(proof["is"])) is not None:
        scope[steps[0][1]] = found
        return
    if now == proof["is"]:
        return
    raise Refused("local_changed", f"{path_text(steps)} is another object than the one traced")
