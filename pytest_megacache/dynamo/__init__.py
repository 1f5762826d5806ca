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
import importlib
from typing import Any

from . import repairs
from .backends import (
    backends_recorded_once,
    backends_recorded_where_written,
    eager_graphs_stored,
)
from .backwards import installed as backwards_installed
from .context import innermost_backend
from .effects import Trace, bookkeeping_quiet, code_key, watch_warnings
from .ledger import completing_seconds, cost_seconds, cost_spans, offered_seconds, spared_seconds, spared_tracing_seconds
from .merge import enterable_codes, holds_what_was_installed, merged_copies, packages_merged
from .merge import unchanged_since_installed as unchanged
from .objects import importable
from .offers import NEW, Offers, offers_kept
from .patches import PATCHES
from .proofs import (
    Stored,
    reason_of,
    relative_file,
    source_id,
    tag_of_test,
)
from .releases import CHECKED_RELEASES, MERGED_RELEASES, final_release, release_checked
from .shapes import watch_shapes

__all__ = ["CHECKED_RELEASES", "COUNTERS", "MERGED_RELEASES", "before_first_load", "completing_seconds",
           "cost_seconds", "cost_spans", "final_release", "install", "merged_copies", "offered_seconds", "refusal_reasons",
           "refused_frames", "release_checked", "set_test", "spared_seconds", "spared_tracing_seconds", "uninstall",
           "used_entries"]

# torch's modules that the wrappers patch or read besides those install() imports itself: imported first, so that
# reuse is installed whole or not at all (imported from inside another import of torch's own, one of them can fail
# half initialized, and the repair that reads it would be left out while caching precompile is on)
WRAPPED_MODULES = ("torch._dynamo.convert_frame", "torch._dynamo.output_graph",
                   "torch._functorch._aot_autograd.autograd_cache", "torch._functorch._aot_autograd.runtime_wrappers",
                   "torch._inductor.triton_bundler")
COUNTER_GROUP = "dynamo_reuse"
MAX_FRAMES = 200  # frames named with their refusal in a report
REFUSALS = ("code_changed", "collision", "unsupported_guard", "unsupported_backend", "unpicklable", "global_changed",
            "local_changed", "class_changed", "context_changed", "missing_module", "side_effect", "torch_error",
            "load_failed", "no_backend", "shapes_seen")
