"""What a stored frame's compiled graphs are, where torch's caching precompile stores none of its own (no torch
imported until :func:`eager_graphs_stored` runs).

- **Graphs of torch's ``eager`` backend.** torch stores a frame's compiled graph as the AOTAutograd entry that
  Inductor's compile bundled; ``backend="eager"`` (common in test suites: it checks what Dynamo traces without paying
  Inductor) compiles nothing, so no variant of such a frame had a backend to store and every one was traced again in
  every run. That backend's compiled graph *is* Dynamo's FX graph, run by its generated ``forward``: the graph is
  stored as torch's own ``EagerCacheArtifact`` holds one, and installed as its ``forward``, the callable the backend
  returned (calling the module would run global module hooks that the traced frame did not). Only where the compile
  asked for torch's ``eager`` function itself (a backend of a test's own that returns the graph may count or record
  what it is given: it must run), and where it pickles.
- **Graphs of ``torch._dynamo.explain``'s recorder.** explain traces with a backend of its own that records each graph
  it is given (the explanation's graphs, operations and graph breaks) and returns its ``forward``. Its graphs are
  stored as eager ones are (:class:`~.eager.ExplainedGraph`); where an explanation takes a stored frame, the graph
  is handed to that explanation's recorder as the trace would have handed it (:func:`made_ready`), and the guards
  stored with the frame to its ``guard_export_fn`` (:mod:`.offers`).
- **A graph torch runs with subclass dispatch off.** Where Dynamo inlined a ``__torch_function__`` (a tensor
  subclass's, or an object's such as a tensor container's), torch runs the compiled graph with tensor-subclass dispatch
  off (else a subclass would handle each operation twice), but records and installs the bare backend: the artifact
  torch recorded for it (now, or later: a training graph's once its backward ran) is stored wrapped, so that the graph
  is installed as torch ran it (without, an eager graph taken from the store gave another result than eager).
- **A stored entry's backends, recorded where it is written again** (:func:`backends_recorded_once`,
  :func:`backends_recorded_where_written`): torch records every backend of an entry it loads into its precompile
  context, a deep copy each, so that the entry can be written again with them at the session's end; on a GPU host
  that copying took as long as the entries' installs many times over (10.6 s of a warm run of 36 short cuda tests
  on an H100, every install copying every backend of its entry: torch's load reaches its loading through
  ``super()``). But an entry is written again only where this process traced a variant its stored copy lacks, and a warm
  run of a settled store writes none. A loaded backend is not recorded then: which stored entry holds it is noted, and
  where an entry that calls it is about to be written, that stored entry is read again and its backends recorded
  (torch's own load, as before). An entry that is what it was when installed is not made up for writing at all.
- **A stored entry's compiled graphs, made ready where a variant calling them is taken** (:func:`postponed`,
  :func:`made_ready`): torch deserializes every backend of an entry where it installs it (each ``torch.compile()``
  wrapper of the function installs it again), though a test takes one variant, or none; on a GPU each one loads its
  kernels. Each is installed as a stand-in that torch calls as it calls the backend, deserialized where the offer of
  a variant that calls it is taken (a failure there leaves that frame traced), or else where it is first called.
- **A graph torch dispatches between shape specializations** (:func:`wrapped_after_backend`): torch records the
  backend before that dispatcher; such a frame is not stored (``unsupported backend``), whatever its backend.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any

from .context import explain_recorder
from .ledger import LEDGER
from .patches import PATCHES

__all__ = ["backends_recorded_once", "backends_recorded_where_written", "calls_graphs", "eager_graphs_stored", "made_ready",
           "postponed", "wrapped_after_backend"]

# graphs torch's eager backend or explain's recorder returned as they were: which of the two
_EAGER_GRAPHS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_LAST = threading.local()  # the graph just compiled: run with subclass dispatch off? (torch names it right after)
_DISPATCH_OFF: set[str] = set()  # backends of this process that torch runs with subclass dispatch off


def wrapped_after_backend(output_graph: Any) -> bool:
    """Whether torch dispatches the frame's compiled graphs between shape specializations (see above)."""
    shape_env = getattr(getattr(getattr(output_graph, "tracing_context", None), "fake_mode", None), "shape_env", None)
    return bool(getattr(shape_env, "specializations", None))


def _graph_kind(compiler_fn: Any, innermost_backend: Any) -> str | None:
    """"eager" for torch's ``eager`` backend, "explain" for explain's recorder, else None."""
    from torch._dynamo.backends.debugging import eager

    backend = innermost_backend(compiler_fn)
    if type(backend).__name__ == "_TorchCompileWrapper":
        backend = getattr(backend, "compiler_fn", None)
    return "eager" if backend is eager else "explain" if explain_recorder(backend) else None


