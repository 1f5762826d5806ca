"""Stored entries loaded and installed where ``torch.compile()`` wraps a function, failing open per frame
(:func:`installed_where_wrapped`): an entry is taken only for the code it was traced from; one whose inlined sources
changed, or that fails to install, leaves nothing behind and its frames are traced as without reuse; its variants
that need a module not there yet (a module a library generates when first used) are held back and installed where a
frame of its code is about to be traced, once it is (:func:`without_missing`), the others installed at once. Reuse's
own time here is counted (:mod:`.ledger`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, NamedTuple

from . import repairs
from .backends import postponed
from .ledger import LEDGER
from .merge import entry_signature, loaded_if_same_code
from .objects import importable, missing_module
from .patches import PATCHES
from .proofs import unpack_guards

__all__ = ["install_entry", "installed_where_wrapped", "traced_afresh", "with_own_lists", "without_missing"]


class _Own(NamedTuple):
    """torch's own pieces an install goes through."""

    install: Any  # CompilePackage.install
    initialize: Any  # CompilePackage.initialize
    eval_frame: Any  # torch._dynamo.eval_frame
    bytecode_transformation: Any  # torch._dynamo.bytecode_transformation


def installed_where_wrapped(state: Any, torch: Any, package: Any, bytecode_transformation: Any) -> None:
    """torch's ``DynamoCache.load`` and ``CompilePackage.initialize`` / ``install`` wrapped (see above); ``state``:
    the process's reuse state, whose ``install_deferred`` an offer calls for a code about to be traced."""
    package_class, cache = package.CompilePackage, package.DynamoCache
    innermost_fn, load = torch._dynamo.eval_frame.innermost_fn, cache.load
    own = _Own(package_class.install, package_class.initialize, torch._dynamo.eval_frame, bytecode_transformation)

    def checked_load(fn: Any) -> Any:
        before, state.before_load = state.before_load, lambda: None  # once
        before()
        with LEDGER.spending():
            return loaded_if_same_code(state, fn, load, innermost_fn)

    PATCHES.replace(cache, "load", checked_load, "a stored entry is taken only for the code it was traced from")

    @functools.wraps(own.initialize)
    def initialize_or_fresh(self: Any, fn: Any, dynamo: Any = None, ignore_inlined_sources: bool = False) -> None:
        if dynamo is None:
            own.initialize(self, fn, None, ignore_inlined_sources)
            return
        try:
            held, missing = without_missing(dynamo)
            with LEDGER.spending():  # torch checks the inlined sources of the stored entry here
                own.initialize(self, fn, with_own_lists(held), ignore_inlined_sources)
            self._megacache_loaded = dynamo  # all of it: what this process writes holds every stored variant
            if missing is not None:  # the rest installed where its frame runs, once the module is there
                self._megacache_held = (fn, dynamo, missing, held)
        except Exception as exc:  # noqa: BLE001 - inlined sources changed, a module gone: trace as usual
            if (missing := missing_module(exc)) is not None:
                self._megacache_deferred = (fn, dynamo, missing)  # installed where its frame runs, if it appears
            else:
                state.refuse_error(exc)
            fresh(self, fn, own.initialize)
            self._megacache_fresh = True  # torch installs the loaded backends next: nothing is to be installed

    PATCHES.replace(package_class, "initialize", initialize_or_fresh,
                    "an entry whose inlined sources changed, or whose modules are not there yet, leaves its frames traced")

    @functools.wraps(own.install)
    def install_or_fresh(self: Any, backends: Any) -> None:
        with LEDGER.spending():
            install_entry(state, own, self, postponed(backends))

    PATCHES.replace(package_class, "install", install_or_fresh, "an entry that fails to install leaves nothing behind; "
                    "its compiled graphs deserialized where first needed; what was installed noted for writing")

    def install_deferred(code: Any, counted: bool = True) -> None:
        """The stored entry of a function whose modules were missing when it was wrapped, installed where a frame of
        its code is about to be traced, once they are there (a module a library generates when it is first used);
        unless ``counted`` (a frame whose backend keeps it out of the store anyway), still missing is no refusal."""
        deferred = state.deferred.get(id(code))
        if deferred is None or deferred[0] is not code:
            return
        _, fn, dynamo, backends, missing = deferred
        if not importable(missing):
            if counted and not state.offers.of(code):  # else those that need no module are offered (without_missing)
                state.refuse("missing_module", f"{missing} is not there")  # once per frame traced
            return
        del state.deferred[id(code)]
        # may defer it again (another module missing) or refuse it, as when wrapped; its offers hold the package
        package_class(fn, dynamo).install(backends)

    state.install_deferred = install_deferred


