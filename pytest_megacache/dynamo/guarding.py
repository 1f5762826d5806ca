"""Guards stay whole (:func:`guards_kept_whole`): the guards the running process evaluates are built as without
caching precompile (torch drops identity guards from them when the flag is on), and what is stored of a frame's
guards carries a proof for each identity guard (:mod:`.proofs`), for each class a type guard names, and for each
global the trace installed that torch's install does not make again. A frame whose guards cannot be proven, whose
backend cannot be named in another process, or whose trace did what cannot be done again is left out of the store
(counted with its reason), never failed: torch bypasses its entry.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from typing import Any, NamedTuple

from .backends import wrapped_after_backend
from .context import innermost_backend
from .effects import Trace, code_key, effects_of
from .objects import Refused
from .offers import NEW, UNSTABLE
from .patches import PATCHES
from .proof_globals import prove_installed, recreated_globals
from .proofs import guards_digest, pack_guards, prove, prove_class, reason_of

__all__ = ["PROVABLE_GUARDS", "UNPROVABLE_GUARDS", "guards_kept_whole"]

# Identity guards kept and proven (torch 2.13 refuses to serialize them, or drops them from the live guards).
PROVABLE_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "MODULE_MATCH", "CLASS_MATCH",
                             "BUILTIN_MATCH"})
# Guards on run-time state that no stored proof can stand for: a frame holding one is never stored.
UNPROVABLE_GUARDS = ("DICT_VERSION", "NN_MODULE", "WEAKREF_ALIVE")


class _Torch(NamedTuple):
    """What of torch storing a frame's guards needs: its own serializer, its error for a frame not stored, the compile
    id of the moment and its counters."""

    serialize: Any
    package_error: type[Exception]
    compile_id: Any
    counters: Any


def guards_kept_whole(state: Any, torch: Any, guards: Any) -> None:
    """torch's ``CheckFunctionManager`` builds the live guards as without caching precompile, and stores proofs with
    the guards it serializes (:func:`stored_with_proofs`); ``state``: the process's reuse state."""
    manager = guards.CheckFunctionManager
    init, config = manager.__init__, torch._dynamo.config
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state.frame_code = args[0] if args else kwargs.get("f_code")
        with config.patch(caching_precompile=False):
            init(self, *args, **kwargs)
        try:
            saving = bool(signature.bind(self, *args, **kwargs).arguments.get("save_guards", False))
        except TypeError:
            saving = False
        if saving:
            state.count("dynamo_traced")
            if self.guards_state is None:
                # torch bypassed the frame's package entry (its guards are not storable) but still asserts a state:
                # the entry is marked bypassed, so torch stores nothing of this placeholder.
                self.guards_state = b""

    PATCHES.replace(manager, "__init__", __init__,
                    "the live guards built as without caching precompile, which drops identity guards from them")
    PATCHES.replace(manager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", UNPROVABLE_GUARDS,
                    "identity guards are stored with proofs; guards on run-time state keep the frame out of the store")
    own = _Torch(manager.serialize_guards, torch._dynamo.exc.PackageError,
                 torch._guards.CompileContext.current_compile_id, torch._dynamo.utils.counters)

    @functools.wraps(own.serialize)
    def serialize_guards(self: Any, builder: Any, sorted_guards: list[Any], output_graph: Any) -> bytes:
        return stored_with_proofs(state, own, self, builder, sorted_guards, output_graph)

    PATCHES.replace(manager, "serialize_guards", serialize_guards,
                    "identity guards stored with their proofs; a frame that cannot be stored is left out, never failed")
    pickler = getattr(guards, "GuardsStatePickler", None)
    if pickler is not None and "reducer_override" in vars(pickler):
        PATCHES.replace(pickler, "reducer_override", modules_set_plainly(pickler.reducer_override, torch.nn.Module),
                        "a module whose class sets its own state is stored to be loaded as torch.nn.Module loads it")


