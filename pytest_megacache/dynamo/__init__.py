"""Dynamo reuse (``--megacache-precompile``): Dynamo's traced work, stored and taken again only for code proven
identical to what was traced. This module, the family's front door, wraps torch's caching precompile around what
reuse stands on without torch (:mod:`.proofs` and the modules it uses: digests, entry ids, proofs).

torch's caching precompile stores, per ``torch.compile``-wrapped function, Dynamo's output: the transformed
bytecode, its guards and the compiled graphs. As torch ships it, it is not safe for a test suite:

- it keys an entry by the function's ``__qualname__`` and first line only, and maps the wrapped function's current
  code onto the stored entry without comparing them: an edited body, or another module's function of the same name
  and line, runs the stored bytecode;
- it drops guards it cannot serialize (ID_MATCH, CLOSURE_MATCH, MODULE_MATCH, BUILTIN_MATCH, ...) from the guards
  the *running* process evaluates, so even a cold run stops noticing a rebound global function;
- a frame whose guards cannot be serialized fails the test (an assertion after the bypass), one unpicklable entry
  fails the whole save, and a failed load can leave the package half installed.

:func:`install` wraps torch's pieces so that:

1. **Keys are the code.** An entry's id is a digest of the function's module, path relative to the rootdir,
   qualname, first line and its code object compared recursively (bytecode, constants including nested code,
   names, variable names, flags); on load the stored main code is compared with the current one again. Anything
   else is a miss.
2. **Guards stay whole.** The running process keeps every guard torch would build without the option. A guard on
   the identity of a global (a module, a function, a builtin, a class, reached by a path of attributes and keys from
   the module's globals) is stored with a *proof*: what that object was (module name; module, qualname and code
   digest of a function; ...). Where a stored variant is offered each proof is checked against the object the path
   names then, and the guard is rebuilt on that object, so a later rebinding still recompiles. A guard that cannot
   be proven (an instance's identity, a dict version, a weak reference, anything of another kind) leaves that frame
   out of the store; it compiles as usual.
3. **Offered where Dynamo would trace, under the same compile.** A loaded entry's variants are not installed on the
   code when a function is wrapped (torch would run them under any wrapper's backend): each is an offer
   (:mod:`.offers`), taken where Dynamo is about to trace a frame of that code, only under the compile context it
   was stored with (:mod:`.context`: backend, mode, ``fullgraph``, compile settings).
4. **Per frame, fail open.** Whatever fails while storing or loading one frame (an unpicklable object, a class in
   local scope, a missing or run-time generated module, a source change, torch's own errors) costs that frame only:
   it is traced exactly as without the option, and counted.

The counters (``counters["dynamo_reuse"]`` in torch's own counter table, so xdist workers and the report carry them
like torch's) say what was reused, traced, stored and refused, and why.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from typing import Any

from . import repairs
from .backends import (
    backends_recorded_once,
    backends_recorded_where_written,
    eager_graphs_stored,
    postponed,
    wrapped_after_backend,
)
from .context import innermost_backend
from .effects import Trace, bookkeeping_quiet, code_key, effects_of, watch_warnings
from .ledger import LEDGER, cost_seconds, cost_spans, offered_seconds, spared_seconds
from .merge import enterable_codes, entry_signature, loaded_if_same_code, merged_copies, packages_merged
from .merge import unchanged_since_installed as unchanged
from .objects import importable, missing_module
from .offers import NEW, NO_BUILTINS, UNSTABLE, Offer, Offers, guards_of, offer_where_traced
from .patches import PATCHES
from .proof_globals import prove_installed, recreated_globals
from .proofs import (
    Refused,
    Stored,
    guards_digest,
    pack_guards,
    prove,
    prove_class,
    reason_of,
    source_id,
    tag_of_test,
    unpack_guards,
)
from .releases import CHECKED_RELEASES, MERGED_RELEASES, final_release, release_checked
from .shapes import watch_shapes

__all__ = ["CHECKED_RELEASES", "COUNTERS", "MERGED_RELEASES", "before_first_load", "cost_seconds", "cost_spans",
           "final_release", "install", "merged_copies", "offered_seconds", "refusal_reasons", "release_checked",
           "set_test", "spared_seconds", "uninstall", "used_entries"]

# Identity guards kept and proven (torch 2.13 refuses to serialize them, or drops them from the live guards).
PROVABLE_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "MODULE_MATCH", "CLASS_MATCH",
                             "BUILTIN_MATCH"})
# Guards on run-time state that no stored proof can stand for: a frame holding one is never stored.
UNPROVABLE_GUARDS = ("DICT_VERSION", "NN_MODULE", "WEAKREF_ALIVE")
COUNTER_GROUP = "dynamo_reuse"
REFUSALS = ("code_changed", "collision", "unsupported_guard", "unsupported_backend", "unpicklable", "global_changed",
            "local_changed", "class_changed", "context_changed", "missing_module", "side_effect", "torch_error",
            "load_failed", "no_backend", "shapes_seen")
COUNTERS = ("dynamo_reused", "dynamo_frames_reused", "dynamo_traced", "dynamo_stored",
            *(f"dynamo_refused_{r}" for r in REFUSALS))


# --- the wrappers over torch's pieces ---------------------------------------------------------------------------
class _Reuse:
    """The state of the wrappers in this process (one per process: torch's state is process-wide)."""

    def __init__(self, rootdir: str, any_backend: bool = True) -> None:
        self.rootdir = rootdir
        self.any_backend = any_backend  # else only torch's own backends' frames are stored and taken (context)
        # per placeholder of a guard state: what was stored, its digest, the placeholder (held, so that its id is not
        # reused before torch's install hands it back)
        self.pending: dict[int, tuple[Stored, str, Any]] = {}
        self.installing: Any = None  # the CompilePackage being installed
        self.before_load: Any = lambda: None  # the session's: the restore loaded into torch (see before_first_load)
        self.traces: dict[str, Trace] = {}  # per compile (id) tracing a frame: what it did besides its output
        self.frame_code: Any = None  # the code of the frame whose guards are being built
        # Frames (file, first line, name) of which a trace showed a warning that cannot be shown again: no entry
        # holding one is written, though another variant of it was traced without (under other warning filters, say).
        self.side_effects: set[tuple[str, int, str]] = set()
        # key -> per package recorded under it in this process (merge._serial), the variants it traced that the
        # stored entry lacks (merge._new_only)
        self.recorded: dict[str, dict[int, Any]] = {}
        self.reasons: dict[str, str] = {}
        self.offers = Offers()
        # key -> the stored entry installed in this process; the stored variants whose proofs failed here (digests)
        self.loaded: dict[str, Any] = {}
        self.loaded_as: dict[str, Any] = {}  # per key, what the stored entry held when installed (entry_signature)
        self.stale: set[str] = set()
        self.contexts: list[str | None] = []  # the compile contexts of the frames being traced (innermost last)
        # id(code) -> code, function, stored entry, backends, the module missing when the function was wrapped
        self.deferred: dict[int, tuple[Any, Any, Any, Any, str]] = {}
        self.waiting: dict[tuple[str, int, str], str] = {}  # each code of a deferred entry: the module it waits for
        self.install_deferred: Any = lambda code: None
        self.used: dict[str, None] = {}  # the keys of the stored entries installed in this process, in order
        self.test = ""  # the tag of the test running (proofs.tag_of_test), stored with what it traces
        # Stored variants (digests) taken in this process; and the variants traced in place of a variant of their
        # own test passed over two runs running (offers.superseded): not written.
        self.taken: set[str] = set()
        self.superseded: set[str] = set()
        self.retraced = NEW  # what the frame being traced is to its own test's stored variants (offers.superseded)

    def count(self, name: str, n: int = 1) -> None:
        try:
            from torch._dynamo.utils import counters

            counters[COUNTER_GROUP][name] += n
        except Exception:  # noqa: BLE001 - counting never fails a compile
            pass

    def refuse(self, reason: str, detail: str) -> None:
        """Count a refusal; keep its first detail, redacted before it is cut (a cut secret is not recognised)."""
        self.count(f"dynamo_refused_{reason}")
        if reason not in self.reasons:
            from ..errors import redact_cut  # light: no torch

            self.reasons[reason] = redact_cut(detail, 200)

    def refuse_error(self, exc: BaseException) -> None:
        self.refuse(reason_of(exc), f"{type(exc).__name__}: {exc}")

    def waiting_for(self, code: Any, scope: dict[str, Any]) -> bool:
        """Whether a stored entry holding ``code`` (of the module of ``scope``) waits for a module not there yet: a
        frame of it is traced so in every run (the library makes the module later), and what it traces is what the
        entry holds but for addresses in torch's guard state; written, the entry grew at every run."""
        missing = self.waiting.get((str(scope.get("__name__")), int(code.co_firstlineno), str(code.co_name)))
        return missing is not None and not importable(missing)


_STATE: _Reuse | None = None


def install(rootdir: str, any_backend: bool = True) -> str | None:
    """Turn on torch's caching precompile behind the wrappers above; None when done, else why not (then torch's
    configuration is left as it was). Unless ``any_backend``, only the frames of torch's own backends are stored and
    taken (:func:`.context.torch_own`)."""
    global _STATE
    try:
        import torch

        version = str(torch.__version__)
        if not release_checked(version):
            return (f"Dynamo reuse is checked on torch {', '.join(CHECKED_RELEASES)} only, and this torch is "
                    f"{version.split('+')[0]}")
        import torch._dynamo.bytecode_transformation as bytecode_transformation
        import torch._dynamo.config as dynamo_config
        import torch._dynamo.guards as guards
        import torch._dynamo.package as package
        import torch._dynamo.pgo as pgo
        import torch._dynamo.precompile_context as precompile_context
    except Exception as exc:  # noqa: BLE001
        return f"torch's caching precompile did not import: {type(exc).__name__}: {exc}"
    if _STATE is not None:
        _STATE.any_backend = any_backend
        dynamo_config.caching_precompile = True
        return None
    missing = [name for owner, name in (
        (package, "CompilePackage"), (package, "DynamoCache"), (package, "load_guards_state"),
        (package, "load_guard_manager"), (guards, "CheckFunctionManager"), (bytecode_transformation,
                                                                             "_unique_id_counter"),
        (precompile_context, "PrecompileContext")) if not hasattr(owner, name)]
    if missing or not hasattr(guards.CheckFunctionManager, "serialize_guards"):
        return f"this torch's caching precompile has another form (no {', '.join(missing) or 'serialize_guards'})"
    state = _Reuse(rootdir, any_backend)
    _wrap(state, torch, package, guards, bytecode_transformation, pgo)
    dynamo_config.caching_precompile = True
    _STATE = state
    bookkeeping_quiet()
    return None


def _wrap(state: _Reuse, torch: Any, package: Any, guards: Any, bytecode_transformation: Any, pgo: Any) -> None:
    replace = PATCHES.replace
    CompilePackage = package.CompilePackage
    CheckFunctionManager = guards.CheckFunctionManager
    cache = package.DynamoCache
    config = torch._dynamo.config

    # 1. Keys are the code.
    innermost_fn = torch._dynamo.eval_frame.innermost_fn
    replace(CompilePackage, "source_id_from_fn", staticmethod(lambda fn: source_id(innermost_fn(fn), state.rootdir)),
            "an entry's key is a digest of the function's module, path and code, not its qualname and first line")

    # 2. Guards stay whole: the live guard manager is built as without caching precompile (torch drops identity
    # guards from it when the flag is on); what is stored carries proofs for the identity guards.
    init = CheckFunctionManager.__init__
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

    replace(CheckFunctionManager, "__init__", __init__,
            "the live guards built as without caching precompile, which drops identity guards from them")
    replace(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", UNPROVABLE_GUARDS,
            "identity guards are stored with proofs; guards on run-time state keep the frame out of the store")
    serialize = CheckFunctionManager.serialize_guards

    compile_id, counters = torch._guards.CompileContext.current_compile_id, torch._dynamo.utils.counters
    watch_warnings(state, compile_id, getattr(torch._dynamo.output_graph, "OutputGraph", None))
    watch_shapes(state, compile_id, pgo)
    eager_graphs_stored(getattr(torch._dynamo.output_graph, "OutputGraph", None), package, innermost_backend)
    stored_backends = backends_recorded_once(package.DynamoCache)

    @functools.wraps(serialize)
    def serialize_guards(self: Any, builder: Any, sorted_guards: list[Any], output_graph: Any) -> bytes:
        context = state.contexts[-1] if state.contexts else None
        if context is None or wrapped_after_backend(output_graph):
            # a backend of the test's own (or a compile the wrappers did not see start): no later wrapper could be
            # told apart from it; graphs torch dispatches between, but installs one of (backends)
            why = ("shape specializations" if context else "a backend that cannot be named in another process"
                   if state.any_backend else "a backend that is not torch's own, or cannot be named in another process")
            state.refuse("unsupported_backend", why)
            raise torch._dynamo.exc.PackageError(why)
        # what the trace did that a test can see, done again where the variant is taken (effects): a warning shown
        # that cannot be shown again (its class defined in a function, say) leaves the frame traced in every run
        if (effects := effects_of(trace := state.traces.get(str(compile_id())), counters)) is None:
            why = ("a warning that cannot be shown again was shown while the frame was traced" if trace is None
                   or trace.shown is None else "the trace noted a shape that cannot be noted again")
            state.refuse("side_effect", why)
            state.side_effects.add(code_key(state.frame_code))
            raise torch._dynamo.exc.PackageError(why)
        proofs = []
        classes: dict[int, tuple[str, type]] = {}
        builtins_name = getattr(output_graph, "name_of_builtins_dict_key_in_fglobals", None)
        try:
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
                        # torch stores only the builtins its BUILTIN_MATCH guards name; a proven identity guard
                        # on a builtin needs it in the stored scope too, where the guard is rebuilt on load
                        self.used_builtin_vars.add(steps[1][1])
            proofs.extend(proof for name, cls in classes.values() if (proof := prove_class(name, cls)))
            proofs.extend(prove_installed(getattr(output_graph, "installed_globals", ()),
                                          recreated_globals(output_graph, builtins_name), proofs, scope))
        except Refused as exc:
            state.refuse(exc.reason, str(exc))
            raise torch._dynamo.exc.PackageError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a proof that cannot be built: this frame is not stored
            state.refuse("unsupported_guard", f"{type(exc).__name__}: {exc}")
            raise torch._dynamo.exc.PackageError(f"{type(exc).__name__}: {exc}") from None
        try:
            data = serialize(self, builder, sorted_guards, output_graph)
        except torch._dynamo.exc.PackageError as exc:
            state.refuse(reason_of(exc.__cause__) if exc.__cause__ else "unsupported_guard", str(exc))
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. TypeError for the type of a local defined in local scope
            # torch raises these past its own bypass, which would fail the test: this frame is not stored instead
            reason = "unsupported_guard" if isinstance(exc, TypeError) else reason_of(exc)
            state.refuse(reason, f"{type(exc).__name__}: {exc}")
            raise torch._dynamo.exc.PackageError(f"{type(exc).__name__}: {exc}") from None
        state.count("dynamo_stored")
        seconds = time.perf_counter() - trace.started if trace is not None else None  # the guards are built last
        packed = pack_guards(proofs, context, data, state.test, state.retraced != NEW, effects, seconds)
        if state.retraced == UNSTABLE:
            state.superseded.add(guards_digest(packed))
        return packed

    replace(CheckFunctionManager, "serialize_guards", serialize_guards,
            "identity guards stored with their proofs; a frame that cannot be stored is left out, never failed")

    load_guards_state = package.load_guards_state
    guards_state_class = guards.GuardsState

    def load_guards_state_proven(data: bytes) -> Any:
        # torch's install unpickles every variant's guards here, and builds them next: both are left to the offer
        # (a variant of another compile, or of a frame never called, is never unpickled), whose placeholder tells
        # torch's install that no builtins dict is to be put in place yet (the offer does it, as torch does)
        stored = unpack_guards(data)
        placeholder = guards_state_class.__new__(guards_state_class)
        object.__setattr__(placeholder, "output_graph", NO_BUILTINS)
        state.pending[id(placeholder)] = (stored, guards_digest(data), placeholder)
        return placeholder

    replace(package, "load_guards_state", load_guards_state_proven,
            "a variant's guard state unpickled where it is offered, not when its entry is installed")
    load_guard_manager = package.load_guard_manager

    def load_guard_manager_deferred(guards_state: Any, target_code: Any, runtime_global_scope: Any) -> Any:
        # torch's install builds every variant's guards here and installs them on the code next: each is kept as an
        # offer instead, its guards built where Dynamo is about to trace a frame of that code (_compile below)
        pending = state.pending.pop(id(guards_state), None)
        if pending is None:
            raise Refused("unsupported_guard", "guards loaded without the plugin's proofs")
        stored, digest, _ = pending
        return Offer(target_code, None, stored.guards_state, runtime_global_scope, stored.proofs, stored.context,
                     state.installing, digest, stored.origin, stored.effects, stored.seconds)

    replace(package, "load_guard_manager", load_guard_manager_deferred,
            "each stored variant kept as an offer, its guards built where Dynamo is about to trace its code")
    eval_frame_c = torch._C._dynamo.eval_frame
    load_precompile_entry = eval_frame_c._load_precompile_entry

    def load_offer(code: Any, guard_manager: Any, dynamo_code: Any) -> Any:
        if not isinstance(guard_manager, Offer):
            return load_precompile_entry(code, guard_manager, dynamo_code)
        guard_manager.dynamo_code = dynamo_code
        state.offers.add(guard_manager)
        return None

    replace(eval_frame_c, "_load_precompile_entry", load_offer,
            "offers kept beside the code instead of installed on it, under any wrapper's backend")
    uninstall = CompilePackage.uninstall

    @functools.wraps(uninstall)
    def uninstall_offers(self: Any) -> None:
        state.offers.drop_package(self)
        uninstall(self)

    replace(CompilePackage, "uninstall", uninstall_offers, "an uninstalled package's offers go with its globals")
    from torch._dynamo.output_graph import get_builtins_dict

    offer_where_traced(state, torch, functools.partial(guards_of, load_guards_state, get_builtins_dict,
                                                       bytecode_transformation), load_guard_manager)

    # 3. Per frame, fail open. Loading: the stored main code must be the current code.
    load = cache.load

    def checked_load(fn: Any) -> Any:
        before, state.before_load = state.before_load, lambda: None  # once
        before()
        with LEDGER.spending():
            return loaded_if_same_code(state, fn, load, innermost_fn)

    replace(cache, "load", checked_load, "a stored entry is taken only for the code it was traced from")

    initialize = CompilePackage.initialize

    @functools.wraps(initialize)
    def initialize_or_fresh(self: Any, fn: Any, dynamo: Any = None, ignore_inlined_sources: bool = False) -> None:
        if dynamo is None:
            initialize(self, fn, None, ignore_inlined_sources)
            return None
        try:
            with LEDGER.spending():  # torch checks the inlined sources of the stored entry here
                initialize(self, fn, dynamo, ignore_inlined_sources)
            self._megacache_loaded = dynamo
            return None
        except Exception as exc:  # noqa: BLE001 - inlined sources changed, a module gone: trace as usual
            if (missing := missing_module(exc)) is not None:
                self._megacache_deferred = (fn, dynamo, missing)  # installed where its frame runs, if it appears
            else:
                state.refuse_error(exc)
            _fresh(self, fn, initialize)
            self._megacache_fresh = True  # torch installs the loaded backends next: nothing is to be installed
            return None

    replace(CompilePackage, "initialize", initialize_or_fresh,
            "an entry whose inlined sources changed, or whose modules are not there yet, leaves its frames traced")

    install_package = CompilePackage.install

    @functools.wraps(install_package)
    def install_or_fresh(self: Any, backends: Any) -> None:
        with LEDGER.spending():
            _install(self, postponed(backends))

    def _install(self: Any, backends: Any) -> None:
        loaded = self.__dict__.pop("_megacache_loaded", None)
        if self.__dict__.pop("_megacache_fresh", False):
            if (deferred := self.__dict__.pop("_megacache_deferred", None)) is not None:
                fn, dynamo, missing = deferred
                _defer(state, self, fn, dynamo, missing, backends)
            return
        modules = [sys.modules.get(entry.python_module) for entry in list(self._codes.values())]
        eval_frame = torch._dynamo.eval_frame
        skip_code = eval_frame.skip_code
        # torch marks the code of a stored entry without compiled variants as never to be compiled (meant for frames
        # whose graph was empty): such a frame, a resume function never reached when it was traced say, would then
        # run eagerly where a run without the option compiles it. Dynamo traces it as usual instead.
        eval_frame.skip_code = _no_skip
        state.installing = self
        try:
            install_package(self, backends)
        except Exception as exc:  # noqa: BLE001 - any failure: nothing of the entry stays, the frame is traced
            fn = self._innermost_fn
            if (missing := missing_module(exc)) is not None and loaded is not None:
                _defer(state, self, fn, loaded, missing, backends)  # an import source not there yet
            else:
                state.refuse_error(exc)
            try:
                self.uninstall()
            finally:
                _fresh(self, fn, initialize)
                repairs.numbering_past(bytecode_transformation, modules)
            return
        finally:
            eval_frame.skip_code = skip_code
            state.installing = None
        state.count("dynamo_reused")
        if loaded is not None:
            state.loaded[self.source_id] = loaded  # what the store held: merged into what this process stores
            if self.source_id not in state.loaded_as:  # once per key (every wrapper of the function installs it)
                # as it is now: the package records the variants this process traces into the same code entries
                state.loaded_as[self.source_id] = entry_signature(loaded)
        repairs.numbering_past(bytecode_transformation, modules)
        state.used.setdefault(self.source_id)

    replace(CompilePackage, "install", install_or_fresh, "an entry that fails to install leaves nothing behind; its "
            "compiled graphs deserialized where first needed; what was installed noted for writing")

    def install_deferred(code: Any) -> None:
        """The stored entry of a function whose modules were missing when it was wrapped, installed where a frame of
        its code is about to be traced, once they are there (a module a library generates when it is first used)."""
        deferred = state.deferred.get(id(code))
        if deferred is None or deferred[0] is not code:
            return
        _, fn, dynamo, backends, missing = deferred
        if not importable(missing):
            state.refuse("missing_module", f"{missing} is not there")  # once per frame traced
            return
        del state.deferred[id(code)]
        # may defer it again (another module missing) or refuse it, as when wrapped; its offers hold the package
        CompilePackage(fn, dynamo).install(backends)

    state.install_deferred = install_deferred

    # AOTAutograd's cache under caching precompile: torch 2.13 puts the compiled function's per-process name
    # (``__compiled_fn_<n>_<uuid>``) into the entry's key, so no entry ever hits, in the run that stored it or a
    # later one, and every traced frame pays AOTAutograd in full. The key is computed as 2.12 computes it, without
    # that name: torch stores the entry without it and names the hit after the current frame's function.
    repairs.key_without_backend_id()
    # torch records, for every function a trace inlined, its source lines' checksum and its module's content, read
    # again from the file at each trace (5 of the 8 seconds that caching precompile added to a cold run of 240
    # tests): what it records of one code object is kept for the process.
    repairs.inlined_sources_once(package)
    repairs.inlined_sources_shared(cache)  # and a stored entry's texts of modules, held once per process
    # With caching precompile torch bundles every AOTAutograd entry with its compiled code, and asserts when a
    # graph's code is not Inductor's output (seen on an H100 training step: "expected OutputCode, got method"), which
    # fails the test. Such a graph gets no entry (as without the option, where it has no FX-graph key to store);
    # its frame has no stored backend then, and is traced in a later run.
    repairs.bundling_fails_open(state)
    # torch 2.11 stores guards on a function's default values in a form it cannot load again.
    repairs.sources_unpickle(torch)
    # torch writes none of a code's variants where one lacks its compiled graph's backend: the others are written.
    repairs.backendless_variants_dropped(package, state)
    # torch writes no entry whose output code makes a function (its module's globals are a constant there).
    repairs.module_globals_by_name(package)
    # Last: an entry as installed is not made up for writing; another first gets the stored backends it calls.
    backends_recorded_where_written(package, stored_backends, functools.partial(unchanged, state))

    # Saving: every wrapper of one function is one entry. torch keeps the last package recorded under a key (a
    # function's source id), so where a suite wraps one function in torch.compile more than once (a test per
    # parameter, a fresh wrapper per test) the variants the earlier wrappers traced would be lost. Only on the
    # releases it was run on (MERGED_RELEASES; on 2.13 an entry whose backend is missing is not written at all:
    # torch raises while saving it).
    if release_checked(str(torch.__version__), MERGED_RELEASES):
        packages_merged(state, cache)

    # Saving: one entry that does not pickle costs that entry only.
    write = cache.write

    def write_each(entry: Any, path: str) -> None:
        try:
            codes = entry.dynamo.codes
            if state.side_effects and any(code_key(code.python_code) in state.side_effects for code in codes):
                return
            if not any(code.guarded_codes for code in enterable_codes(codes)):
                return  # no variant a later process could take (every one refused here): its backends alone
            # (an entry as it was installed never comes here: backends_recorded_where_written)
            write(repairs.module_texts_left_out(entry), path)
        except Exception as exc:  # noqa: BLE001
            state.refuse("unpicklable", f"{type(exc).__name__}: {exc}")

    replace(cache, "write", write_each, "one entry that does not pickle costs that entry only")


def _defer(state: _Reuse, package: Any, fn: Any, dynamo: Any, missing: str, backends: Any) -> None:
    code = getattr(package._innermost_fn, "__code__", None)
    if code is None:
        state.refuse("missing_module", f"{missing} is not there")
        return
    state.deferred[id(code)] = (code, fn, dynamo, backends, missing)
    for entry in getattr(dynamo, "codes", ()):
        state.waiting[(str(entry.python_module), int(entry.python_code.co_firstlineno), entry.python_code.co_name)] = missing


def _no_skip(*_args: Any, **_kwargs: Any) -> None:
    return None


def _fresh(pkg: Any, fn: Any, initialize: Any) -> None:
    """A CompilePackage back to a fresh one for ``fn``, in place (torch holds it), as if nothing had been loaded;
    ``initialize`` is torch's own CompilePackage.initialize."""
    pkg._initialized = False
    pkg._codes = {}
    pkg._current_entry = None
    pkg._installed_globals = {}
    pkg._resume_codes = set()
    pkg.__dict__.pop("source_id", None)
    initialize(pkg, fn, None, False)


def uninstall() -> int:
    """Every patch of torch removed, the last first (:mod:`.patches`: torch's functions are torch's own again) and
    caching precompile off; how many patches there were. :func:`install` may put them in place again."""
    global _STATE
    removed = PATCHES.remove_all()
    if _STATE is not None:
        import torch._dynamo.config as dynamo_config

        dynamo_config.caching_precompile = False
        _STATE = None
    return removed


def before_first_load(callback: Any) -> bool:
    """``callback`` (the session's restore, waited for and loaded into torch, once) runs where torch first looks a
    stored entry up (a ``torch.compile()`` wrapping a function), not sooner: the restore runs meanwhile, beside the
    session's imports and collection. False where reuse is not installed."""
    if _STATE is None:
        return False
    _STATE.before_load = callback
    return True


def set_test(nodeid: str | None) -> None:
    """The test now running in this process (None: none), whose tag the variants traced in it keep."""
    if _STATE is not None:
        _STATE.test = tag_of_test(nodeid) if nodeid else ""


def used_entries() -> list[str]:
    """The keys of the stored entries installed in this process, in the order first installed: what the report
    counts as used (torch records no artifact for an install; recording the entry's bytes for it made torch serialize
    every installed entry again at the session's end, 158 MB on a suite of 240 tests)."""
    return list(_STATE.used) if _STATE is not None else []


def refusal_reasons() -> dict[str, str]:
    """The first detail seen per refusal reason in this process."""
    return dict(_STATE.reasons) if _STATE is not None else {}