def install_entry(state: Any, own: _Own, pkg: Any, backends: Any) -> None:
    """torch's install of the package ``pkg`` (initialized from a stored entry, or fresh), counted; any failure leaves
    nothing of the entry and ``pkg`` fresh, and an entry whose modules are missing waits for them (:func:`defer`)."""
    loaded = pkg.__dict__.pop("_megacache_loaded", None)
    held = pkg.__dict__.pop("_megacache_held", None)
    if pkg.__dict__.pop("_megacache_fresh", False):
        if (deferred := pkg.__dict__.pop("_megacache_deferred", None)) is not None:
            fn, dynamo, missing = deferred
            defer(state, pkg, fn, dynamo, missing, backends)
        return
    modules = [sys.modules.get(entry.python_module) for entry in list(pkg._codes.values())]
    skip_code = own.eval_frame.skip_code
    # torch marks the code of a stored entry without compiled variants as never to be compiled (meant for frames whose
    # graph was empty): such a frame, a resume function never reached when it was traced say, would then run eagerly
    # where a run without the option compiles it. Dynamo traces it as usual instead.
    own.eval_frame.skip_code = _no_skip
    state.installing = pkg
    try:
        own.install(pkg, backends)
    except Exception as exc:  # noqa: BLE001 - any failure: nothing of the entry stays, the frame is traced
        fn = pkg._innermost_fn
        if (missing := missing_module(exc)) is not None and loaded is not None:
            defer(state, pkg, fn, loaded, missing, backends)  # an import source not there yet
        else:
            state.refuse_error(exc)
        try:
            pkg.uninstall()
        finally:
            fresh(pkg, fn, own.initialize)
            repairs.numbering_past(own.bytecode_transformation, modules)
        return
    finally:
        own.eval_frame.skip_code = skip_code
        state.installing = None
    state.count("dynamo_reused")
    traced_afresh(pkg)
    if held is not None:
        held_fn, held_entry, missing, installed = held
        defer(state, pkg, held_fn, held_entry, missing, backends, installed)  # those held back (without_missing)
    if loaded is not None:
        state.loaded[pkg.source_id] = loaded  # what the store held: merged into what this process stores
        if pkg.source_id not in state.loaded_as:  # once per key (every wrapper of the function installs it)
            # as it is now: the package records the variants this process traces into the same code entries
            state.loaded_as[pkg.source_id] = entry_signature(loaded)
    repairs.numbering_past(own.bytecode_transformation, modules)
    state.used.setdefault(pkg.source_id)


def traced_afresh(pkg: Any) -> None:
    """The codes that the installed package ``pkg`` holds bypassed start this process as torch starts a code in a fresh
    one: not bypassed, with no variant. An earlier process could not store a frame of theirs (a forward whose backward
    never ran there, say), torch installed none of their variants, and a bypassed code records none of the variants
    traced later: such a code stayed out of the store in every later run, even once its frames could be stored. A
    frame that cannot be stored has its code bypassed again by torch where it is traced. Their names and imports,
    which torch installed, are kept; the stored entry itself (merged into what this process writes) is left as it is."""
    try:
        for code, entry in list(pkg._codes.items()):
            if getattr(entry, "bypassed", False) is True:
                # its names and imports are the installed copy's own (with_own_lists): torch adds to them in place
                pkg._codes[code] = dataclasses.replace(entry, bypassed=False, guarded_codes=[], backend_ids=[])
    except Exception:  # noqa: BLE001 - another layout: left as torch installed it (such codes stay out of the store)
        pass