def modules_set_plainly(reducer_override: Any, module_type: Any) -> Any:
    """torch's reducer of a guarded frame's objects, with a module whose class has its own ``__setstate__`` (and
    ``torch.nn.Module``'s ``__getstate__``) stored to be set by ``torch.nn.Module.__setstate__``
    (:func:`module_state_set`). torch stores only what the frame's guards read of a module (the rest a placeholder):
    a library's ``__setstate__`` that reads the rest fails, and the state had to be loaded again by Python's own
    unpickler (:func:`.repairs.guards_state_loaded`), tens of milliseconds a frame. Loaded so, the module's
    ``__dict__`` is the traced one's, as that fallback makes it, in one pass of the C unpickler."""
    reduce_ex: Any = object.__reduce_ex__
    reduce: Any = object.__reduce__

    @functools.wraps(reducer_override)
    def reducer(self: Any, obj: Any) -> Any:
        reduced = reducer_override(self, obj)
        if reduced is not NotImplemented or not isinstance(obj, module_type):
            return reduced
        cls: Any = type(obj)
        # torch's own (Dynamo wraps it in place on the class: compared as it is now)
        if cls.__setstate__ is module_type.__setstate__ or cls.__getstate__ is not module_type.__getstate__ \
                or cls.__reduce_ex__ is not reduce_ex or cls.__reduce__ is not reduce:
            return reduced
        made, args, state, items, pairs = (*reduce_ex(obj, 2), None, None)[:5]
        if type(state) is not dict:  # slots too: as torch stores it
            return reduced
        return made, args, state, items, pairs, module_state_set

    return reducer


def module_state_set(module: Any, state: Any) -> None:
    """A stored module's state put in place by ``torch.nn.Module.__setstate__`` as it is where it is loaded."""
    import torch

    setstate: Any = torch.nn.Module.__setstate__
    setstate(module, state)


