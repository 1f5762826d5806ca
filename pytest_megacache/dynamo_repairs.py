"""Repairs of torch's own pieces that caching precompile relies on, each applied only where torch has the piece in
the form it was written against (else nothing of it is changed).

- :func:`key_without_backend_id`: AOTAutograd's cache key without the per-process name of the compiled function.
- :func:`inlined_sources_once`: what a trace records of an inlined function's source read once per code object.
- :func:`bundling_fails_open`: an AOTAutograd entry that cannot be bundled is not stored, instead of failing the test.
- :func:`sources_unpickle`: a stored guard on a function's default value loads again (torch 2.11 pickles a source's
  derived fields, which its constructor does not take).
- :func:`backendless_variants_dropped`: a variant whose compiled graph has no stored backend is left out of what is
  written, instead of every variant of its code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


def _autograd_cache() -> Any:
    """torch's AOTAutograd cache module, or None where it has another layout (then nothing of it is changed)."""
    try:
        import torch._functorch._aot_autograd.autograd_cache as autograd_cache
    except Exception:  # noqa: BLE001
        return None
    return autograd_cache


def bundling_fails_open(state: Any) -> None:
    autograd_cache = _autograd_cache()
    cache = getattr(autograd_cache, "AOTAutogradCache", None)
    bundling = getattr(autograd_cache, "should_bundle_autograd_cache", None)
    if cache is None or bundling is None or not hasattr(cache, "make_entry") or not hasattr(cache, "save"):
        return
    make_entry, save = cache.make_entry, cache.save

    @functools.wraps(make_entry)
    def make_entry_or_none(*args: Any, **kwargs: Any) -> Any:
        try:
            return make_entry(*args, **kwargs)
        except Exception as exc:
            if not autograd_cache.should_bundle_autograd_cache():
                raise
            state.refuse("torch_error", f"AOTAutograd entry not bundled: {type(exc).__name__}: {exc}")
            return None

    @functools.wraps(save)
    def save_entry(key: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
        return None if entry is None else save(key, entry, *args, **kwargs)

    cache.make_entry = staticmethod(make_entry_or_none)
    cache.save = staticmethod(save_entry)


def inlined_sources_once(package: Any) -> None:
    source_info: Any = getattr(package, "SourceInfo", None)
    add_code = getattr(source_info, "add_code", None)
    if add_code is None or "inlined_sources" not in getattr(source_info, "__dataclass_fields__", {}):
        return
    known: dict[int, tuple[Any, frozenset[Any]]] = {}  # id(code) -> the code (its id is not reused), what it added

    @functools.wraps(add_code)
    def add_code_once(self: Any, code: Any) -> None:
        seen = known.get(id(code))
        if seen is None or seen[0] is not code:
            scratch = source_info(inlined_sources=set())
            add_code(scratch, code)  # raises as torch does: nothing is kept then
            seen = known[id(code)] = (code, frozenset(scratch.inlined_sources))
        self.inlined_sources.update(seen[1])

    source_info.add_code = add_code_once


def key_without_backend_id() -> None:
    pickler = getattr(_autograd_cache(), "AOTAutogradCachePickler", None)
    reduce = getattr(pickler, "_reduce_aot_config", None)
    if pickler is None or reduce is None:
        return

    @functools.wraps(reduce)
    def reduce_aot_config(self: Any, aot_config: Any) -> Any:
        backend_id = getattr(aot_config, "precompile_backend_id", None)
        if backend_id is None:
            return reduce(self, aot_config)
        object.__setattr__(aot_config, "precompile_backend_id", None)  # a frozen dataclass
        try:
            return reduce(self, aot_config)
        finally:
            object.__setattr__(aot_config, "precompile_backend_id", backend_id)

    pickler._reduce_aot_config = reduce_aot_config



def sources_unpickle(torch: Any) -> None:
    """torch 2.11 pickles a guard's source as its class and *every* dataclass field, the derived ones too
    (``DefaultsSource.field`` and ``_name``, set by ``__post_init__``), and its constructor does not take those: every
    stored guard on a function's default value fails to load (``__init__() takes from 3 to 4 positional arguments
    but 6 were given``). Where torch pickles so, such a class's constructor also takes the derived values after the
    others, all positional, and checks they are those it derives; any other call is torch's own."""
    try:
        from torch._dynamo import source as sources
        from torch._guards import Source, dataclass_with_cached_hash
    except Exception:  # noqa: BLE001
        return

    @dataclass_with_cached_hash(frozen=True)
    class Probe:
        given: int
        derived: int = dataclasses.field(init=False, default=0)

    try:
        if len(Probe(1).__reduce__()[1]) == 1:  # torch pickles only what the constructor takes
            return
    except Exception:  # noqa: BLE001
        return
    for cls in list(vars(sources).values()):
        if (isinstance(cls, type) and issubclass(cls, Source) and dataclasses.is_dataclass(cls)
                and "_megacache_unpickles" not in cls.__dict__
                and any(not f.init for f in dataclasses.fields(cls))):
            _constructor_takes_derived(cls)


def _constructor_takes_derived(cls: type) -> None:
    init = cls.__init__  # type: ignore[misc]
    fields = dataclasses.fields(cls)
    names, given = [f.name for f in fields], [f.name for f in fields if f.init]  # some not given: derived

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs or len(args) != len(names):
            init(self, *args, **kwargs)
            return
        values = dict(zip(names, args, strict=True))
        init(self, **{name: values[name] for name in given})
        for name in names:
            if name not in given and getattr(self, name) != values[name]:
                raise TypeError(f"{cls.__name__}: {name} {values[name]!r} is not the value derived")

    cls.__init__ = __init__  # type: ignore[misc]
    cls._megacache_unpickles = True  # type: ignore[attr-defined]


def backendless_variants_dropped(package: Any) -> None:
    """torch writes no variant of a code object where one variant's compiled graph has no stored backend (a forward
    whose backward never ran, a graph Inductor did not compile through its cache): it logs "Backend not found" and
    bypasses the code, so its other variants, complete as they are, are traced again in every run. Here only the
    variants whose bytecode calls a missing backend are left out of what is written; a code left with none is
    bypassed as torch does."""
    entry_class: Any = getattr(package, "PrecompileCacheEntry", None)
    from_cache_entry = getattr(entry_class, "from_cache_entry", None)
    if from_cache_entry is None:
        return

    @functools.wraps(from_cache_entry)
    def from_cache_entry_per_variant(cache_entry: Any, backends: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            cache_entry = _without_backendless(cache_entry, backends)
        except Exception:  # noqa: BLE001 - torch's own handling of the entry, as without this
            pass
        return from_cache_entry(cache_entry, backends, *args, **kwargs)

    entry_class.from_cache_entry = staticmethod(from_cache_entry_per_variant)


def _without_backendless(cache_entry: Any, backends: Any) -> Any:
    codes, changed = [], False
    for code in cache_entry.codes:
        missing = {backend for backend in code.backend_ids if backend not in backends}
        if missing and not code.bypassed:
            kept = [variant for variant in code.guarded_codes if not _names(variant.dynamo_code) & missing]
            if kept:
                code = dataclasses.replace(code, guarded_codes=kept,
                                           backend_ids=[b for b in code.backend_ids if b not in missing])
                changed = True
        codes.append(code)
    return dataclasses.replace(cache_entry, codes=codes) if changed else cache_entry


def _names(serialized: Any) -> set[str]:
    """The global names a serialized code object and the code objects among its constants load."""
    names = set(getattr(serialized, "co_names", ()) or ())
    for const in getattr(serialized, "co_consts", ()) or ():
        if hasattr(const, "co_names") and hasattr(const, "co_consts"):
            names |= _names(const)
    return names
