"""Proofs for identity guards on objects reached from a frame's globals (no torch imported).

The guard kinds they stand for: ``ID_MATCH``, ``FUNCTION_MATCH``, ``CLOSURE_MATCH``, ``MODULE_MATCH``,
``CLASS_MATCH`` and ``BUILTIN_MATCH`` on a source such as ``G['torch'].nn.functional.relu``,
``G['__builtins_dict___0']['len']``, ``type(G['dataclasses'].MISSING)`` or ``G['f'].__closure__[0].cell_contents``.

- What the path reaches is stored as :func:`~pytest_megacache.dynamo.objects.describe` gives it; a builtin without a
  module of its own (an extension's function) reached as an attribute of a module, as that module's member.
- A global whose name Dynamo made from an object's address in the tracing process (``_<id>_c<n>``: the ``torch``
  module for ``type(x)`` on a tensor, say) is not in a later process's globals. What it held is stored, found again
  by name at load (a module, a class or a function, among the modules already imported) and bound before the check.

On load the path is followed in the module's globals as they are then; the guard is rebuilt on that object.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .objects import Refused, describe, describe_member, find
from .paths import Step, path_text, resolve, resolve_parent

# install_global_by_id's names: f"{prefix}_{id(value)}_c{compile_id}"
PROCESS_NAMED = re.compile(r"^[A-Za-z0-9_]*_\d{5,}_c\d+$")
_FINDABLE = ("module", "class", "function")


def describe_at(steps: list[Step], obj: Any, scope: dict[str, Any]) -> list[str] | None:
    """What the object a path reaches is: :func:`describe`'s, or a module's member by its attribute name."""
    what = describe(obj)
    if what is None and len(steps) > 1 and steps[-1][0] == "attr":
        what = describe_member(resolve_parent(steps, scope), steps[-1][1], obj)
    return what


def prove_global(name: str, steps: list[Step], obj: Any, scope: dict[str, Any]) -> dict[str, Any]:
    """The proof for ``obj``, which ``steps`` reach from ``scope`` (the frame's globals)."""
    what = describe_at(steps, obj, scope)
    if what is None:
        raise Refused("unsupported_guard", f"an identity guard on {name}, a {type(obj).__qualname__}")
    proof: dict[str, Any] = {"path": steps, "is": what}
    head = steps[0][1]
    if PROCESS_NAMED.match(head):
        held = describe(scope[head])
        if held is None or held[0] not in _FINDABLE or find(held) is not scope[head]:
            raise Refused("unsupported_guard", f"{name} goes through a global of this process only")
        proof["bind"] = held
    return proof


def check_global(proof: dict[str, Any], steps: list[Step], scope: dict[str, Any],
                 bind: Callable[[str, Any], None] | None) -> None:
    head = steps[0][1]
    held = proof.get("bind")
    if held is not None:
        now = find(held)
        if now is None:
            raise Refused("global_changed", f"{path_text(steps)}: what {head} held is not found")
        if head not in scope:
            if bind is None:
                raise Refused("global_changed", f"{path_text(steps)}: {head} cannot be bound")
            bind(head, now)
        elif scope[head] is not now:
            raise Refused("global_changed", f"{path_text(steps)}: {head} holds another object")
    try:
        obj = resolve(steps, scope)
        what = describe_at(steps, obj, scope)
    except Exception as exc:  # noqa: BLE001
        raise Refused("global_changed", f"{path_text(steps)} is gone ({type(exc).__name__})") from None
    if what != proof["is"]:
        raise Refused("global_changed", f"{path_text(steps)} is another object than the one traced")
