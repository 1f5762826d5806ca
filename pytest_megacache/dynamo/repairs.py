"""Repairs of torch's own pieces that caching precompile relies on, each applied only where torch has the piece in
the form it was written against (else nothing of it is changed).

- :func:`key_without_backend_id`: AOTAutograd's cache key without the per-process name of the compiled function.
- :func:`inlined_sources_once`: what a trace records of an inlined function's source read once per code object.
- :func:`inlined_sources_shared`: the module texts of stored entries held once per process, not once per entry.
- :func:`module_texts_left_out`: an entry written without the module texts torch never reads back.
- :func:`bundling_fails_open`: an AOTAutograd entry that cannot be bundled is not stored, instead of failing the test.
- :func:`sources_unpickle`: a stored guard on a function's default value loads again (torch 2.11 pickles a source's
  derived fields, which its constructor does not take).
- :func:`backendless_variants_dropped`: a variant whose compiled graph has no stored backend is left out of what is
  written (and counted), instead of every variant of its code.
- :func:`module_globals_by_name`: output code that makes a function (Dynamo loads the function's module globals as a
  constant) is written with the module's name in place of its globals, instead of not at all.
- :func:`bundled_kernels_left_unlaunched`: the GPU kernels of a compiled graph loaded from Inductor's cache run as
  copies, so that the graph can still be bundled into an AOTAutograd entry after they ran.
- :func:`guards_state_loaded`: a stored guard state whose module's own ``__setstate__`` fails on what torch left out
  of it loads with each module's state put in place as ``torch.nn.Module`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import itertools
import pickle
import re
import sys
from collections.abc import Callable
from typing import Any

from .patches import PATCHES


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

    PATCHES.replace(cache, "make_entry", staticmethod(make_entry_or_none),
                    "a graph whose code is not Inductor's output gets no AOTAutograd entry, as without the option")
    PATCHES.replace(cache, "save", staticmethod(save_entry), "an entry not made is not saved")


def bundled_kernels_left_unlaunched(bundler: Any = None) -> None:
    """Where Inductor loads a compiled graph from its cache, it hands the graph's statically launched GPU kernels (its
    Triton bundle's) to the kernel cache as they are, and the module that runs them makes their launchers on those
    very objects. Under caching precompile the graph is bundled, whole, into its AOTAutograd entry, which torch saves
    only where the graph's backward is compiled: a kernel with launchers does not pickle ("pickle should not be
    called with after make_launchers()"), and torch stores no entry. A forward that a warm run loads from Inductor's
    cache and whose backward it compiles (a graph no earlier run stored, a forward-only one) was so never stored on
    a GPU, and its frame traced in every run. Here the kernel cache gets copies of the bundle's kernels (what
    unpickling them once more gives), which run as the bundle's own would, and the bundle keeps the kernels as
    Inductor stored them: what is bundled is what was loaded. ``bundler``: torch's ``TritonBundler`` (imported where
    not given)."""
    if bundler is None:
        try:
            from torch._inductor.triton_bundler import TritonBundler as bundler
        except Exception:  # noqa: BLE001
            return
    own = vars(bundler).get("load_autotuners") if isinstance(bundler, type) else None
    if not isinstance(own, classmethod):
        return
    load = own.__func__

    @functools.wraps(load)
    def load_copies(cls: Any, static_autotuners: Any) -> Any:
        return load(cls, running_copies(static_autotuners))

    PATCHES.replace(bundler, "load_autotuners", classmethod(load_copies),
                    "a graph loaded from Inductor's cache runs copies of its bundled kernels and can still be bundled")


def running_copies(static_autotuners: Any) -> Any:
    """Each of a Triton bundle's statically launched kernels (torch's ``StaticallyLaunchedAutotuner``) with a copy of
    its kernel, to be handed to the kernel cache; the bundle as it is where one does not copy (torch's own way then)."""
    if not static_autotuners:
        return static_autotuners
    try:
        return [dataclasses.replace(each, kernel=copy.deepcopy(each.kernel)) for each in static_autotuners]
    except Exception:  # noqa: BLE001
        return static_autotuners


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

    PATCHES.replace(source_info, "add_code", add_code_once,
                    "what torch records of one inlined code object is read once per process, not at each trace")


def inlined_sources_shared(cache: Any) -> None:
    """torch records with each inlined function the whole text of its module, and every stored entry it reads
    (``cache``: its DynamoCache) unpickles its own copy of each: a suite whose compiled functions inline a library's
    large modules held the same texts once per installed function (174 MB of a run's 1 GB, 90 entries). Each entry
    read gets the copy read first of an equal text; what torch holds is otherwise as it read it."""
    read = getattr(cache, "read", None)
    if read is None:
        return
    texts: dict[str, list[str]] = {}  # per module, the distinct texts read

    def shared(text: str, module: str) -> str:
        known = texts.setdefault(module, [])
        for seen in known:
            if seen == text:
                return seen
        known.append(text)
        return text

    @functools.wraps(read)
    def read_shared(path: str) -> Any:
        entry = read(path)
        try:
            info = entry.dynamo.source_info
            if (sources := _with_texts(info)) is not None:
                info.inlined_sources = {dataclasses.replace(s, content=shared(s.content, s.module)) for s in sources}
        except Exception:  # noqa: BLE001 - another layout: as torch read it
            pass
        return entry

    PATCHES.replace(cache, "read", read_shared, "a stored entry's module texts are held once per process")


def module_texts_left_out(entry: Any) -> Any:
    """``entry`` (torch's ``PrecompileCacheEntry``) to be written without the texts of the modules of its inlined
    functions: torch writes each whole (``InlinedSource.content``) and reads back only the checksum of the function's
    own lines (2.13 and 2.14 read the text nowhere), and on a tensor-container suite the texts were 85 % of every
    stored byte, pickled, compressed, fetched and unpickled in every run. A torch that did read them would find an
    empty text, never another one. torch's own objects are not changed; another layout is written as it is."""
    try:
        dynamo = entry.dynamo
        if (sources := _with_texts(dynamo.source_info)) is None:
            return entry
        bare = dataclasses.replace(dynamo.source_info, inlined_sources={dataclasses.replace(s, content="")
                                                                        for s in sources})
        return dataclasses.replace(entry, dynamo=dataclasses.replace(dynamo, source_info=bare))
    except Exception:  # noqa: BLE001 - another layout: written as torch made it
        return entry


def _with_texts(source_info: Any) -> set[Any] | None:
    """torch's record of a package's inlined functions (``SourceInfo.inlined_sources``), where each is of the form
    these repairs were written against: a dataclass with the module's name and text; else None."""
    sources = getattr(source_info, "inlined_sources", None)
    if isinstance(sources, set) and all(dataclasses.is_dataclass(s) and isinstance(getattr(s, "content", None), str)
                                        and isinstance(getattr(s, "module", None), str) for s in sources):
        return sources
    return None


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

    PATCHES.replace(pickler, "_reduce_aot_config", reduce_aot_config,
                    "AOTAutograd's cache key computed without the compiled function's per-process name")



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

    PATCHES.replace(cls, "__init__", __init__, "guards on a function's default values unpickle again")
    PATCHES.replace(cls, "_megacache_unpickles", True, "marks the class done")


def backendless_variants_dropped(package: Any, state: Any) -> None:
    """torch writes no variant of a code object where one variant's compiled graph has no stored backend (a forward
    whose backward never ran, a graph Inductor did not compile through its cache, a graph torch could not serialize):
    it logs "Backend not found" and bypasses the code, so its other variants, complete as they are, are traced again
    in every run. Here only the variants whose bytecode calls a missing backend are left out of what is written; a code
    left with none is bypassed as torch does. Each variant left out is counted (``no_backend``): its frame is traced
    again in every run, and the report says why."""
    entry_class: Any = getattr(package, "PrecompileCacheEntry", None)
    from_cache_entry = getattr(entry_class, "from_cache_entry", None)
    if from_cache_entry is None:
        return

    def dropped(code: Any, count: int) -> None:
        for _ in range(count):
            state.refuse("no_backend", NO_BACKEND)
        # named where it is dropped: where it is traced again, it is offered only other compiles' variants, if any
        state.traced_for("no_backend", code)

    @functools.wraps(from_cache_entry)
    def from_cache_entry_per_variant(cache_entry: Any, backends: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            cache_entry = _without_backendless(cache_entry, backends, dropped)
        except Exception:  # noqa: BLE001 - torch's own handling of the entry, as without this
            pass
        return from_cache_entry(cache_entry, backends, *args, **kwargs)

    PATCHES.replace(entry_class, "from_cache_entry", staticmethod(from_cache_entry_per_variant),
                    "only the variants calling a missing backend are left out of what is written, not the whole code")


NO_BACKEND = ("torch stored no compiled graph for it (a forward whose backward never ran, or a graph torch could not "
              "serialize: see torch's log)")


def _without_backendless(cache_entry: Any, backends: Any, dropped: Callable[[Any, int], None]) -> Any:
    codes, changed = [], False
    for code in cache_entry.codes:
        missing = {backend for backend in code.backend_ids if backend not in backends}
        if missing and not code.bypassed:
            kept = [variant for variant in code.guarded_codes if not _names(variant.dynamo_code) & missing]
            dropped(code.python_code, len(code.guarded_codes) - len(kept))
            # a code left with none is bypassed as torch would, without the variants (their guards name addresses
            # of this process: written, the entry would be new in every run)
            code = dataclasses.replace(code, guarded_codes=kept, bypassed=not kept,
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


def module_globals_by_name(package: Any) -> None:
    """Where a traced frame makes a function (a closure it returns or stores), Dynamo's output code loads the globals
    dict of the function's module as a constant, which does not pickle (it holds modules): torch fails to write the
    whole entry, and the frame is traced in every run. Such a code object pickles here with the module's name in
    place of the dict, and unpickles to the globals of the module of that name in the loading process, which must
    have imported it already (else the entry does not load: nothing is imported to load it). That is the object the
    tracing process's code held: the module by name, as torch's own entries name every module a frame reaches; its
    source is checked as torch checks every inlined function's. A dict that is not the globals of an imported module
    under its ``__name__`` (a script run as ``__main__``, an ``exec`` namespace) is left as it is, and the entry is not
    written, as without this."""
    serialized: Any = getattr(package, "SerializedCode", None)
    if serialized is None or not dataclasses.is_dataclass(serialized) or "co_consts" not in {
            f.name for f in dataclasses.fields(serialized)} or "__reduce_ex__" in vars(serialized):
        return

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        if not any(_is_module_globals(const) for const in self.co_consts):
            return object.__reduce_ex__(self, protocol)
        consts = tuple(_ModuleGlobals(const["__name__"]) if _is_module_globals(const) else const
                       for const in self.co_consts)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _serialized_code, (type(self), {**fields, "co_consts": consts})

    PATCHES.replace(serialized, "__reduce_ex__", __reduce_ex__,
                    "an output code holding its module's globals pickles them by the module's name")


def _is_module_globals(const: Any) -> bool:
    if type(const) is not dict:
        return False
    name = const.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) and name not in ("__main__", "__mp_main__") else None
    return module is not None and getattr(module, "__dict__", None) is const


class _ModuleGlobals:
    """Pickles as the globals of the module named ``name``, looked up when unpickled."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Any:
        return module_globals, (self.name,)


def module_globals(name: str) -> dict[str, Any]:
    """The globals of module ``name``, imported already by this process."""
    module = sys.modules.get(name)
    if module is None:
        raise ImportError(f"{name} is not imported: the stored code makes a function from its globals", name=name)
    return module.__dict__


def _serialized_code(cls: Any, fields: dict[str, Any]) -> Any:
    return cls(**fields)


# torch's unique_id names: a prefix (numbered too: `__resume_at_<offset>`), `_<n>`, for a graph a uuid4 (`_` for `-`)
_NUMBERED = re.compile(r"^__\w*?_(\d+)(?:_[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})?$")


def numbering_past(bytecode_transformation: Any, modules: list[Any]) -> None:
    """An installed entry puts globals into its modules (the builtins dict, compiled and resume functions, import
    aliases) named with numbers from torch's per-process counter in the process that traced them, and a failed
    install can leave some there: a frame traced now must not pick the same names (torch asserts, or runs the
    wrong one). So the counter moves past every such number in those modules."""
    numbers = [_number(name) for module in {id(m): m for m in modules if m is not None}.values()
               for name in list(vars(module)) if name.startswith("__")]
    _advance_past(bytecode_transformation, max((n for n in numbers if n is not None), default=None))


def numbering_past_name(bytecode_transformation: Any, name: str) -> None:
    """torch's per-process counter of numbered names moved past the number of ``name`` (if torch numbered it)."""
    _advance_past(bytecode_transformation, _number(name))


def _number(name: str) -> int | None:
    return int(match.group(1)) if (match := _NUMBERED.match(name)) else None


def _advance_past(bytecode_transformation: Any, number: int | None) -> None:
    if number is not None:
        current = next(bytecode_transformation._unique_id_counter)
        bytecode_transformation._unique_id_counter = itertools.count(max(current, number + 1))


def guards_state_loaded(load_guards_state: Any, data: bytes) -> Any:
    """torch's ``load_guards_state`` of a variant's guard state; where it fails, the state unpickled again with each
    module's state put in place as ``torch.nn.Module.__setstate__`` does, not by its class's own. torch pickles a
    module of a guarded frame with only what its guards read (the rest a placeholder, ``_Missing``), and a library's
    ``__setstate__`` that reads the rest (a graph library's layers rebuild their generated methods there) fails: the
    variant was never taken. The module unpickled here stands for the traced one while its guards are built; the
    guards are checked against the frame's own objects. Where this fails too, torch's error is raised."""
    try:
        return load_guards_state(data)
    except Exception as exc:  # noqa: BLE001 - retried below; torch's own error where that fails too
        failed = exc
    import torch

    python_unpickler: Any = pickle._Unpickler  # the Python one: its BUILD can be replaced

    class PlainModules(python_unpickler):  # type: ignore[misc]
        dispatch: dict[int, Any] = dict(python_unpickler.dispatch)

        def load_build(self) -> None:
            inst = self.stack[-2]
            module_setstate: Any = torch.nn.Module.__setstate__
            if isinstance(inst, torch.nn.Module) and type(inst).__setstate__ is not module_setstate:
                module_setstate(inst, self.stack.pop())
                return
            python_unpickler.load_build(self)

        dispatch[pickle.BUILD[0]] = load_build

    try:
        return PlainModules(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001
        raise failed from None
