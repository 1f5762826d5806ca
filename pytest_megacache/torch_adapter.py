"""The only module that touches torch, and only once the session has started compiling.

Importing torch's compiler stack costs seconds, so nothing here imports torch eagerly. A post-import hook
waits for ``torch._dynamo`` (which every ``torch.compile`` goes through) and registers a compile-start
callback; the first compile of the session calls ``on_first_compile`` (which joins the restore and loads
the bundle) before torch looks anything up in its caches. ``torch._dynamo.reset()`` drops callbacks, so
:meth:`TorchAdapter.ensure_registered` puts ours back (the plugin calls it before each test).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from . import dynamo, torchfmt
from .errors import BundleError, redact_cut
from .importhook import PostImportHook as PostImportHook  # re-exported: the roles and report.triton import it here
from .patches import PATCHES

COUNTER_NAMES = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    # autograd_cache_saved: entries written; a miss that is never saved had a backward that never ran.
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass", "autograd_cache_guard_miss",
                     "autograd_cache_saved"),
    "dynamo_cache": ("dynamo_cache_hit", "dynamo_cache_miss"),
    # --megacache-precompile: Dynamo's work reused, traced, stored and refused per frame (dynamo)
    "dynamo_reuse": dynamo.COUNTERS,
}
# Counters that mean "this test compiled something the cache did not have", and their hit twins.
MISS_COUNTERS = ("fxgraph_cache_miss", "autograd_cache_miss")
HIT_COUNTERS = ("fxgraph_cache_hit", "autograd_cache_hit")


def counter_sum(counters: dict[str, int], names: tuple[str, ...]) -> int:
    return sum(counters.get(name, 0) for name in names)


@dataclass
class CompileRecord:
    """What one test compiled: seconds in Dynamo/Inductor, frames, counter deltas, artifacts it recorded."""

    seconds: float = 0.0
    compiles: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    artifacts: list[tuple[str, str]] = field(default_factory=list)
    # of the seconds, what torch's metrics give the backend (AOTAutograd and Inductor, forward and backward): what a
    # hit on the cached graphs spares; None where torch keeps no metrics
    backend: float | None = None

    @property
    def misses(self) -> int:
        return counter_sum(self.counters, MISS_COUNTERS)


class _SurvivesReset(list[Any]):
    """torch's callback list, except that ``clear()`` (what ``torch._dynamo.reset()`` calls) keeps the plugin's
    own callbacks. Nothing else changes: the user's callbacks are cleared as before, and torch iterates,
    appends and removes as on any list."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.keep: set[Any] = set()

    def clear(self) -> None:
        kept = [cb for cb in self if cb in self.keep]
        super().clear()
        self.extend(kept)

    def hand_back(self, theirs: list[Any]) -> None:
        """The callbacks registered meanwhile into torch's own list, before it is put back."""
        theirs[:] = self


@dataclass
class LoadResult:
    ok: bool
    artifacts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


