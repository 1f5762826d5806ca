"""Every ``torch.compile`` wrapper of one function stored as one Dynamo reuse entry.

torch keeps the package that the last wrapper of a function recorded under its key; a suite that wraps one function
once per parameter or per test would lose the variants the other wrappers traced. :func:`packages_merged` makes
torch's record of a package merge it with the packages recorded before under the same key: the main code and each
other code (a resume function) with every package's compiled variants and names, once each.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from .effects import failed_load_contained
from .objects import Refused, code_digest
from .patches import PATCHES
from .proofs import function_of, guards_digest, reason_of


def packages_merged(state: Any, cache: Any) -> None:
    """torch's ``record_package`` on ``cache`` (its DynamoCache) merges each package with those recorded before
    under its key (``state.recorded``) and with the stored entry installed under it (``state.loaded``), less the
    variants :func:`left_out` (see :func:`pytest_megacache.dynamo.offers.superseded`); a failure keeps the last
    package alone, as torch does, and is counted."""
    record = getattr(cache, "record_package", None)
    try:
        from torch._dynamo.precompile_context import PrecompileContext
    except Exception:  # noqa: BLE001 - another layout: torch's own behaviour
        return
    entries = getattr(PrecompileContext, "_dynamo_cache_entries", None)
    if record is None or not isinstance(entries, dict):
        return

    def record_package(package: Any) -> None:
        record(package)
        try:
            key = package.source_id
            latest = entries.get(key)
            if latest is None:
                return
            loaded = state.loaded.get(key)
            per_package = state.recorded.setdefault(key, {})
            # each package's variants that the stored entry lacks (each wrapper's package holds its own unpickled copy
            # of every stored variant: kept, they were held for the whole session, once per wrapper)
            per_package[_serial(package)] = _new_only(latest, loaded)
            parts = list(per_package.values())
            if loaded is not None:
                parts.insert(0, loaded)  # a package that did not load it (its install failed) would lose it
            drop = left_out(state)
            if len(parts) > 1 or drop:
                entries[key] = _pruned(_without(_merged(parts), drop))
        except Exception as exc:  # noqa: BLE001 - the last package alone, as torch keeps it
            state.refuse("torch_error", f"packages of one function not merged: {type(exc).__name__}: {exc}")

    PATCHES.replace(cache, "record_package", record_package,
                    "every wrapper of one function is one entry: the variants of each are merged, not the last kept")


def left_out(state: Any) -> set[str]:
    """The stored variants (by digest) left out of what this process writes: those refused here for a reason any
    later process would give too (``state.stale``) or passed over in their own test (``state.superseded``), unless
    taken here (a class one test rebound and another did not: the variant holds where it was traced)."""
    left: set[str] = (state.stale | state.superseded) - state.taken
    return left


_SERIALS = itertools.count()


def _serial(package: Any) -> int:
    """A number of its own for each package, for as long as the process runs (an ``id`` may be reused once it is
    gone, and the package need not be kept for it)."""
    serial = package.__dict__.get("_megacache_serial")
    if serial is None:
        serial = package.__dict__["_megacache_serial"] = next(_SERIALS)
    return int(serial)


def _new_only(entry: Any, loaded: Any) -> Any:
    """``entry`` without the variants the stored entry ``loaded`` holds already (by their guards)."""
    if loaded is None:
        return entry
    stored = {guards_digest(variant.guards_state) for code in loaded.codes for variant in code.guarded_codes}
    codes = [dataclasses.replace(code, guarded_codes=[
        variant for variant in code.guarded_codes if guards_digest(variant.guards_state) not in stored])
        for code in entry.codes]
    return dataclasses.replace(entry, codes=codes)


def _merged(entries: list[Any]) -> Any:
    """One dynamo cache entry holding every variant of several packages of one function: the function's own code
    and each other code (a resume function, a function called after a graph break) with every package's guarded
    variants (once each: each wrapper's package holds the variants it loaded, and a variant is its guards), global
    names, imports and backends. A code is bypassed only where every package bypassed it: torch bypasses a package's
    code where one of its frames could not be stored (``torch._dynamo.explain``'s frames, whose backend is the test's
    own, say), and installs no variant of a bypassed code; each variant another package stored is proven on its own
    where it is offered. Codes are one where their code objects are
    equal, as torch keys a package's codes when it installs them (one entry per code object there: of two entries for
    one resume function, the names and variants of one would be lost, and a variant of the other calling its resume
    function by a name never installed would fail)."""
    first = entries[0]
    main = first.codes[0]
    digest = code_digest(stored_code(main))
    codes: dict[Any, Any] = {}
    for n, entry in enumerate(entries):
        theirs = entry.codes[0]
        if n and (code_digest(stored_code(theirs)) != digest or theirs.python_module != main.python_module):
            raise ValueError("packages of one key hold other code")
        for code in entry.codes:
            key = stored_code(code)
            codes[key] = _merged_code(codes[key], code) if key in codes else code
    merged = dataclasses.replace(first, codes=list(codes.values()))
    # every package's record of the functions its traces inlined (torch checks their lines where it loads the entry)
    sets = [getattr(getattr(entry, "source_info", None), "inlined_sources", None) for entry in entries]
    if all(isinstance(known, set) for known in sets):
        sources: set[Any] = set().union(*(known for known in sets if known is not None))
        merged = dataclasses.replace(merged, source_info=dataclasses.replace(first.source_info, inlined_sources=sources))
    return merged


def _without(entry: Any, stale: set[str]) -> Any:
    """The entry without the variants whose stored guards (by digest) are in ``stale``: they would be refused again
    (:data:`pytest_megacache.dynamo.offers.PERSISTENT_REFUSALS`, or a variant its own test passed over a second run
    running); a later trace stores what holds then."""
    if not stale:
        return entry
    codes = [dataclasses.replace(code, guarded_codes=[
        variant for variant in code.guarded_codes
        if guards_digest(variant.guards_state) not in stale]) for code in entry.codes]
    return dataclasses.replace(entry, codes=codes)


def _pruned(entry: Any) -> Any:
    """The entry with each code's backends (compiled graphs) cut to those a variant it keeps still calls: a variant
    left out, or two packages' copies of one variant, left its graph behind, and the entry grew by it at every run.
    A variant calls a compiled graph by its global name, so every name its bytecode (or a code object among its
    constants) loads is kept; where a variant's code cannot be read so, nothing is cut. So are the resume functions
    no variant it keeps calls (:func:`_reached`), and each kept resume function's names that no variant calls (a
    frame traced again in every run names its resume function anew: the entry grew by a name at every run)."""
    for code in entry.codes:
        for variant in code.guarded_codes:
            if not isinstance(getattr(variant.dynamo_code, "co_names", None), (tuple, list)):
                return entry  # another layout: what its code calls is not known, so nothing is cut
    kept = _reached(entry.codes)
    used = {name for code in kept for variant in code.guarded_codes for name in _names_of(variant.dynamo_code)}
    codes = [dataclasses.replace(code, backend_ids=[b for b in code.backend_ids if b in used],
                                 function_names=[n for n in code.function_names if n in used] if _resumes(code)
                                 else code.function_names) for code in kept]
    return dataclasses.replace(entry, codes=codes)


def _reached(codes: list[Any]) -> list[Any]:
    """The codes a later process can enter: every code but a resume function, and a resume function only where a
    variant of a code it can enter calls it by one of its names. A resume function is made anew, under a new name,
    wherever its function's frame is traced: a frame refused here (an optimizer's identity guard, say) left the
    resume functions its trace made, which no stored variant calls, and the entry grew by one at every run."""
    kept = [code for code in codes if not _resumes(code)]
    waiting = [code for code in codes if _resumes(code)]
    frontier = list(kept)
    while frontier and waiting:
        called = {name for code in frontier for variant in code.guarded_codes for name in _names_of(variant.dynamo_code)}
        frontier = [code for code in waiting if called.intersection(map(str, code.function_names or ()))]
        waiting = [code for code in waiting if all(code is not f for f in frontier)]
        kept.extend(frontier)
    return [code for code in codes if any(code is k for k in kept)]


def _resumes(code: Any) -> bool:
    return str(getattr(code.python_code, "co_name", "")).startswith(RESUME_PREFIX)


def _names_of(code: Any, depth: int = 0) -> set[str]:
    """The global names a (serialized) code object and the code objects among its constants load."""
    names = {name for name in getattr(code, "co_names", ()) or () if isinstance(name, str)}
    if depth < 16:
        for const in getattr(code, "co_consts", ()) or ():
            if hasattr(const, "co_names"):
                names |= _names_of(const, depth + 1)
    return names


def _merged_code(ours: Any, theirs: Any) -> Any:
    seen = {guards_digest(variant.guards_state) for variant in ours.guarded_codes}
    guarded = list(ours.guarded_codes)
    for variant in theirs.guarded_codes:
        if (guards := guards_digest(variant.guards_state)) not in seen:  # one variant traced in two runs: the first
            seen.add(guards)
            guarded.append(variant)
    backends = [*ours.backend_ids, *(b for b in theirs.backend_ids if b not in ours.backend_ids)]
    names = [*ours.function_names, *(f for f in theirs.function_names if f not in ours.function_names)]
    return dataclasses.replace(ours, guarded_codes=guarded, backend_ids=backends, function_names=names,
                               import_sources={**ours.import_sources, **theirs.import_sources},
                               bypassed=ours.bypassed and theirs.bypassed)


def unchanged_since_installed(state: Any, entry: Any) -> bool:
    """Whether ``entry`` (a dynamo cache entry torch recorded in this process) holds what its stored copy held when it
    was installed (``state.loaded_as``): written again, its new bytes would be stored again at every run."""
    from torch._dynamo.precompile_context import PrecompileContext

    key = next((k for k, e in PrecompileContext._dynamo_cache_entries.items() if e is entry), None)
    return key is not None and holds_what_was_installed(state, key, entry)


def holds_what_was_installed(state: Any, key: str, entry: Any) -> bool:
    """Whether ``entry`` (a dynamo cache entry) holds what the stored entry of ``key`` held when it was installed in
    this process (``state.loaded_as``); False where either cannot be read."""
    stored = state.loaded_as.get(key)
    return stored is not None and entry_signature(entry) == stored


def entry_signature(entry: Any) -> Any:
    """What a dynamo cache entry holds, as a value: equal for two entries with the same codes, each with the same
    variants (a variant is its guards), names, imports and backends, and the same recorded sources (each function's
    module, lines and their checksum: the module's whole text is not written, repairs.module_texts_left_out) and system,
    however torch pickled them (pickling the same objects again does not give the same bytes). Take it before torch
    uses the entry: a package records the variants its process traces in the code entries it was given. None where
    the entry cannot be read so (never equal to anything)."""
    try:
        return _signature(entry)
    except Exception:  # noqa: BLE001 - another layout: written, as torch writes it
        return None


def _signature(entry: Any) -> Any:
    codes = frozenset(
        (code_digest(stored_code(code)), code.python_module, frozenset(code.function_names),
         frozenset(guards_digest(variant.guards_state) for variant in code.guarded_codes),
         frozenset(code.import_sources.items()), frozenset(code.backend_ids), code.code_source, code.install_to_global,
         getattr(code, "has_compile_id", None), getattr(code, "bypassed", None))
        for code in entry.codes)
    sources = frozenset((getattr(s, "module", None), getattr(s, "firstlineno", None), getattr(s, "lastlineno", None),
                         getattr(s, "checksum", s)) for s in entry.source_info.inlined_sources)  # not the module texts
    return (len(entry.codes), codes, sources, entry.device_type,
            entry.system_info, getattr(entry, "fn_name", None), getattr(entry, "fn_first_lineno", None))


# torch's name for a resume function (the rest of a frame after a graph break): torch_dynamo_resume_in_<name>_at_<line>
RESUME_PREFIX = "torch_dynamo_resume_in_"


def enterable_codes(codes: list[Any]) -> list[Any]:
    """The codes of an entry (torch's ``_DynamoCodeCacheEntry`` list, the wrapped function's first) whose variants a
    later process can take: a resume function is entered only from a stored variant of the function it resumes, so
    where the wrapped function has none (its frame was refused here), its resume functions' variants are never taken
    (each run traced them again and stored one more)."""
    if not codes or codes[0].guarded_codes:
        return list(codes)
    return [codes[0], *(code for code in codes[1:] if not _resumes(code))]


def stored_code(entry: Any) -> Any:
    """The code object a stored code entry (torch's ``_DynamoCodeCacheEntry``) was traced from."""
    from torch._dynamo.package import SerializedCode

    return SerializedCode.to_code_object(entry.python_code)


def loaded_if_same_code(state: Any, fn: Any, load: Any, innermost_fn: Any) -> Any:
    """torch's load of ``fn``'s stored entry (``load``, torch's ``DynamoCache.load``), refused (counted in ``state``)
    unless its main code is ``fn``'s code now, of the same module (``innermost_fn``: torch's, the wrapped function)."""
    try:
        with failed_load_contained(state):
            result = load(fn)
    except Exception as exc:  # noqa: BLE001
        state.refuse_error(exc)
        return None
    if result is None:
        return None
    try:
        func = function_of(innermost_fn(fn))
        main = result.dynamo.codes[0]
        if main.python_module != getattr(func, "__module__", None):
            raise Refused("collision", f"an entry of {main.python_module} for {func.__module__}")
        stored = stored_code(main)
        if code_digest(stored) != code_digest(func.__code__):
            raise Refused("code_changed", f"{func.__qualname__} changed since it was traced")
    except Exception as exc:  # noqa: BLE001
        state.refuse(reason_of(exc), str(exc))
        return None
    return result


def merged_copies(copies: list[bytes]) -> bytes | None:
    """One stored Dynamo entry (torch's pickled ``PrecompileCacheEntry``, as :func:`pytest_megacache.dynamo.install`'s
    ``write_each`` writes it) holding every variant of ``copies``: entries of one key that several processes wrote
    (xdist workers, each from the same stored entry and what it traced besides), merged as :func:`packages_merged`
    merges one process's packages (:func:`_merged`, :func:`_pruned`). The same bytes whatever the order of ``copies``:
    they are taken in the order of their bytes, and where one of them already holds every variant, its bytes are the
    result. None where they cannot be one entry: other main code, a global name that two of their codes (or imports)
    would both take, or a graph a variant calls that no copy holds. Imports torch; raises where a copy does not
    unpickle (:func:`_unpickled`: no module of the project is imported, and no graph's code runs, to read one)."""
    import pickle

    ordered = sorted(set(copies))
    entries = [_unpickled(data) for data in ordered]
    dynamos = [entry.dynamo for entry in entries]
    main = dynamos[0].codes[0]
    digest = code_digest(stored_code(main))
    if any(code_digest(stored_code(d.codes[0])) != digest or d.codes[0].python_module != main.python_module
           for d in dynamos[1:]):
        return None
    merged = _pruned(_merged(dynamos))
    if _clashes(merged.codes):
        return None
    backends: dict[Any, Any] = {}
    for entry in entries:
        for backend_id, backend in entry.backends.items():
            backends.setdefault(backend_id, backend)
    used = {backend_id for code in merged.codes if not code.bypassed for backend_id in code.backend_ids}
    if not used <= backends.keys():
        return None
    backends = {backend_id: backend for backend_id, backend in backends.items() if backend_id in merged.backend_ids}
    signature = entry_signature(merged)
    for data, entry in zip(ordered, entries, strict=True):
        if signature is not None and entry_signature(entry.dynamo) == signature and entry.backends.keys() == backends.keys():
            return data  # one copy holds every other's variants already: it stays as it was written
    from .repairs import module_texts_left_out

    return pickle.dumps(module_texts_left_out(dataclasses.replace(entries[0], dynamo=merged, backends=backends)))


def _clashes(codes: list[Any]) -> bool:
    """Whether two of ``codes`` (a merged entry's) would install different objects under one global name of a module:
    a function name (a resume function) given to two codes, or an import alias to two modules. torch numbers such
    names per process, so two processes may give one name to two different resume functions; installed together,
    a variant would call the other one."""
    owners: dict[tuple[str, str], Any] = {}
    for code in codes:
        named = [(name, ("code", stored_code(code))) for name in code.function_names] if code.install_to_global else []
        named += [(alias, ("module", module)) for alias, module in code.import_sources.items()]
        for name, owner in named:
            if owners.setdefault((code.python_module, str(name)), owner) != owner:
                return True
    return False


# Top-level packages whose modules an entry's pickle may import where it is read apart from the process that wrote it
# (torch's classes: its entry, its compiled graphs' records; sympy's expressions of symbolic shapes; the plugin's own
# records of graphs, :mod:`pytest_megacache.dynamo.eager`).
_IMPORTABLE = frozenset({"torch", "sympy", "pytest_megacache"})
# torch's functions that a pickle calls to rebuild an object by running code: a graph module runs its generated code
# and the imports it names (a project's module among them). Such an object is kept as the call, never made.
_NOT_RUN = frozenset({("torch.fx.graph_module", "reduce_graph_module"),
                      ("torch.fx.graph_module", "reduce_package_graph_module")})


class _Call:
    """What ``function(*args)`` would have made, as that call: written back as it was read."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> Any:
        return self.function, self.args


def _unpickled(data: bytes) -> Any:
    """A stored entry read without running anything of the project: a class or function of a module neither torch's
    nor the plugin's nor imported already is refused (pickle.UnpicklingError), a graph module is not rebuilt
    (:data:`_NOT_RUN`), and the globals of a module that a variant's code makes a function from
    (:func:`pytest_megacache.dynamo.repairs.module_globals`) are read as the module's name: each is written back as it
    was."""
    import functools
    import io
    import pickle
    import sys

    from . import repairs

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == (repairs.__name__, "module_globals"):
                return repairs._ModuleGlobals
            if module not in sys.modules and module.partition(".")[0] not in _IMPORTABLE:
                raise pickle.UnpicklingError(f"{module} is not imported here")
            found = super().find_class(module, name)
            return functools.partial(_Call, found) if (module, name) in _NOT_RUN else found

    return Unpickler(io.BytesIO(data)).load()
