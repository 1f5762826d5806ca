"""Backwards that no test has run yet, compiled where torch makes their lazy compiler, so that torch stores their
graphs: paid from what reuse spared.

torch stores an AOTAutograd entry for a graph whose inputs require grad only once its backward is compiled, and it
compiles a backward lazily, where a test first calls ``backward()``. A graph whose tests only run its forward is so
compiled again in every run, and its frame traced again with it (a frame is taken from the store only with its
compiled graphs). Here, where torch has compiled such a forward and made its lazy compiler (before the forward first
runs: torch cannot store a graph whose kernels have run, "pickle should not be called after make_launchers()"), the
backward is compiled through torch's own lazy compiler, as torch compiles it at a first ``backward()`` that keeps
its graph (no buffers donated: the entry torch itself stores for that key where a first backward keeps its graph,
which serves a later backward of either kind), and torch's callback saves the entry. The forward, what the test
runs, is not touched. What a test can see of the compile is put back (the random generators' states, torch's
counters) or kept from it (warnings). Only graphs whose inputs have fixed shapes and whose tensors are all on the
CPU or on CUDA GPUs (:data:`CHECKED_DEVICES`, where this was checked) are compiled here; the others as torch compiles
them.

Paid from what reuse spared: a backward is compiled only while half the tracing spared by the variants taken from
the store in this process (each records its trace's seconds without its backend's compile; half, as a first trace
in a process runs slower than a later one) exceeds what reuse cost and what the backwards compiled so far took.
Deserializing the stored compiled graphs is left out of that cost: a run without reuse loads the same graphs, in the
backend's cache hits of the frames it traces again (on a GPU, loading their kernels is most of reuse's own time). A
run with reuse is so not slower than one without for it (but by the one compile that overdraws), and a cold run,
which takes nothing, compiles none: the backwards are compiled over the next warm runs, and their graphs stored then
are taken after.

On the releases whose lazy compiler is an object of its own (``_AutogradBackwardCompiler.get_or_compile``), that
object compiles it; on torch 2.11, whose autograd function compiles its backward inline, :class:`InlineBackward`
does what that code does before a first backward, with the same pieces of torch (other releases: none compiled).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

from .ledger import LEDGER
from .patches import PATCHES

__all__ = ["CHECKED_DEVICES", "InlineBackward", "budget", "compiled_where_paid", "installed", "lazy_backwards_recorded"]


def budget() -> float:
    """The seconds left to compile backwards in: half the tracing that reuse spared here, less what reuse cost (but
    the stored graphs it deserialized, which a run without reuse loads too, in the backend's cache hits) and what the
    backwards compiled so far took."""
    return LEDGER.spared_tracing / 2 - (LEDGER.cost() - LEDGER.loading) - LEDGER.completing


def _waiting(lazy: Any, lazy_info: Any, compiled_bw: Any, save: Any, bw_compiler: Any) -> bool:
    """Whether a lazy backward is one to compile here: not compiled, torch's callback to save its entry there, and
    not a graph of DDP's buckets (their backwards are compiled in the reverse order of their forwards)."""
    return (compiled_bw is None and save is not None and bw_compiler is not None and isinstance(lazy, lazy_info)
            and getattr(getattr(lazy, "saved_context", None), "ddp_optimizer_ctx", None) is None)


def installed(torch: Any, counted: Callable[[], None]) -> bool:
    """:func:`lazy_backwards_recorded` on torch's runtime wrappers; False where that fails (their graphs are then
    compiled again in each run, as before)."""
    try:
        wrappers = importlib.import_module("torch._functorch._aot_autograd.runtime_wrappers")
        return lazy_backwards_recorded(torch, wrappers, counted)
    except Exception:  # noqa: BLE001
        return False


def lazy_backwards_recorded(torch: Any, runtime_wrappers: Any, counted: Callable[[], None]) -> bool:
    """Each lazy backward torch makes without a compiled backward, and with its callback that saves the entry,
    compiled there as far as reuse has paid for it (``counted()`` after each); False where this release's lazy
    compile has another form."""
    compiler_class = getattr(runtime_wrappers, "_AutogradBackwardCompiler", None)
    lazy_info = getattr(runtime_wrappers, "AutogradLazyBackwardCompileInfo", None)
    if lazy_info is None:
        return False
    if compiler_class is not None and callable(getattr(compiler_class, "get_or_compile", None)):
        made = compiler_class.__init__

        def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
            made(self, *args, **kwargs)
            if _waiting(self.lazy_backward_info, lazy_info, self.compiled_bw, self.try_save_cache_entry,
                        self.bw_compiler):
                compiled_where_paid(torch, self, counted)

        PATCHES.replace(compiler_class, "__init__", recorded, WHY)
        return True
    return str(torch.__version__).startswith("2.11.") and _inline_recorded(torch, runtime_wrappers, lazy_info, counted)


WHY = "lazy backwards recorded: a backward no test has run is compiled where torch makes its lazy compiler, its graph stored"
# what torch 2.11's autograd function uses to compile its backward inline (runtime_wrappers's names)
INLINE_NAMES = ("tracing", "compile_context", "track_graph_compiling", "get_metrics_context", "dynamo_timed",
                "callback_handler", "CallbackTrigger", "CompileEventLogger", "CompileContext")


def _inline_recorded(torch: Any, runtime_wrappers: Any, lazy_info: Any, counted: Callable[[], None]) -> bool:
    dispatch = getattr(runtime_wrappers, "AOTDispatchAutograd", None)
    post_compile = getattr(dispatch, "post_compile", None)
    if not callable(post_compile):
        return False
    try:
        signature = inspect.signature(post_compile)
    except (TypeError, ValueError):
        return False
    needed = {"compiled_bw_func", "disable_amp", "lazy_backward_info", "aot_config", "fw_metadata",
              "try_save_cache_entry"}
    if not needed <= set(signature.parameters) or not all(hasattr(runtime_wrappers, n) for n in INLINE_NAMES):
        return False

    def recorded(*args: Any, **kwargs: Any) -> Any:
        compiled = post_compile(*args, **kwargs)
        try:
            given = signature.bind(*args, **kwargs).arguments
            config = given["aot_config"]
            waiting = _waiting(given["lazy_backward_info"], lazy_info, given["compiled_bw_func"],
                               given["try_save_cache_entry"], getattr(config, "bw_compiler", None))
        except Exception:  # noqa: BLE001 - not compiled here: where a test calls backward(), as before
            return compiled
        if waiting:
            compiled_where_paid(torch, InlineBackward(
                torch, runtime_wrappers, given["lazy_backward_info"], config, given["fw_metadata"],
                given["try_save_cache_entry"], bool(given["disable_amp"])), counted)
        return compiled

    PATCHES.replace(dispatch, "post_compile", staticmethod(recorded), WHY)
    return True


class InlineBackward:
    """A lazy backward of torch 2.11, whose autograd function compiles it inline at a first ``backward()``: what that
    code does there for a backward that keeps its graph, done with the same pieces of torch. The function keeps its
    own compiler (a ``backward()`` in this process compiles it again, as it would have: Inductor's cache hits); the
    entry saved is the same."""

    __slots__ = ("aot_config", "compiled_bw", "disable_amp", "fw_metadata", "lazy", "save", "torch", "wrappers")

    def __init__(self, torch: Any, wrappers: Any, lazy: Any, aot_config: Any, fw_metadata: Any, save: Any,
                 disable_amp: bool) -> None:
        self.torch, self.wrappers, self.lazy, self.aot_config = torch, wrappers, lazy, aot_config
        self.fw_metadata, self.save, self.disable_amp = fw_metadata, save, disable_amp
        self.compiled_bw: Any = None

    @property
    def lazy_backward_info(self) -> Any:
        return self.lazy

    def get_or_compile(self, *, saved_tensors_use_once: bool) -> Any:
        if self.compiled_bw is not None:
            return self.compiled_bw
        if saved_tensors_use_once:
            raise ValueError("only a backward that keeps its graph is compiled here")
        w, lazy = self.wrappers, self.lazy
        self.fw_metadata.bw_donated_idxs = []  # a backward that keeps its graph donates no buffer
        if hasattr(getattr(lazy.saved_context, "fw_metadata", None), "bw_donated_idxs"):
            lazy.saved_context.fw_metadata.bw_donated_idxs = []
        with ExitStack() as stack:
            stack.enter_context(w.tracing(lazy.saved_context))
            stack.enter_context(w.compile_context(lazy.saved_compile_context))
            stack.enter_context(self.torch._C._DisableAutocast() if self.disable_amp else nullcontext())
            stack.enter_context(w.track_graph_compiling(self.aot_config, "backward"))
            stack.enter_context(w.get_metrics_context())
            stack.enter_context(w.dynamo_timed(
                "backward._backward_impl", phase_name="entire_backward_compile", log_pt2_compile_event=True,
                dynamo_compile_column_us="backward_cumulative_compile_time_us", log_waitcounter=True,
                waitcounter_name_override="entire_backward_compile"))
            stack.enter_context(w.callback_handler.install_callbacks(
                w.CallbackTrigger.LAZY_BACKWARD, str(w.CompileContext.current_compile_id())))
            w.CompileEventLogger.compilation_metric(is_forward=False)
            compiled = self.aot_config.bw_compiler(copy.deepcopy(lazy.bw_module), lazy.placeholder_list)
            self.save(compiled, lazy.bw_module, self.fw_metadata, self.aot_config)
        self.compiled_bw = compiled
        return compiled


def compiled_where_paid(torch: Any, compiler: Any, counted: Callable[[], None],
                        paid: Callable[[], float] | None = None) -> None:
    """``compiler``'s backward compiled where ``paid()`` (:func:`budget` by default, as this module holds it when
    called) is above 0 and its graph is :func:`_eligible`. Nothing escapes: a backward that fails to compile is left
    to the test's own ``backward()``, as torch does."""
    try:
        if (paid or budget)() <= 0 or not _eligible(torch, getattr(compiler.lazy_backward_info, "placeholder_list", None)):
            return
    except Exception:  # noqa: BLE001
        return
    started = time.perf_counter()
    try:
        with _unseen(torch):
            compiler.get_or_compile(saved_tensors_use_once=False)
        counted()
    except Exception:  # noqa: BLE001 - left to the test's own backward()
        pass
    finally:
        LEDGER.completing += time.perf_counter() - started


# the devices whose graphs have their backwards compiled here: where what a test sees of it was checked (a graph
# with a tensor elsewhere has its backward compiled where a test first calls backward(), as torch does)
CHECKED_DEVICES = frozenset({"cpu", "cuda"})


def _eligible(torch: Any, placeholders: Any) -> bool:
    """Whether a backward's inputs (their example values, or placeholders holding them) are all of fixed shape (a
    symbolic one could add guards to the forward's frame, compiled here inside its compile) and their tensors all
    on :data:`CHECKED_DEVICES`."""
    if not isinstance(placeholders, (list, tuple)):
        return False
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for held in placeholders:
        value = getattr(held, "meta", {}).get("val", held) if hasattr(held, "meta") else held
        if isinstance(value, symbolic):
            return False
        if isinstance(value, torch.Tensor) and (
                not all(type(n) is int for n in (*value.shape, *value.stride()))
                or getattr(getattr(value, "device", None), "type", None) not in CHECKED_DEVICES):
            return False
    return True


def _unseen(torch: Any) -> ExitStack:
    """What a test could see of the compile put back or kept from it: the random generators' states (Inductor's
    benchmarks draw from them), torch's counters and the warnings shown; the forward's compile metrics kept apart;
    no grad recorded, as in the autograd engine's backward."""
    from torch._dynamo import utils
    from torch._dynamo.metrics_context import MetricsContext
    from torch._dynamo.utils import counters, preserve_rng_state

    stack = ExitStack()
    # a compile of its own in torch's metrics (it runs inside the forward's: a metric set twice there raises), recorded
    # as torch records a compile
    tls = utils._metrics_context_tls
    outer = getattr(tls, "metrics_context", None)
    tls.metrics_context = MetricsContext(on_exit=getattr(utils, "record_compilation_metrics", lambda *_: None))

    def metrics_back() -> None:
        if outer is None:
            del tls.metrics_context
        else:
            tls.metrics_context = outer

    stack.callback(metrics_back)
    stack.enter_context(preserve_rng_state())
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(torch.no_grad())
    saved = {group: dict(counts) for group, counts in counters.items()}

    def put_back() -> None:
        counters.clear()
        for group, counts in saved.items():
            counters[group].update(counts)

    stack.callback(put_back)
    return stack