class TorchAdapter:
    def __init__(self, on_first_compile: Callable[[], None]) -> None:
        self._on_first_compile = on_first_compile
        self._hook: PostImportHook | None = None
        self._lock = threading.Lock()
        self.first_compile_seen = False
        self.compiles = 0
        self.compile_seconds = 0.0
        self._started: float | None = None
        self.per_test: dict[str, CompileRecord] = {}
        self._test: tuple[str, float, int, dict[str, int], int, int, float] | None = None
        self._absorbed = 0  # compiles counted when torch's metrics were last read
        # this process's, since an earlier session in it (pytester)
        self.spared_before, self.cost_before = dynamo.spared_seconds(), dynamo.cost_seconds()
        self.tracing_before = dynamo.spared_tracing_seconds()
        self.completing_before = dynamo.completing_seconds()
        self.metrics_kept = False  # torch keeps per-frame metrics (absorb_metrics read them)
        # torch's own split of the compile seconds (its per-frame compilation metrics), summed as they come
        self.split = {"dynamo": 0.0, "backend": 0.0, "backward": 0.0}
        self.import_spans: list[tuple[float, float]] = []  # torch's and torch._dynamo's imports, when a hook saw them
        self._last_metric: Any = None

    # --- lifecycle -------------------------------------------------------------------------------
    def install(self) -> None:
        """Register now if torch._dynamo is already imported, else when it is."""
        if "torch._dynamo" in sys.modules:
            self._register(sys.modules["torch._dynamo"])
        elif self._hook is None:
            self._hook = PostImportHook("torch._dynamo", self._register, self.import_spans)
            sys.meta_path.insert(0, self._hook)

    def ensure_registered(self) -> None:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            self._register(dynamo)

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        dynamo = sys.modules.get("torch._dynamo")
        handler = getattr(getattr(dynamo, "callback", None), "callback_handler", None)
        if handler is not None:
            for lst, cb in ((handler.start_callbacks, self._on_start), (handler.end_callbacks, self._on_end)):
                if isinstance(lst, _SurvivesReset):
                    lst.keep.discard(cb)
                while cb in lst:
                    lst.remove(cb)

    def _register(self, dynamo: ModuleType) -> None:
        handler = getattr(getattr(dynamo, "callback", None), "callback_handler", None)
        if handler is None:
            return
        for attr, ours in (("start_callbacks", self._on_start), ("end_callbacks", self._on_end)):
            callbacks = getattr(handler, attr, None)
            if not isinstance(callbacks, list):
                continue
            if not isinstance(callbacks, _SurvivesReset):
                # torch._dynamo.reset() clears the callback lists; a test that resets in its own body (or in a
                # unittest setUp) would then compile without us: ours survive the clear, the user's do not.
                callbacks = _SurvivesReset(callbacks)
                PATCHES.replace(handler, attr, callbacks, "the plugin's compile callbacks survive torch._dynamo.reset()",
                                callbacks.hand_back)
            callbacks.keep.add(ours)
            if ours not in callbacks:
                callbacks.append(ours)

    def _on_start(self, *args: Any) -> None:
        # torch 2.7 calls compile-start callbacks without arguments; 2.8 and later pass one. Nothing may escape
        # into torch: 2.7 counts pending callbacks, and a start callback that raises fails every later compile.
        try:
            self.compiles += 1
            with self._lock:
                first = not self.first_compile_seen
                self.first_compile_seen = True
            if first:
                self._on_first_compile()
            self._started = time.perf_counter()
        except Exception:  # noqa: BLE001 - on_first_compile contains its own faults; this is the last line
            self._started = None

    def _on_end(self, *args: Any) -> None:
        if self._started is not None:
            self.compile_seconds += time.perf_counter() - self._started
            self._started = None

    # --- torch's own timings ---------------------------------------------------------------------
    def absorb_metrics(self) -> None:
        """Add the frames torch recorded since the last call to :attr:`split`: per forward frame, Dynamo's own
        seconds (the frame's compile minus its backend call) and the backend's (AOTAutograd and Inductor); per
        lazily compiled backward, its seconds. torch keeps the last 64 records (a ring): called after every
        test, so a test that compiles more than that loses the oldest. Read-only; best effort (private API)."""
        get = getattr(sys.modules.get("torch._dynamo.utils"), "get_compilation_metrics", None)
        if get is None:
            return
        self.metrics_kept, self._absorbed = True, self.compiles
        try:
            records = list(get())
            start = 0
            last = self._last_metric
            if last is not None:
                for i in range(len(records) - 1, -1, -1):
                    if records[i] is last:
                        start = i + 1
                        break
                else:  # the last one counted left the ring: what started after it is new
                    since = getattr(last, "start_time_us", None) or 0
                    start = next((i for i, r in enumerate(records) if (getattr(r, "start_time_us", None) or 0) > since),
                                 len(records))
            for record in records[start:]:
                if getattr(record, "is_forward", True) is False:
                    self.split["backward"] += (getattr(record, "duration_us", None) or 0) / 1e6
                    continue
                frame = getattr(record, "entire_frame_compile_time_s", None) or 0.0
                backend = getattr(record, "backend_compile_time_s", None) or 0.0
                self.split["dynamo"] += max(0.0, frame - backend)
                self.split["backend"] += backend
            if records:
                self._last_metric = records[-1]
        except Exception:  # noqa: BLE001 - a timing breakdown must never cost a session
            return

    # --- per-test attribution --------------------------------------------------------------------
    def begin_test(self, nodeid: str) -> None:
        if self.compiles != self._absorbed:  # compiled between tests (a fixture, an import): not this test's
            self.absorb_metrics()
        self._test = (nodeid, self.compile_seconds, self.compiles, self.counters(), len(self._seen_set()),
                      len(self._installed()), self._backend_seconds())
        dynamo.set_test(nodeid)  # what a test traces keeps its tag (no-op without Dynamo reuse)

    def end_test(self) -> None:
        dynamo.set_test(None)
        if self._test is None:
            return
        nodeid, seconds, compiles, counters, seen, installed, backend = self._test
        self._test = None
        if self.compiles != compiles:  # torch's ring of metrics holds 64 frames: read it after each test that compiled
            self.absorb_metrics()
        if self.compiles == compiles and not self.first_compile_seen:
            return
        after = self.counters()
        delta = {k: v - counters.get(k, 0) for k, v in after.items() if v != counters.get(k, 0)}
        if self.compiles == compiles and not delta:
            return
        record = self.per_test.setdefault(nodeid, CompileRecord())
        record.seconds += self.compile_seconds - seconds
        if self.metrics_kept:
            record.backend = (record.backend or 0.0) + max(0.0, self._backend_seconds() - backend)
        record.compiles += self.compiles - compiles
        for k, v in delta.items():
            record.counters[k] = record.counters.get(k, 0) + v
        record.artifacts.extend(self._seen()[seen:])
        record.artifacts.extend(("precompile", key) for key in self._installed()[installed:])

    def _backend_seconds(self) -> float:
        return self.split["backend"] + self.split["backward"]

    @staticmethod
    def _seen_set() -> Any:
        """torch's ordered set of the artifacts it recorded so far (private API; () if it moved)."""
        cache = sys.modules.get("torch.compiler._cache")
        return getattr(getattr(cache, "CacheArtifactManager", None), "_seen_artifacts", None) or ()

    @classmethod
    def seen_artifacts(cls) -> list[tuple[str, str]]:
        """(type, key) of every artifact torch recorded in this process so far (none where torch is not imported),
        and of every stored Dynamo entry installed (Dynamo reuse)."""
        return cls._seen() + [("precompile", key) for key in cls._installed()]

    @staticmethod
    def _installed() -> list[str]:
        """The keys of the stored Dynamo entries installed in this process so far (none without Dynamo reuse)."""
        return dynamo.used_entries()

    @classmethod
    def _seen(cls) -> list[tuple[str, str]]:
        """(type, key) of every artifact torch recorded so far."""
        seen = cls._seen_set()
        out = []
        try:
            for artifact in list(seen):
                kind = artifact.type  # a method from torch 2.8 on; torch 2.7's field holds an enum member
                out.append((str(kind() if callable(kind) else kind.name.lower()), str(artifact.key)))
        except Exception:  # noqa: BLE001 - attribution is best effort
            return []
        return out

    # --- knobs -----------------------------------------------------------------------------------
    @staticmethod
    def single_compile_thread(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
        """One Inductor compile thread (no subprocess pool) unless the user chose; True if we set it.

        Called on the first compile, before Inductor warms its pool (``maybe_warm_pool`` runs when the
        inductor backend is first called, after Dynamo's compile-start callbacks)."""
        if "TORCHINDUCTOR_COMPILE_THREADS" in env:
            return False
        try:
            import torch._inductor.config as inductor_config
        except Exception:  # noqa: BLE001
            return False
        PATCHES.replace(inductor_config, "compile_threads", 1,
                        "one Inductor compile thread: the restored cache covers this selection, a pool would only start")
        return True

    @staticmethod
    def _switch_on(module: str, flag: str, why: str) -> str | None:
        """Set the torch config flag ``module.flag`` to True, for the reason ``why``; None when done, else why not."""
        try:
            config = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            return f"{module} did not import: {exc}"
        if not hasattr(config, flag):
            return f"this torch has no {flag}"
        PATCHES.replace(config, flag, True, why)
        return None

    @staticmethod
    def enable_precompile(rootdir: str, any_backend: bool = False) -> str | None:
        """Turn on Dynamo reuse (torch's caching precompile behind :mod:`.dynamo`'s checks), for torch's own backends
        only unless ``any_backend``; None when done, else why not."""
        return dynamo.install(rootdir, any_backend)

    @staticmethod
    def enable_eager_backward() -> str | None:
        """Compile AOTAutograd backwards with their forwards (the opt-in that makes forward-only graphs storable:
        torch saves an AOTAutograd entry only once its backward is compiled); None when done, else why not."""
        return TorchAdapter._switch_on("torch._functorch.config", "force_non_lazy_backward_lowering",
                                       "--megacache-eager-backward: backwards compiled with their forwards")

    @staticmethod
    def save() -> bytes | None:
        """What this process compiled or hit, as a torch container (None when nothing): :meth:`MegaCache.save`."""
        return MegaCache.save()

    def compiled_anything(self) -> bool:
        return self.first_compile_seen or any(self.counters().values())

    @staticmethod
    def counters() -> dict[str, int]:
        """torch's own cache counters (hits, misses, bypasses per layer); empty when torch never compiled."""
        utils = sys.modules.get("torch._dynamo.utils")
        counters = getattr(utils, "counters", None)
        if counters is None:
            return {}
        out = {}
        for group, names in COUNTER_NAMES.items():
            for name in names:
                out[name] = int(counters[group][name]) if group in counters else 0
        return out


class MegaCache:
    """torch's cache API (``torch.compiler.load_cache_artifacts`` / ``save_cache_artifacts``): a validated container
    loaded in the layout the imported torch reads, and what this process compiled saved as one."""

    @staticmethod
    def container_layout() -> str | None:
        """The container layout the imported torch reads and writes (:data:`torchfmt.SECTIONS` from torch 2.8
        on, :data:`torchfmt.RECORDS` in 2.7), or None for a form this module does not know. Private API, read
        only: torch's serializer has a checksum from 2.8 on, and 2.7 numbers its artifact types with an enum."""
        serializer = sys.modules.get("torch.utils._appending_byte_serializer")
        cache = sys.modules.get("torch.compiler._cache")
        if serializer is None or cache is None:
            return None
        if hasattr(serializer, "CHECKSUM_DIGEST_SIZE"):
            return torchfmt.SECTIONS if hasattr(cache, "CacheArtifactFactory") else None
        try:
            codes = {member.name.lower(): int(member.value) for member in getattr(cache, "CacheArtifactType", ())}
        except Exception:  # noqa: BLE001 - another form
            return None
        return torchfmt.RECORDS if codes == torchfmt.RECORD_TYPE_CODES else None

    @staticmethod
    def loaded_counts(info: Any) -> dict[str, int]:
        """Keys loaded per type, from torch's CacheInfo (a dict of lists from torch 2.8 on, a list per type in 2.7)."""
        artifacts = getattr(info, "artifacts", None)
        if isinstance(artifacts, dict):
            return {str(k): len(v) for k, v in artifacts.items()}
        out = {}
        for name in torchfmt.RECORD_TYPE_CODES:
            keys = getattr(info, f"{name}_artifacts", None)
            if keys:
                out[name] = len(keys)
        return out

    @staticmethod
    def load(container: bytes) -> LoadResult:
        """``torch.compiler.load_cache_artifacts`` on a container that :mod:`torchfmt` already validated (in the
        ``sections`` layout), rewritten in the layout this torch reads."""
        start = time.perf_counter()
        try:
            import torch._dynamo  # torch 2.7 needs it imported first: pytorch/pytorch#154463
            import torch.compiler
            import torch.compiler._cache  # what load_cache_artifacts imports: its layout is read below

            layout = MegaCache.container_layout()
            if layout is None:
                return LoadResult(False, seconds=time.perf_counter() - start,
                                  error="this torch's cache container has another form: nothing loaded")
            if layout != torchfmt.layout_of(container):
                container = torchfmt.serialize(torchfmt.parse(container), layout)
            info = torch.compiler.load_cache_artifacts(container)
            loaded = None if info is None else MegaCache.loaded_counts(info)
        except BundleError as exc:
            return LoadResult(False, seconds=time.perf_counter() - start, error=redact_cut(str(exc)))
        except Exception as exc:  # noqa: BLE001 - any failure means a cold run, never a failed session
            return LoadResult(False, seconds=time.perf_counter() - start, error=redact_cut(f"{type(exc).__name__}: {exc}"))
        seconds = time.perf_counter() - start
        if loaded is None:
            return LoadResult(False, seconds=seconds, error="torch.compiler.load_cache_artifacts returned None")
        return LoadResult(True, loaded, seconds)

    @staticmethod
    def save() -> bytes | None:
        """What this process compiled or hit, as a torch container (None when nothing)."""
        if "torch._dynamo" not in sys.modules:
            return None
        import torch.compiler

        result = torch.compiler.save_cache_artifacts()
        return None if result is None else result[0]