COUNTERS = ("dynamo_reused", "dynamo_frames_reused", "dynamo_traced", "dynamo_stored", "dynamo_backwards_compiled",
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
        self.frame: Any = None  # the code of the frame being offered stored variants or traced (None: none)
        self.frames: dict[str, list[str]] = {}  # per frame refused (frame_label), its reasons in the order first seen
        self.offers = Offers()
        # key -> the stored entry installed in this process; the stored variants whose proofs failed here (digests)
        self.loaded: dict[str, Any] = {}
        self.loaded_as: dict[str, Any] = {}  # per key, what the stored entry held when installed (entry_signature)
        self.stale: set[str] = set()
        self.contexts: list[str | None] = []  # the compile contexts of the frames being traced (innermost last)
        # id(code) -> code, function, stored entry, backends, the module missing when the function was wrapped
        self.deferred: dict[int, tuple[Any, Any, Any, Any, str]] = {}
        self.waiting: dict[tuple[str, int, str], str] = {}  # each code of a deferred entry: the module it waits for
        self.install_deferred: Any = lambda code, counted=True: None
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
        self.traced_for(reason)
        if reason not in self.reasons:
            from ..errors import redact_cut  # light: no torch

            self.reasons[reason] = redact_cut(detail, 200)

    def traced_for(self, reason: str, code: Any = None) -> None:
        """Name the frame being offered stored variants or traced with ``reason``, once (refused frames); or the
        frame of ``code``, with ``reason`` first: why none of its variants can be taken where it is traced again."""
        frame = self.frame if code is None else code
        if frame is not None and len(self.frames) < MAX_FRAMES:
            reasons = self.frames.setdefault(frame_label(frame, self.rootdir), [])
            if reason not in reasons:
                reasons.insert(len(reasons) if code is None else 0, reason)

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

        for name in WRAPPED_MODULES:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                pass  # not in this torch: what reuse wraps there is left as it is
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
    try:
        _wrap(state, torch, package, guards, bytecode_transformation, pgo)
    except Exception as exc:  # noqa: BLE001 - whole or not at all: torch's own pieces back, caching precompile off
        PATCHES.remove_all()
        return f"Dynamo reuse could not wrap torch's caching precompile: {type(exc).__name__}: {exc}"
    dynamo_config.caching_precompile = True
    _STATE = state
    bookkeeping_quiet()
    return None


def _wrap(state: _Reuse, torch: Any, package: Any, guards: Any, bytecode_transformation: Any, pgo: Any) -> None:
    from .guarding import guards_kept_whole  # here: a session that never installs reuse never imports them
    from .installing import installed_where_wrapped

    replace = PATCHES.replace
    CompilePackage = package.CompilePackage
    cache = package.DynamoCache

    # 1. Keys are the code.
    innermost_fn = torch._dynamo.eval_frame.innermost_fn
    replace(CompilePackage, "source_id_from_fn", staticmethod(lambda fn: source_id(innermost_fn(fn), state.rootdir)),
            "an entry's key is a digest of the function's module, path and code, not its qualname and first line")

    # 2. Guards stay whole (guarding).
    guards_kept_whole(state, torch, guards)
    compile_id = torch._guards.CompileContext.current_compile_id
    watch_warnings(state, compile_id, getattr(torch._dynamo.output_graph, "OutputGraph", None))
    watch_shapes(state, compile_id, pgo)
    eager_graphs_stored(getattr(torch._dynamo.output_graph, "OutputGraph", None), package, innermost_backend)
    stored_backends = backends_recorded_once(package.DynamoCache)

    # 3. Offered where Dynamo would trace, under the same compile (offers).
    offers_kept(state, torch, package, guards, bytecode_transformation)

    # 4. Per frame, fail open: loading and installing stored entries (installing).
    installed_where_wrapped(state, torch, package, bytecode_transformation)

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
    # With caching precompile torch bundles every AOTAutograd entry with its compiled code: a graph whose code is not
    # Inductor's output (an H100 training step: "expected OutputCode, got method") gets no entry instead of failing the
    # test, as without the option; a GPU graph loaded from Inductor's cache keeps its bundled kernels unlaunched.
    repairs.bundling_fails_open(state)
    repairs.bundled_kernels_left_unlaunched()
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

    # A forward-only graph gets its entry: its backward compiled where paid for (backwards).
    backwards_installed(torch, functools.partial(state.count, "dynamo_backwards_compiled"))

    # Saving: one entry that does not pickle costs that entry only.
    write = cache.write

    def write_each(entry: Any, path: str) -> None:
        try:
            codes = entry.dynamo.codes
            if state.side_effects and any(code_key(code.python_code) in state.side_effects for code in codes):
                return
            if not any(code.guarded_codes for code in enterable_codes(codes)):
                return  # no variant a later process could take (every one refused here): its backends alone
            if holds_what_was_installed(state, path, entry.dynamo):
                return  # what the stored entry held, once the variants without their graphs are left out
            # (an entry as it was installed never comes here: backends_recorded_where_written)
            write(repairs.module_texts_left_out(entry), path)
        except Exception as exc:  # noqa: BLE001
            state.refuse("unpicklable", f"{type(exc).__name__}: {exc}")

    replace(cache, "write", write_each, "one entry that does not pickle costs that entry only")


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


def refused_frames() -> dict[str, str]:
    """Each frame of this process that a refusal left traced (:func:`frame_label`), with its reasons."""
    return {frame: ", ".join(reasons) for frame, reasons in _STATE.frames.items()} if _STATE is not None else {}


def frame_label(code: Any, rootdir: str) -> str:
    """A frame's function and where it is defined, as a reader finds it: relative to the rootdir, or below the
    installed packages' folder (no other part of a path is kept)."""
    import os

    path = str(getattr(code, "co_filename", "?"))
    rel = relative_file(path, rootdir)
    if not rel:
        _, found, below = path.replace(os.sep, "/").rpartition("-packages/")
        rel = below if found else os.path.basename(path)
    return f"{getattr(code, 'co_name', '?')} ({rel}:{getattr(code, 'co_firstlineno', 0)})"


def refusal_reasons() -> dict[str, str]:
    """The first detail seen per refusal reason in this process."""
    return dict(_STATE.reasons) if _STATE is not None else {}

