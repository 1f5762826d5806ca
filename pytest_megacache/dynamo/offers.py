"""Stored compiled variants offered where Dynamo is about to trace, instead of installed when a function is wrapped.

torch installs every variant of a loaded entry on the function's code when ``torch.compile()`` wraps it: it builds
every variant's guards up front, and checks them before the wrapper's own cache without looking at the wrapper's
backend, so a wrapper with another backend or mode would run a variant another one compiled. Here torch's install
still puts the entry's globals in place (its compiled graphs, resume functions, imports), but each variant is kept
as an :class:`Offer` on its code object. Where Dynamo is about to trace a frame of that code (torch's ``_compile``,
after a cache miss, under the recompile limit), the offers compiled under the same context
(:mod:`~pytest_megacache.dynamo.context`) are tried in turn: proofs checked against the objects of the moment, guards
built and evaluated on the frame's locals; the first that holds is returned to Dynamo as if it had been traced, and
Dynamo caches it under the calling wrapper's backend as it caches its own. A reset of Dynamo's caches leaves the
offers: the next call takes one again where torch would trace the same frame again.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from .backends import calls_graphs, made_ready
from .context import compile_context, explain_recorder, innermost_backend
from .effects import NO_EFFECTS, Effects, Trace, count_again, shown_again
from .ledger import LEDGER
from .objects import Refused
from .patches import PATCHES
from .proofs import check_proofs, guards_digest, unpack_guards
from .repairs import guards_state_loaded, numbering_past_name
from .shapes import fits, note_again, notes_of

# Refusals that any later process would make too, so the variant is not stored again from this one (unless it was
# taken in this process too: a class one test rebound): a class's definition is read from its source. A global or a
# local that names another object depends on the process (a test's monkeypatch, the order in which a library fills a
# registry, the function a shared decorator's wrapper was called with): such a variant is kept for the processes
# where it holds.
PERSISTENT_REFUSALS = ("class_changed",)


class Prepared:
    """What one stored variant took to make ready in this process, shared by every install of it: each new
    ``torch.compile()`` wrapper of a function installs its entry again (a test suite makes one per test), and the
    variant's guard state, unpickled once, and guards built that failed on the frames seen so far serve them all.
    Guards that held were handed to Dynamo and are built again where the variant is offered next."""

    __slots__ = ("code", "guards_state", "manager", "scope")

    def __init__(self, code: Any, scope: dict[str, Any]) -> None:
        self.code, self.scope = code, scope  # held: the ids that key it are not reused
        self.guards_state: Any = None  # torch's guard state, unpickled from the variant's stored bytes
        self.manager: Any = None  # guards built and not handed to Dynamo yet (they fail on the frames seen so far)


class Offer:
    """One stored compiled variant of one code object, from the package whose install put its globals in place."""

    __slots__ = ("code", "context", "digest", "dynamo_code", "effects", "failed", "origin", "package", "prepared",
                 "proofs", "scope", "seconds", "stored", "traced")

    def __init__(self, code: Any, dynamo_code: Any, stored: bytes, scope: dict[str, Any],
                 proofs: list[dict[str, Any]], context: str, package: Any, digest: str,
                 origin: tuple[str, bool] = ("", False), effects: Effects = NO_EFFECTS, seconds: float = 0.0,
                 traced: float = 0.0) -> None:
        self.code, self.dynamo_code, self.stored, self.scope = code, dynamo_code, stored, scope
        self.proofs, self.context, self.package = proofs, context, package
        self.origin = origin  # the tag of the test it was traced in, and whether it replaced one passed over there
        self.effects = effects  # what its trace did that a test can see, done again where it is taken
        self.seconds = seconds  # what its trace and compile took where it was traced: spared where it is taken
        self.traced = traced  # of those, what its backend's compile did not take: spared against a run without reuse
        self.digest = digest  # of the variant's stored guards (proofs, context and torch's guard state): the variant
        self.failed: Exception | None = None  # why torch could not load it (not tried again)
        self.prepared = Prepared(code, scope)


class Offers:
    """The offers of this process, per code object (its id; the offer holds the code, so the id is not reused)."""

    def __init__(self) -> None:
        self.by_code: dict[int, dict[str, Offer]] = {}
        self.prepared: dict[tuple[int, str, int], Prepared] = {}  # per code, variant and module: outlives installs

    def add(self, offer: Offer) -> None:
        # the same stored variant installed again by another wrapper of the function: the latest install's globals
        # are those in the module now; what was made ready for the variant in its module serves again
        # (a Prepared holds its code and module, so the ids that key it are not reused)
        offer.prepared = self.prepared.setdefault((id(offer.code), offer.digest, id(offer.scope)), offer.prepared)
        self.by_code.setdefault(id(offer.code), {})[offer.digest] = offer

    def drop_package(self, package: Any) -> None:
        """A package uninstalled: its globals are gone, and so are its offers."""
        for code_id in list(self.by_code):
            offers = self.by_code[code_id]
            for key in [k for k, o in offers.items() if o.package is package]:
                del offers[key]
            if not offers:
                del self.by_code[code_id]

    def of(self, code: Any) -> list[Offer]:
        return [o for o in reversed(self.by_code.get(id(code), {}).values()) if o.code is code]

    def __len__(self) -> int:
        return sum(len(offers) for offers in self.by_code.values())


def note_stale(stale: set[str], offer: Offer, refused: Refused) -> None:
    """An offer refused for a reason any later process would give too is not stored again from this one."""
    if refused.reason in PERSISTENT_REFUSALS:
        stale.add(offer.digest)


# What a frame about to be traced is to its own test's stored variants (:func:`superseded`): a new variant; one
# traced in place of a variant of that test passed over the first time (stored marked so); or one of a frame that its
# own test passes over run after run (what it traces is not written).
NEW, REPLACES, UNSTABLE = 0, 1, 2


def superseded(passed_over: list[Offer], test: str) -> int:
    """For a frame about to be traced in ``test`` (a tag) after the stored variants ``passed_over`` were refused by a
    proof, failed to load or failed their guards: :data:`REPLACES` where one of them is a variant of that very test
    (what it traces is stored marked so: ``retraced``), :data:`UNSTABLE` where such a variant was itself so marked
    (passed over two runs running), else :data:`NEW`. A variant that does not hold in the test that traced it holds in
    no later run where what it guards on is made anew each time (a decorator instance's scratch state, a registry's
    order, a function copied by torch's pickle): each such run would store one more variant never used, or replace
    one, and the store would change at every run. So the first time the variant passed over stays beside what is
    traced (a run with another binding of the moment, a test's ``monkeypatch`` in one job and not in another, may take
    either), and from the second time on what is stored stays as it is and what is traced is not written."""
    own = [offer for offer in passed_over if test and offer.origin[0] == test]
    if any(offer.origin[1] for offer in own):
        return UNSTABLE
    return REPLACES if own else NEW


def _fits_always(_offer: Offer) -> bool:
    return True


def _fits(fits: Callable[[Offer], bool], offer: Offer) -> bool:
    try:
        return fits(offer)
    except Exception:  # noqa: BLE001 - a record that cannot be compared does not fit
        return False


def take(offers: list[Offer], context: str | None, f_locals: dict[str, Any], build: Callable[[Offer], Any],
         passed_over: list[Offer] | None = None, fits: Callable[[Offer], bool] = _fits_always,
         ) -> tuple[tuple[Offer, Any] | None, tuple[str, str] | None]:
    """The first offer compiled under ``context`` whose proofs hold now, whose guards pass on ``f_locals`` and that
    ``fits`` (torch's record of the shapes the frame's inputs had is what it was where the offer was traced:
    :func:`.shapes.fits`), with its guards (built by ``build``, which raises :class:`Refused` for a proof that
    fails); else None and why the frame could not take one: a proof that failed or a record of shapes that differs
    (the first seen), else another compile context; None where the guards of every offer of this context merely fail
    on these inputs (the frame is a new variant, traced as torch would). The offers of this context that a proof
    refused, that torch failed to load or whose guards failed are added to ``passed_over``."""
    passed_over = [] if passed_over is None else passed_over
    refusal: tuple[str, str] | None = None
    this_context = other_context = False
    for offer in offers:
        if offer.context != context:
            other_context = True
            continue
        this_context = True
        try:
            manager = build(offer)
        except Refused as exc:
            refusal = (exc.reason, str(exc))
            passed_over.append(offer)
            continue
        except Exception as exc:  # noqa: BLE001 - torch's own failure to build the guards: the frame is traced
            refusal = ("torch_error", f"{type(exc).__name__}: {exc}")
            passed_over.append(offer)
            continue
        try:
            holds = bool(manager.check(f_locals))
        except Exception:  # noqa: BLE001 - a guard that raises on these locals does not hold
            holds = False
        if holds and not _fits(fits, offer):
            # Dynamo would trace another variant than this one here (it holds but is not what torch would make now)
            offer.prepared.manager = manager
            refusal = refusal or ("shapes_seen", "torch's record of the shapes the frame's inputs had is not what it "
                                                 "was where the variant was traced")
            continue
        if holds:
            offer.prepared.manager = None  # handed to Dynamo: a cache entry owns it now
            return (offer, manager), None
        offer.prepared.manager = manager
        passed_over.append(offer)
    if refusal is None and other_context and not this_context:
        # only offers of other compiles; where one of this very compile exists, its guards decide, as torch's would
        refusal = ("context_changed", "compiled under another backend, mode or configuration")
    return None, refusal


def bind_global(package: Any, scope: dict[str, Any], name: str, value: Any) -> None:
    """A global of the tracing process put back into the module of an offer, as its package's own: uninstalling the
    package removes it."""
    module = sys.modules.get(str(scope.get("__name__")))
    if package is None or module is None or module.__dict__ is not scope:
        raise Refused("global_changed", f"{name} cannot be bound outside the module of its entry")
    package._install_global(module, name, value)


class _Torch(NamedTuple):
    """What of torch offering stored variants needs (``load_guards``: a variant's guard state unpickled in a module's
    globals; ``load_guard_manager``: torch's building of its guards)."""

    load_guards: Callable[[bytes, dict[str, Any]], Any]
    load_guard_manager: Callable[..., Any]
    exceeds: Any  # convert_frame.exceeds_recompile_limit, where it exists
    wrap: Any  # convert_frame.wrap_guarded_code
    guarded_code: Any  # torch._dynamo.types.GuardedCode
    timed: Any  # torch._dynamo.utils.dynamo_timed
    orig_code_map: Any
    output_codes: Any
    counters: Any
    pgo: Any
    config: Any  # torch._dynamo.config


def offer_where_traced(state: Any, torch: Any, load_guards: Callable[[bytes, dict[str, Any]], Any],
                       load_guard_manager: Callable[..., Any]) -> None:
    """torch's ``_compile`` (where Dynamo traces a frame that missed its cache) takes a stored variant first
    (:func:`_reused`), and records the compile context of each frame it traces for the variant stored from it
    (:func:`_traced`). ``load_guards`` unpickles a variant's stored guard state in a module's globals,
    ``load_guard_manager`` builds its guards (torch's own)."""
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.pgo as pgo

    compile_fn = convert_frame._compile
    signature = inspect.signature(compile_fn)
    own = _Torch(load_guards, load_guard_manager, getattr(convert_frame, "exceeds_recompile_limit", None),
                 getattr(convert_frame, "wrap_guarded_code", None), getattr(torch._dynamo.types, "GuardedCode", None),
                 torch._dynamo.utils.dynamo_timed, torch._dynamo.utils.orig_code_map, convert_frame.output_codes,
                 torch._dynamo.utils.counters, pgo, torch._dynamo.config)
    if "package" in signature.parameters:
        _code_context_named(torch)

    @functools.wraps(compile_fn)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        return _traced(state, own, compile_fn, signature, args, kwargs)

    PATCHES.replace(convert_frame, "_compile", _compile,
                    "a stored variant is taken where Dynamo is about to trace a frame of its code, under its compile")


def _traced(state: Any, own: _Torch, compile_fn: Any, signature: inspect.Signature, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """torch's ``_compile(*args, **kwargs)``, unless a stored variant is taken; the compile context and what the trace
    does that a test can see are noted for the variant stored from it."""
    context, outer, outer_frame = None, state.retraced, state.frame  # an enclosing compile's, put back at the end
    state.retraced = NEW  # set by _reused() for the frame traced next
    key = None
    try:
        with LEDGER.offering():
            bound = signature.bind(*args, **kwargs).arguments
            state.frame = bound["code"]
            key = str(bound["compile_id"])
            context = compile_context(bound["compiler_fn"], bound["one_graph"], bound["export"], state.any_backend)
            result = _reused(state, own, bound, context)
    except Exception as exc:  # noqa: BLE001 - any failure: the frame is traced as without the option
        state.refuse("torch_error", f"stored variants not offered: {type(exc).__name__}: {exc}")
        result = None
    if result is not None:
        state.retraced, state.frame = outer, outer_frame
        return result
    state.contexts.append(context)
    if key is not None and (trace := _trace(own.counters, bound["code"])) is not None:
        state.traces[key] = trace  # what the trace does that a test can see (effects)
    try:
        try:
            return compile_fn(*args, **kwargs)
        except _Unpackaged as exc:
            # torch could not record the frame's code in the wrapper's entry, before anything was traced: the frame is
            # compiled outside the entry, as without the option, and nothing of it is stored
            state.refuse("torch_error", f"torch cannot record the frame's code: {exc}")
            again = signature.bind(*args, **kwargs)
            again.arguments["package"] = None
            return compile_fn(*again.args, **again.kwargs)
        except Exception as exc:
            skipped(state, bound.get("code") if key is not None else None, exc)
            raise
    finally:
        state.contexts.pop()
        if key is not None:
            state.traces.pop(key, None)
        state.retraced, state.frame = outer, outer_frame


def skipped(state: Any, code: Any, exc: BaseException) -> None:
    """A frame Dynamo gives up on (a graph break it cannot resume from, inside a loop say) runs as Python runs it, and
    no variant of it is stored: it is traced again in every process. Where the frame was named already for its
    stored variants' refusal (another compile's only, say), that is said first (``skipped by torch``)."""
    try:
        from . import frame_label

        gives_up = any(cls.__module__ == "torch._dynamo.exc" and cls.__name__ in ("Unsupported", "SkipFrame")
                       for cls in type(exc).__mro__)
        if code is not None and gives_up and frame_label(code, state.rootdir) in state.frames:
            state.traced_for("skipped by torch", code)
    except Exception:  # noqa: BLE001 - naming never changes what torch does with the frame
        pass


def _build(state: Any, own: _Torch, offer: Offer) -> Any:
    """The guards of ``offer``, once its proofs hold (:class:`Refused` where one does not)."""
    if offer.failed is not None:
        raise offer.failed
    if offer.prepared.guards_state is None:
        try:
            with own.timed("precompile_load_guards"):
                offer.prepared.guards_state = own.load_guards(offer.stored, offer.scope)
        except Exception as exc:  # the variant is never offered again in this process
            offer.failed = exc
            raise
    try:
        check_proofs(offer.proofs, offer.scope, offer.prepared.guards_state.output_graph.local_scope,
                     functools.partial(bind_global, offer.package, offer.scope))
    except Refused as exc:
        note_stale(state.stale, offer, exc)
        raise
    if offer.prepared.manager is not None:
        return offer.prepared.manager
    return own.load_guard_manager(offer.prepared.guards_state, offer.code, offer.scope)


def _reused(state: Any, own: _Torch, args: dict[str, Any], context: str | None) -> Any:
    """What torch's ``_compile`` returns for a stored variant of the frame taken (:func:`take`), or None: the frame is
    traced, and what it is to its own test's stored variants noted (``state.retraced``)."""
    state.install_deferred(args["code"], context is not None)  # a frame of a backend never stored: not counted
    # traced while its stored entry waits for a module: what it traces is not written (the entry holds it)
    waiting = state.waiting_for(args["code"], args["globals"])
    offers = state.offers.of(args["code"])
    if not offers or args.get("export") or own.wrap is None or own.guarded_code is None:
        state.retraced = UNSTABLE if waiting else NEW
        state.traced_for("none stored")
        return None
    if own.exceeds is not None and own.exceeds(args["cache_size"], args["compile_id"])[0]:
        state.traced_for("cache size limit")
        return None  # torch says so, as without the option
    passed_over: list[Offer] = []
    code, closure = args["code"], args.get("closure")
    with own.timed("precompile_build_guards"):
        found, refusal = take(offers, context, args["locals"], functools.partial(_build, state, own), passed_over,
                              lambda offer: fits(offer.effects.shapes, code, closure, own.pgo))
    if found is None:
        if refusal is not None:
            state.refuse(*refusal)  # once per frame traced in place of a stored variant
        else:
            state.traced_for("no stored variant's guards held")
        state.retraced = UNSTABLE if waiting else superseded(passed_over, state.test)
        return None
    return _taken(state, own, *found, args)


def _taken(state: Any, own: _Torch, offer: Offer, manager: Any, args: dict[str, Any]) -> Any:
    """``offer``, whose guards (``manager``) hold, as torch's ``_compile`` returns a frame it traced: its compiled graphs
    made ready and what its trace did that a test can see done again; None (the frame is traced) where either fails."""
    code, closure, compile_id = args["code"], args.get("closure"), args["compile_id"]
    export_guards: Any = getattr(args.get("hooks"), "guard_export_fn", None)
    # torch hands a traced frame's guards to the compile's guard_export_fn (explain's record of them), unless its graph
    # was empty: the guards stored with the variant are handed so
    guards = offer.prepared.guards_state.output_graph.guards if export_guards and calls_graphs(offer.dynamo_code) else None
    recorder = innermost_backend(args["compiler_fn"])
    try:
        explained = made_ready(offer.dynamo_code, offer.scope)  # its compiled graphs, deserialized where first taken
        if explained and not explain_recorder(recorder):
            raise ValueError("a graph of explain's recorder taken outside an explanation")
    except Exception as exc:  # noqa: BLE001 - never offered again here; the frame is traced
        offer.failed = exc
        state.refuse("load_failed", f"a stored compiled graph did not load: {type(exc).__name__}: {exc}")
        return None
    try:
        # what the trace noted of its inputs' shapes, as torch's objects (noted again below)
        notes = notes_of(offer.effects.shapes, code, closure, own.pgo) if offer.effects.shapes else []
    except Exception as exc:  # noqa: BLE001
        state.refuse("side_effect", f"the shapes the trace saw not noted again: {type(exc).__name__}: {exc}")
        return None
    try:
        # what the trace showed, shown again where it would have been (before the frame runs); what the filters of the
        # moment make of a warning (-W error), or a warning's class gone: traced instead, and torch does it
        shown_again(offer.effects)
    except Exception as exc:  # noqa: BLE001
        state.refuse("side_effect", f"the warnings of the trace not shown again: {type(exc).__name__}: {exc}")
        return None
    for graph in explained:  # as the trace hands each graph to the explanation's recorder
        graph.handed(recorder)
    count_again(offer.effects, own.counters)  # what the trace added to torch's counters (a test may read them)
    # and to torch's record of the shapes each input had (automatic dynamic shapes): a later trace of the code marks
    # dynamic what differs, as where this frame was traced
    note_again(notes, own.pgo, own.config)
    if guards is not None:
        export_guards(guards)
    state.taken.add(offer.digest)
    LEDGER.spared += offer.seconds
    LEDGER.spared_tracing += offer.traced
    state.count("dynamo_frames_reused")
    # what torch notes of a frame it traced: its output code's origin (read where a later call of it recompiles) and
    # the code to reset with Dynamo's caches
    own.orig_code_map[offer.dynamo_code] = offer.code
    own.output_codes.add(offer.dynamo_code)
    return own.wrap(own.guarded_code(offer.dynamo_code, manager, compile_id, f"Torch-Compiled Region: {compile_id}"))


def _trace(counters: Any, code: Any) -> Trace | None:
    try:
        return Trace(counters, code)
    except Exception:  # noqa: BLE001 - no trace noted: the frame is not stored (effects_of)
        return None


NO_BUILTINS = type("NoBuiltinsYet", (), {"name_of_builtins_dict_key_in_fglobals": None})()


def guards_of(load_guards_state: Any, builtins_of: Any, bytecode_transformation: Any, stored: bytes,
               scope: dict[str, Any]) -> Any:
    """A variant's guard state unpickled by torch (``load_guards_state``), with the builtins dict its guards name put
    into the module's globals where it is missing, as torch's install does (``builtins_of``: torch's
    ``get_builtins_dict``)."""
    loaded = guards_state_loaded(load_guards_state, stored)
    name = getattr(loaded.output_graph, "name_of_builtins_dict_key_in_fglobals", None)
    if name:
        builtins_dict = builtins_of(scope)
        if scope.setdefault(name, builtins_dict) is not builtins_dict:
            raise Refused("global_changed", f"{name} is not the builtins dict")
        # numbered by the tracing process: a frame traced from now on must not pick the same name (torch asserts,
        # and the frame runs eagerly)
        numbering_past_name(bytecode_transformation, name)
    return loaded



def offers_kept(state: Any, torch: Any, package: Any, guards: Any, bytecode_transformation: Any) -> None:
    """torch's install of a stored entry puts its globals in place but keeps each variant as an :class:`Offer` (its
    guards unpickled and built where it is offered), and torch's ``_compile`` offers them
    (:func:`offer_where_traced`); an uninstalled package's offers go with it."""
    CompilePackage = package.CompilePackage
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

    PATCHES.replace(package, "load_guards_state", load_guards_state_proven,
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
                     state.installing, digest, stored.origin, stored.effects, stored.seconds, stored.traced)

    PATCHES.replace(package, "load_guard_manager", load_guard_manager_deferred,
                    "each stored variant kept as an offer, its guards built where Dynamo is about to trace its code")
    eval_frame_c = torch._C._dynamo.eval_frame
    load_precompile_entry = eval_frame_c._load_precompile_entry

    def load_offer(code: Any, guard_manager: Any, dynamo_code: Any) -> Any:
        if not isinstance(guard_manager, Offer):
            return load_precompile_entry(code, guard_manager, dynamo_code)
        guard_manager.dynamo_code = dynamo_code
        state.offers.add(guard_manager)
        return None

    PATCHES.replace(eval_frame_c, "_load_precompile_entry", load_offer,
                    "offers kept beside the code instead of installed on it, under any wrapper's backend")
    uninstall = CompilePackage.uninstall

    @functools.wraps(uninstall)
    def uninstall_offers(self: Any) -> None:
        state.offers.drop_package(self)
        uninstall(self)

    PATCHES.replace(CompilePackage, "uninstall", uninstall_offers, "an uninstalled package's offers go with its globals")
    from torch._dynamo.output_graph import get_builtins_dict

    offer_where_traced(state, torch, functools.partial(guards_of, load_guards_state, get_builtins_dict,
                                                       bytecode_transformation), load_guard_manager)


class _Unpackaged(Exception):
    """torch failed to record a frame's code in the entry of the wrapper that compiles it."""


class _Entered:
    """torch's ``code_context`` of a package, whose failure to enter (before the frame is traced) is told apart."""

    def __init__(self, context: Any, package_error: type[BaseException]) -> None:
        self.context, self.package_error = context, package_error

    def __enter__(self) -> Any:
        try:
            return self.context.__enter__()
        except self.package_error as exc:
            raise _Unpackaged(str(exc)) from exc

    def __exit__(self, *exc_info: Any) -> Any:
        return self.context.__exit__(*exc_info)


def _code_context_named(torch: Any) -> None:
    """torch's ``CompilePackage.code_context`` made to raise :class:`_Unpackaged` where torch cannot record the code
    it is entered for (a resume function compiled again under another wrapper than the one whose trace made it:
    torch looks its qualified name up in its module, fails, and raises ``PackageError``, which failed the test);
    nothing changed where torch has no such method."""
    package_class: Any = getattr(getattr(torch._dynamo, "package", None), "CompilePackage", None)
    code_context = getattr(package_class, "code_context", None)
    package_error = getattr(torch._dynamo.exc, "PackageError", None)
    if code_context is None or package_error is None:
        return

    @functools.wraps(code_context)
    def code_context_named(self: Any, code: Any) -> Any:
        return _Entered(code_context(self, code), package_error)

    PATCHES.replace(package_class, "code_context", code_context_named,
                    "a frame whose code torch cannot record in the wrapper's entry is compiled outside it, not failed")