def eager_graphs_stored(output_graph: Any, package: Any, innermost_backend: Any) -> None:
    """Records the graph of each compile by torch's ``eager`` backend or explain's recorder as the backend torch
    stores with the frame (``package.CompilePackage.add_backend_id`` is where torch names a frame's compiled graph; it
    is called only under caching precompile)."""
    from torch._dynamo.precompile_context import PrecompileContext

    from .eager import DispatchOff, ExplainedGraph, GraphForward, explained_content, graph_bytes

    call_user_compiler = getattr(output_graph, "call_user_compiler", None)
    add_backend_id = getattr(getattr(package, "CompilePackage", None), "add_backend_id", None)
    if call_user_compiler is None or add_backend_id is None or getattr(add_backend_id, "_megacache_eager", False):
        return

    @functools.wraps(call_user_compiler)
    def compiled_by(self: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = call_user_compiler(self, gm, *args, **kwargs)
        _LAST.dispatch_off = bool(getattr(self, "torch_function_subclass_inlined", False))
        try:
            if (getattr(compiled, "__self__", None) is gm and not getattr(self, "export", False)
                    and (kind := _graph_kind(self.compiler_fn, innermost_backend)) is not None):
                _EAGER_GRAPHS[gm] = kind
        except Exception:  # noqa: BLE001 - a graph not recorded is a variant not stored
            pass
        return compiled

    @functools.wraps(add_backend_id)
    def named(self: Any, backend_id: str, backend: Any = None) -> None:
        add_backend_id(self, backend_id, backend)
        dispatch_off, _LAST.dispatch_off = getattr(_LAST, "dispatch_off", False), False
        gm = getattr(backend, "__self__", None)
        try:
            if gm is not None and (kind := _EAGER_GRAPHS.get(gm)) is not None:
                # one that does not store is not recorded: only its variant is not stored
                artifact = (ExplainedGraph(key=backend_id, content=explained_content(gm)) if kind == "explain"
                            else GraphForward(key=backend_id, content=graph_bytes(gm)))
                PrecompileContext.record_artifact(artifact)
        except Exception:  # noqa: BLE001
            pass
        if dispatch_off:
            _DISPATCH_OFF.add(str(backend_id))

    def as_run(backends: Any) -> Any:
        """The backends as torch ran them, where torch writes an entry with them."""
        if not _DISPATCH_OFF.intersection(map(str, backends)):
            return backends
        try:
            return {k: DispatchOff(key=k, content=v) if str(k) in _DISPATCH_OFF and not isinstance(v, DispatchOff)
                    else v for k, v in backends.items()}
        except Exception:  # noqa: BLE001 - never written bare: left out, their variants are not stored
            return {k: v for k, v in backends.items() if str(k) not in _DISPATCH_OFF}

    entry_class = package.PrecompileCacheEntry
    from_cache_entry = entry_class.from_cache_entry

    @functools.wraps(from_cache_entry)
    def written_as_run(cache_entry: Any, backends: Any, *args: Any, **kwargs: Any) -> Any:
        return from_cache_entry(cache_entry, as_run(backends), *args, **kwargs)

    serialize = PrecompileContext.serialize_artifact_by_key

    @functools.wraps(serialize)
    def serialized(key: str) -> Any:
        return as_run({key: artifact})[key] if (artifact := serialize(key)) is not None else None

    named._megacache_eager = True  # type: ignore[attr-defined]
    PATCHES.replace(output_graph, "call_user_compiler", compiled_by, "a graph torch's eager backend returned is noted")
    PATCHES.replace(package.CompilePackage, "add_backend_id", named,
                    "a graph of torch's eager backend is recorded as the backend stored with its frame")
    PATCHES.replace(entry_class, "from_cache_entry", staticmethod(written_as_run),
                    "a graph torch runs with subclass dispatch off is written as it ran")
    PATCHES.replace(PrecompileContext, "serialize_artifact_by_key", staticmethod(serialized),
                    "a graph torch runs with subclass dispatch off is serialized as it ran")


class StoredBackends:
    """Which stored entry holds each backend loaded but not recorded (:func:`backends_recorded_once`), and torch's
    own load of an entry, which records its backends (:meth:`record`)."""

    def __init__(self, load_cache_entry: Any) -> None:
        self.load_cache_entry = load_cache_entry
        self.held_by: dict[str, str] = {}  # backend id -> the key of the stored entry it was loaded from
        self.lock = threading.Lock()

    def record(self, backend_ids: Any, recorded: Any) -> None:
        """Record the backends of ``backend_ids`` that ``recorded`` (torch's record of backends by id) lacks, from the
        stored entries they were loaded from: each such entry is read again by torch, which records its backends."""
        with self.lock:
            keys = {self.held_by.pop(str(backend_id), None) for backend_id in backend_ids
                    if backend_id not in recorded}
        for key in sorted(k for k in keys if k is not None):
            self.load_cache_entry(key)


def backends_recorded_once(cache: Any) -> StoredBackends:
    """Where ``cache`` (torch's ``DynamoCache``) loads an entry, none of its backends is recorded (deep-copied): which
    stored entry holds each is noted in what is returned, for :func:`backends_recorded_where_written` (see above)."""
    from torch._dynamo.precompile_context import PrecompileContext

    # torch's load reaches it through super() (DiskDynamoCache.load): it is wrapped where it is defined
    owner = next(c for c in type(cache).__mro__ if "load_cache_entry" in vars(c))
    load_cache_entry = vars(owner)["load_cache_entry"]
    record = PrecompileContext.record_artifact
    loading = threading.local()
    stored = StoredBackends(functools.partial(load_cache_entry, cache))

    @functools.wraps(load_cache_entry)
    def load_lazily(self: Any, key: str) -> Any:
        loading.key = key
        try:
            return load_cache_entry(self, key)
        finally:
            loading.key = None

    @functools.wraps(record)
    def record_once(artifact: Any) -> None:
        key = getattr(loading, "key", None)
        if key is None:
            record(artifact)
        elif PrecompileContext.serialize_artifact_by_key(artifact.key) is None:
            with stored.lock:
                stored.held_by[str(artifact.key)] = str(key)

    PATCHES.replace(owner, "load_cache_entry", load_lazily, "a loaded entry's backends are noted, not deep-copied")
    PATCHES.replace(PrecompileContext, "record_artifact", staticmethod(record_once),
                    "a loaded entry's backends are recorded only where an entry calling them is written")
    return stored


def backends_recorded_where_written(package: Any, stored: StoredBackends, unchanged: Any) -> None:
    """Where torch makes up an entry for writing at the session's end (``PrecompileCacheEntry.from_cache_entry``, with
    its record of backends by id): one that ``unchanged`` says is as it was installed is not made up (torch writes
    nothing for it), and for any other the backends it calls that were loaded but not recorded are recorded first
    (:meth:`StoredBackends.record`). Wrap it last: every other wrapper of it gets the backends."""
    entry_class = package.PrecompileCacheEntry
    from_cache_entry = entry_class.from_cache_entry

    @functools.wraps(from_cache_entry)
    def with_stored_backends(cache_entry: Any, backends: Any, *args: Any, **kwargs: Any) -> Any:
        if unchanged(cache_entry):
            return None
        try:
            stored.record(cache_entry.backend_ids, backends)
        except Exception:  # noqa: BLE001 - a stored entry gone or unreadable: not written, the stored one stays
            return None
        return from_cache_entry(cache_entry, backends, *args, **kwargs)

    PATCHES.replace(entry_class, "from_cache_entry", staticmethod(with_stored_backends),
                    "an entry as it was installed is not written again; another first gets the stored backends it calls")


class Deferred:
    """A stored backend as torch installs it (its ``after_deserialization()``, called once, where first needed)."""

    __slots__ = ("artifact", "fn", "lock")

    def __init__(self, artifact: Any) -> None:
        self.artifact: Any = artifact
        self.fn: Any = None
        self.lock = threading.Lock()

    def ready(self) -> Any:
        if self.fn is None:
            with self.lock, LEDGER.spending():  # inside an offer: the offer's time
                if self.fn is None:
                    started = time.perf_counter()
                    try:
                        self.fn = self.artifact.after_deserialization()
                        self.artifact = None
                    finally:
                        LEDGER.loading += time.perf_counter() - started
        return self.fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.fn or self.ready())(*args, **kwargs)