def defer(state: Any, package: Any, fn: Any, dynamo: Any, missing: str, backends: Any, installed: Any = None) -> None:
    """The stored entry ``dynamo`` of ``fn``, whose module ``missing`` is not there yet, kept for an install where a
    frame of its code is about to be traced; each of its codes that holds variants noted as waiting for that module
    (a code stored without any, bypassed say, waits for nothing: what a frame of it traces is new). Where the entry was
    ``installed`` in part (what :func:`without_missing` kept of it, its codes in the same order), only the codes it
    holds fewer variants of wait: the others' variants are all installed, so what a frame of theirs traces is new too."""
    code = getattr(package._innermost_fn, "__code__", None)
    if code is None:
        state.refuse("missing_module", f"{missing} is not there")
        return
    state.deferred[id(code)] = (code, fn, dynamo, backends, missing)
    codes = list(getattr(dynamo, "codes", ()))
    kept = [len(part.guarded_codes) for part in installed.codes] if installed is not None else [None] * len(codes)
    for entry, count in zip(codes, kept, strict=True):
        if not entry.guarded_codes or getattr(entry, "bypassed", False) is True or count == len(entry.guarded_codes):
            continue
        state.waiting[(str(entry.python_module), int(entry.python_code.co_firstlineno), entry.python_code.co_name)] = missing


def without_missing(entry: Any) -> tuple[Any, str | None]:
    """``entry`` less what needs a module that is not there (yet: a module a library generates from a template where
    a layer is first made): the variants whose traces inlined or imported one (and those that did not record what they
    need), that module's recorded sources and imports; and one module missing (None: ``entry`` itself, where every
    module it names is there). The other variants are taken as they are (torch checks their sources); those held back
    where a frame of the function is about to be traced once the module is there (:func:`defer`), or where a later
    wrapper of the function loads the entry."""
    info: Any = getattr(entry, "source_info", None)
    sources = getattr(info, "inlined_sources", None)
    if not isinstance(sources, set):
        return entry, None
    named = {str(source.module) for source in sources}
    named.update(str(module) for code in entry.codes for module in getattr(code, "import_sources", {}).values())
    missing = {name for name in named if not importable(name)}
    if not missing:
        return entry, None

    def needs_none(variant: Any) -> bool:
        try:
            needs = unpack_guards(variant.guards_state).modules
        except Exception:  # noqa: BLE001 - an unreadable variant is refused where it is offered, as before
            return True
        return needs is not None and not needs & missing

    codes = [dataclasses.replace(code, guarded_codes=[v for v in code.guarded_codes if needs_none(v)],
                                 import_sources={alias: name for alias, name in code.import_sources.items()
                                                 if name not in missing}) for code in entry.codes]
    kept = {source for source in sources if source.module not in missing}
    return dataclasses.replace(entry, codes=codes, source_info=dataclasses.replace(info, inlined_sources=kept)), min(missing)


def with_own_lists(entry: Any) -> Any:
    """A copy of the stored entry ``entry`` for torch to install, whose codes have lists of their own: torch adds what
    this process traces to the installed codes' variants, graphs and names in place, and the entry as it was loaded
    stays what the store held. Merged with what was traced at the session's end, a loaded entry that had taken the new
    variants in left them out as held already (when another wrapper's install had loaded the entry again), and the whole
    of an entry installed in part, installed once its module was there, held a graph traced here that is not among its
    backends (its install failed)."""
    codes = [dataclasses.replace(code, guarded_codes=list(code.guarded_codes), backend_ids=list(code.backend_ids),
                                 function_names=list(code.function_names), import_sources=dict(code.import_sources))
             for code in entry.codes]
    return dataclasses.replace(entry, codes=codes)


def _no_skip(*_args: Any, **_kwargs: Any) -> None:
    return None


def fresh(pkg: Any, fn: Any, initialize: Any) -> None:
    """A CompilePackage back to a fresh one for ``fn``, in place (torch holds it), as if nothing had been loaded;
    ``initialize`` is torch's own CompilePackage.initialize."""
    pkg._initialized = False
    pkg._codes = {}
    pkg._current_entry = None
    pkg._installed_globals = {}
    pkg._resume_codes = set()
    pkg.__dict__.pop("source_id", None)
    initialize(pkg, fn, None, False)
