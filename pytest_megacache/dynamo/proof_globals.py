"""Proofs for identity guards on objects reached from a frame's globals (no torch imported).

The guard kinds they stand for: ``ID_MATCH``, ``FUNCTION_MATCH``, ``CLOSURE_MATCH``, ``MODULE_MATCH``,
``CLASS_MATCH`` and ``BUILTIN_MATCH`` on a source such as ``G['torch'].nn.functional.relu``,
``G['__builtins_dict___0']['len']``, ``type(G['dataclasses'].MISSING)`` or ``G['f'].__closure__[0].cell_contents``.

- What the path reaches is stored as :func:`~pytest_megacache.dynamo.objects.describe` gives it; a builtin without a
  module of its own (an extension's function) reached as an attribute of a module, as that module's member.
- A global whose name Dynamo made from an object's address in the tracing process (``_<id>_c<n>``: the ``torch``
  module for ``type(x)`` on a tensor, say) is not in a later process's globals. What it held is stored, found again
  by name at load (a module, a class or a function, among the modules already imported) and bound before the check.
- A named tuple's ``__new__`` reads its class's own scope (``___unnamed_scope_<id>_c<n>``): bound again as the scope
  of the class found by module and qualname, whose definition the class's digest fixes.
- So is every global the trace installed that its output code may read and that torch's install does not make again
  (:func:`prove_installed`: a tensor subclass's class, ``__subclass_<name>_<id>_c<n>``, which the output code uses to
  wrap what it returns); a frame whose trace installed one that cannot be found by name (a function made during the
  trace, a weak reference, a stream) is not stored: its variant would fail where it is taken.

On load the path is followed in the module's globals as they are then; the guard is rebuilt on that object.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from .objects import Refused, describe, describe_member, describe_named_tuple_scope, find
from .paths import Step, path_text, resolve, resolve_parent

# install_global_by_id's names: f"{prefix}_{id(value)}_c{compile_id}"
PROCESS_NAMED = re.compile(r"^[A-Za-z0-9_]*_\d{5,}_c\d+$")
_FINDABLE = ("module", "class", "function", "scope")


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
        held = _findable(scope[head])
        if held is None:
            raise Refused("unsupported_guard", f"{name} goes through a global of this process only")
        proof["bind"] = held
    return proof


def _findable(value: Any) -> list[str] | None:
    """What ``value`` is, where another process finds the very object again by it (a module, a class or a function,
    among the modules imported, or the scope a named tuple's ``__new__`` was made in): a global of this process to
    bind again there; else None."""
    held = describe(value) if not isinstance(value, dict) else describe_named_tuple_scope(value)
    return held if held is not None and held[0] in _FINDABLE and find(held) is value else None


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


def recreated_globals(output_graph: Any, builtins_name: str | None) -> set[str]:
    """The globals of a trace that torch's install of its entry makes again: the compiled graphs, resume functions
    and imports that its package's code entries record (a resume function is an entry of its own), and the builtins
    dict."""
    package = getattr(output_graph, "package", None)
    entries = [*getattr(package, "_codes", {}).values(), getattr(package, "_current_entry", None)]
    names = {str(name) for entry in entries if entry is not None
             for field in ("backend_ids", "function_names", "import_sources") for name in getattr(entry, field, ())}
    return names | ({builtins_name} if builtins_name else set())


def prove_installed(installed: Iterable[str], recreated: set[str], proofs: list[dict[str, Any]],
                    scope: dict[str, Any]) -> list[dict[str, Any]]:
    """Proofs binding again each global of ``installed`` (torch's names of the globals a trace put in the frame's
    module) that torch's install does not make (``recreated``: the entry's backends, resume functions, imports and
    builtins dict) and that none of ``proofs`` binds: what it holds, found by name. Raises :class:`Refused` for one
    that cannot be found so."""
    bound = {str(proof["path"][0][1]) for proof in proofs if "bind" in proof}
    out: list[dict[str, Any]] = []
    for name in sorted(set(installed) - recreated - bound):
        held = _findable(scope[name]) if name in scope else None
        if held is None:
            raise Refused("unsupported_guard", f"the output code reads {name}, a global of this process only")
        out.append({"path": [("global", name)], "is": held, "bind": held})
    return out