class _Postponed:
    """A stored backend handed to torch's install, whose deserialization is what torch installs: a :class:`Deferred`."""

    __slots__ = ("artifact",)

    def __init__(self, artifact: Any) -> None:
        self.artifact = artifact

    def after_deserialization(self) -> Deferred:
        return Deferred(self.artifact)


def postponed(backends: Any) -> Any:
    """The backends an entry is installed with (torch's ``CompilePackage.install``), each deserialized where first
    needed (see above); anything but a dict as it is."""
    if not isinstance(backends, dict):
        return backends
    return {k: v if isinstance(v, _Postponed) or not hasattr(v, "after_deserialization") else _Postponed(v)
            for k, v in backends.items()}


def made_ready(code: Any, scope: dict[str, Any]) -> list[Any]:
    """The stored backends that ``code`` (a variant's output code) calls by name in ``scope``, deserialized now; the
    graphs of explain's recorder among them, in the order the code calls them (to hand to the recorder of the
    explanation taking the variant: ``handed``)."""
    explained = []
    for name in _graph_names(code):
        deferred = getattr(scope.get(name), "_torchdynamo_orig_callable", None)
        if isinstance(deferred, Deferred):
            fn = deferred.ready()
            # an explain graph (eager.Explained), or one run with subclass dispatch off that wraps it
            if (graph := fn if hasattr(fn, "handed") else getattr(fn, "explained", None)) is not None:
                explained.append(graph)
    return explained


def _graph_names(code: Any) -> list[str]:
    """The names of the compiled graphs ``code`` (a variant's output code) calls, in order (torch's ``__compiled_fn``)."""
    return [name for name in getattr(code, "co_names", ()) if isinstance(name, str) and name.startswith("__compiled_fn")]


def calls_graphs(code: Any) -> bool:
    """Whether ``code`` (a variant's output code) calls a compiled graph: a frame whose graph was empty calls none."""
    return bool(_graph_names(code))
