"""Every ``torch.compile`` wrapper of one function stored as one Dynamo reuse entry.

torch keeps the package that the last wrapper of a function recorded under its key; a suite that wraps one function
once per parameter or per test would lose the variants the other wrappers traced. :func:`packages_merged` makes
torch's record of a package merge it with the packages recorded before under the same key: the main code and each
resume function with every package's compiled variants, once each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .dynamo_objects import code_digest
from .dynamo_proofs import guards_digest


def packages_merged(state: Any, cache: Any) -> None:
    """torch's ``record_package`` on ``cache`` (its DynamoCache) merges each package with those recorded before
    under its key (``state.recorded``) and with the stored entry installed under it (``state.loaded``), less the
    variants refused in this process for a reason any later process would give too (``state.stale``); a failure
    keeps the last package alone, as torch does, and is counted."""
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
            per_package = state.recorded.setdefault(key, {})
            per_package[id(package)] = (package, latest)  # the package itself kept: its id is not reused
            parts = [entry for _package, entry in per_package.values()]
            if (loaded := state.loaded.get(key)) is not None:
                parts.insert(0, loaded)  # a package that did not load it (its install failed) would lose it
            if len(parts) > 1 or state.stale:
                entries[key] = _without(_merged(parts), state.stale)
        except Exception as exc:  # noqa: BLE001 - the last package alone, as torch keeps it
            state.refuse("torch_error", f"packages of one function not merged: {type(exc).__name__}: {exc}")

    cache.record_package = record_package


def _merged(entries: list[Any]) -> Any:
    """One dynamo cache entry holding every variant of several packages of one function: the function's own code
    and each resume function (by its name, unique in the process that made it) with every package's guarded variants
    (once each: each wrapper's package holds the variants it loaded, and a variant is its guards), imports and
    backends (bypassed if any package bypassed it)."""
    first, *others = entries
    main = first.codes[0]
    digest = code_digest(stored_code(main))
    codes = {_code_name(code, i): code for i, code in enumerate(first.codes)}
    for n, other in enumerate(others, 1):
        theirs = other.codes[0]
        if code_digest(stored_code(theirs)) != digest or theirs.python_module != main.python_module:
            raise ValueError("packages of one key hold other code")
        for i, code in enumerate(other.codes):
            name = _code_name(code, i, n)
            codes[name] = _merged_code(codes[name], code) if name in codes else code
    return dataclasses.replace(first, codes=list(codes.values()))


def _without(entry: Any, stale: set[str]) -> Any:
    """The entry without the variants whose stored guards (by digest) are in ``stale``: they would be refused again
    (:data:`pytest_megacache.dynamo_offers.PERSISTENT_REFUSALS`); a later trace stores what holds then."""
    if not stale:
        return entry
    codes = [dataclasses.replace(code, guarded_codes=[
        variant for variant in code.guarded_codes
        if guards_digest(variant.guards_state) not in stale]) for code in entry.codes]
    return dataclasses.replace(entry, codes=codes)


def _code_name(code: Any, index: int, package: int = 0) -> tuple[str, ...]:
    """The main code (first) is one; a resume function is its global names; a code of no name is its package's."""
    if index == 0:
        return ("",)
    return tuple(code.function_names) or (f"#{package}.{index}",)


def _merged_code(ours: Any, theirs: Any) -> Any:
    seen = {bytes(variant.guards_state) for variant in ours.guarded_codes}
    guarded = list(ours.guarded_codes)
    for variant in theirs.guarded_codes:
        if (guards := bytes(variant.guards_state)) not in seen:
            seen.add(guards)
            guarded.append(variant)
    backends = [*ours.backend_ids, *(b for b in theirs.backend_ids if b not in ours.backend_ids)]
    return dataclasses.replace(ours, guarded_codes=guarded, backend_ids=backends,
                               import_sources={**ours.import_sources, **theirs.import_sources},
                               bypassed=ours.bypassed or theirs.bypassed)


def stored_code(entry: Any) -> Any:
    """The code object a stored code entry (torch's ``_DynamoCodeCacheEntry``) was traced from."""
    from torch._dynamo.package import SerializedCode

    return SerializedCode.to_code_object(entry.python_code)