def stored_with_proofs(state: Any, own: _Torch, manager: Any, builder: Any, sorted_guards: list[Any],
                       output_graph: Any) -> bytes:
    """What is stored of a frame's guards: torch's serialized guards with the proofs, the compile context, what the
    trace did that a test can see and the seconds it took; raises torch's ``PackageError`` (the frame's entry is
    bypassed) for a frame that cannot be stored, counting why."""
    context = state.contexts[-1] if state.contexts else None
    trace = state.traces.get(str(own.compile_id()))
    effects = _storable(state, own, context, trace, output_graph)
    try:
        proofs = _proofs(manager, builder, sorted_guards, output_graph)
    except Refused as exc:
        state.refuse(exc.reason, str(exc))
        raise own.package_error(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a proof that cannot be built: this frame is not stored
        state.refuse("unsupported_guard", f"{type(exc).__name__}: {exc}")
        raise own.package_error(f"{type(exc).__name__}: {exc}") from None
    try:
        # torch's serializer reads what it stores (a non-leaf tensor's ``.grad``, which warns): a warning that a run
        # without reuse, which never serializes, never shows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = own.serialize(manager, builder, sorted_guards, output_graph)
    except own.package_error as exc:
        state.refuse(reason_of(exc.__cause__) if exc.__cause__ else "unsupported_guard", str(exc))
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. TypeError for the type of a local defined in local scope
        # torch raises these past its own bypass, which would fail the test: this frame is not stored instead
        reason = "unsupported_guard" if isinstance(exc, TypeError) else reason_of(exc)
        state.refuse(reason, f"{type(exc).__name__}: {exc}")
        raise own.package_error(f"{type(exc).__name__}: {exc}") from None
    state.count("dynamo_stored")
    seconds = traced = None
    if trace is not None:
        seconds = time.perf_counter() - trace.started  # the guards are built last
        traced = trace.traced_seconds(seconds)  # of those, the trace's own: never more than the whole
    packed = pack_guards(proofs, str(context), data, state.test, state.retraced != NEW, effects, seconds,
                         modules_needed(output_graph), traced)
    if state.retraced == UNSTABLE:
        state.superseded.add(guards_digest(packed))
    return packed


def backend_named(output_graph: Any) -> str:
    """The module and qualname of the backend a frame was compiled with, below torch's wrappers ("" where none): a
    function a test made, ``torch._dynamo.explain``'s recorder of graphs, say."""
    backend = innermost_backend(getattr(output_graph, "compiler_fn", None))
    name = getattr(backend, "__qualname__", None) or getattr(type(backend), "__qualname__", "")
    return f"{getattr(backend, '__module__', '')}.{name}".strip(".") if backend is not None else ""


def modules_needed(output_graph: Any) -> list[str]:
    """The modules whose functions the frame's trace inlined (as torch records their sources with the entry) or
    imported: a stored entry's variant needs them where it is taken (:func:`.installing.without_missing`)."""
    traced = getattr(getattr(output_graph, "tracing_context", None), "traced_code", None) or []
    names = {module.__name__ for code in traced if (module := inspect.getmodule(code)) is not None}
    return sorted(names | {str(name) for name in getattr(output_graph, "import_sources", {}).values()})


def _storable(state: Any, own: _Torch, context: str | None, trace: Trace | None, output_graph: Any) -> dict[str, Any]:
    """What the frame's trace did that a test can see (done again where the variant is taken); raises torch's
    ``PackageError`` where the frame cannot be stored for its backend or for what its trace did."""
    if context is None or wrapped_after_backend(output_graph):
        # a backend of the test's own (or a compile the wrappers did not see start): no later wrapper could be
        # told apart from it; graphs torch dispatches between, but installs one of (backends)
        why = ("shape specializations" if context else "a backend that cannot be named in another process"
               if state.any_backend else "a backend that is not torch's own, or cannot be named in another process")
        if context is None and (named := backend_named(output_graph)):
            why += f" ({named})"
        state.refuse("unsupported_backend", why)
        raise own.package_error(why)
    # a warning shown that cannot be shown again (its class defined in a function, say) leaves the frame traced in
    # every run
    if (effects := effects_of(trace, own.counters)) is None:
        why = ("a warning that cannot be shown again was shown while the frame was traced" if trace is None
               or trace.shown is None else "the trace noted a shape that cannot be noted again")
        state.refuse("side_effect", why)
        state.side_effects.add(code_key(state.frame_code))
        raise own.package_error(why)
    return effects


def _proofs(manager: Any, builder: Any, sorted_guards: list[Any], output_graph: Any) -> list[dict[str, Any]]:
    """A proof for each identity guard, for each class a type guard names and for each global the trace installed
    that torch's install does not make; raises :class:`Refused` for one that cannot be proven."""
    proofs: list[dict[str, Any]] = []
    classes: dict[int, tuple[str, type]] = {}
    builtins_name = getattr(output_graph, "name_of_builtins_dict_key_in_fglobals", None)
    scope, local_scope = builder.scope["G"], builder.scope.get("L")
    for guard in sorted_guards:
        kinds = {guard.create_fn_name(), *(tuple(guard.guard_types) if guard.guard_types else ())}
        if "TYPE_MATCH" in kinds:
            # torch stores the class by module and qualname: the class found so at load must be the same
            classes.setdefault(id(cls := type(builder.get(guard))), (guard.name, cls))
        if kinds & PROVABLE_GUARDS:
            proof = prove(guard.name, builder.get(guard), scope, local_scope)
            proofs.append(proof)
            steps = proof["path"]
            if builtins_name and steps[0] == ("global", builtins_name) and len(steps) > 1:
                # torch stores only the builtins its BUILTIN_MATCH guards name; a proven identity guard on a builtin
                # needs it in the stored scope too, where the guard is rebuilt on load
                manager.used_builtin_vars.add(steps[1][1])
    proofs.extend(proof for name, cls in classes.values() if (proof := prove_class(name, cls)))
    proofs.extend(prove_installed(getattr(output_graph, "installed_globals", ()),
                                  recreated_globals(output_graph, builtins_name), proofs, scope))
    return proofs
