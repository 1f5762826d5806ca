"""What a trace or a load does besides its result, kept apart from Dynamo reuse's wrappers
(:mod:`pytest_megacache.dynamo`):

- **What a test can see of a frame's trace.** A frame taken from the store is not traced, yet a test may read what
  its trace would have left: torch's counters (``counters["stats"]["unique_graphs"]``, its graph breaks, ...) and the
  warnings shown while Dynamo traced it (``pytest.warns`` around a first call). A :class:`Trace` notes both while a
  frame is traced (:func:`watch_warnings`: the warnings shown, not those of its backend's compile, whose graph comes
  from torch's caches either way); :func:`effects_of` is what is stored with the variant, :func:`read_effects` checks
  it when read back, and where the variant is taken :func:`shown_again` shows the warnings again through the
  warnings machinery (the session's filters, ``pytest.warns`` and ``-W error`` apply as to the trace's) and
  :func:`count_again` adds to torch's counters what the trace added. A warning whose class cannot be found again by
  name (defined in a function, say) leaves the frame unstored (:func:`code_key` names it).
- **A stored entry torch fails to load.** :func:`failed_load_contained` counts it as refused and keeps torch's log
  record and its objects' unraisable exceptions from the session.
- **torch's warnings about caching precompile's own bookkeeping** ("Backend not found" where a variant's compiled
  graph was not stored, "Detected a package bypass" where a frame is not stored): a session without the plugin never
  turns caching precompile on, so never prints them. :func:`bookkeeping_quiet` keeps them from the session; the
  report counts what they say (refused frames and variants, by reason).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import gc
import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .objects import Refused
from .patches import PATCHES
from .shapes import Note, read_shapes

# torch's counter groups that tracing a frame adds to (torch 2.13: ``output_graph``, ``symbolic_convert``, ``exc``):
# its graphs and the calls they captured (``stats``), its graph breaks, the resume functions it made, what it could
# not trace. ``frames`` is counted around the compile, where a frame taken from the store passes as well.
TRACE_COUNTERS = ("stats", "graph_break", "resumes", "unimplemented")
MAX_WARNINGS = 32  # per frame traced; a trace that showed more is not stored
MAX_TEXT = 4096  # characters of a warning's text, file name, module or counter name
MAX_COUNTS = 256  # names per counter group


class ReuseState(Protocol):
    traces: dict[str, Trace]

    def refuse(self, reason: str, detail: str) -> None: ...


def code_key(code: Any) -> tuple[str, int, str]:
    """A code object (or torch's serialized form of one) by file, first line and name."""
    return (str(getattr(code, "co_filename", "")), int(getattr(code, "co_firstlineno", 0)),
            str(getattr(code, "co_name", "")))


class Shown(NamedTuple):
    """A warning shown while a frame was traced, as :func:`warnings.warn_explicit` takes it again."""

    message: str
    category: tuple[str, str]  # module and qualified name of its class
    filename: str
    lineno: int
    module: str  # the module of the code that warned (what the filters match), whose registry it was noted in


@dataclass(frozen=True)
class Effects:
    """What a stored variant's trace did that a test can see: the warnings it showed, what it added to torch's
    counters (group, name, amount)."""

    warnings: tuple[Shown, ...] = ()
    counters: tuple[tuple[str, str, int], ...] = ()
    shapes: tuple[Note, ...] = ()  # what it noted of its inputs' shapes, and what was noted before (:mod:`.shapes`)


NO_EFFECTS = Effects()


class Trace:
    """One frame being traced (of ``code``): torch's counters before it, the warnings shown so far (None once one
    was shown that could not be shown again), the notes it made of its inputs' shapes (None once one could not be
    recorded: :mod:`.shapes`), when its trace started and the seconds torch's backends had compiled by then."""

    __slots__ = ("before", "code", "compiled", "shapes", "shown", "started")

    def __init__(self, table: Mapping[str, Mapping[str, int]], code: Any = None) -> None:
        self.before = counted(table)
        self.code = code
        self.shown: list[Shown] | None = []
        self.shapes: list[list[Any]] | None = []
        self.started = time.perf_counter()
        self.compiled = backend_seconds()

    def traced_seconds(self, seconds: float) -> float | None:
        """Of ``seconds``, the time since the trace started, those torch's backends did not compile in (None where
        torch's record of them was cleared in between)."""
        compiled = backend_seconds() - self.compiled
        return max(0.0, seconds - compiled) if compiled >= 0 else None


def backend_seconds() -> float:
    """The seconds torch's backends compiled in this process (Dynamo's record of its calls of them; 0 before
    Dynamo is imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", None)
    times = metrics.get("OutputGraph.call_user_compiler") if isinstance(metrics, dict) else None
    return float(sum(times)) if isinstance(times, list) else 0.0


def counted(table: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """torch's counters of :data:`TRACE_COUNTERS` now (``table``: torch's ``counters``; no group is made)."""
    return {group: dict(table[group]) for group in TRACE_COUNTERS if group in table}


def effects_of(trace: Trace | None, table: Mapping[str, Mapping[str, int]]) -> dict[str, Any] | None:
    """What is stored with a variant whose trace is ``trace`` (ended but for its guards): the warnings it showed and
    what it added to torch's counters ``table``, as plain data; None where it cannot be done again where the variant
    is taken (a warning that cannot be shown again, no trace seen)."""
    if trace is None or trace.shown is None or trace.shapes is None:
        return None
    added: dict[str, dict[str, int]] = {}
    try:
        for group, values in counted(table).items():
            before = trace.before.get(group, {})
            delta = {k: v - before.get(k, 0) for k, v in values.items() if isinstance(k, str) and v > before.get(k, 0)}
            if len(delta) > MAX_COUNTS or any(len(k) > MAX_TEXT for k in delta):
                return None
            if delta:
                added[group] = delta
    except Exception:  # noqa: BLE001 - a table of another form: nothing to count again, the frame is not stored
        return None
    shown = [[w.message, list(w.category), w.filename, w.lineno, w.module] for w in trace.shown]
    return {**({"warnings": shown} if shown else {}), **({"counters": added} if added else {}),
            **({"shapes": trace.shapes} if trace.shapes else {})}


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise Refused("side_effect", "malformed record of what the trace did")
    return value


def _count(value: Any, least: int = 1) -> int:
    if type(value) is not int or not least <= value < 1 << 31:
        raise Refused("side_effect", "malformed record of what the trace did")
    return value


def read_effects(raw: Any) -> Effects:
    """:func:`effects_of`'s record, read back from a stored variant and checked (plain data of the expected types and
    sizes only); raises :class:`Refused` for anything else."""
    if raw is None:
        return Effects()
    if not isinstance(raw, dict) or set(raw) - {"warnings", "counters", "shapes"}:
        raise Refused("side_effect", "malformed record of what the trace did")
    shown, counts = raw.get("warnings", []), raw.get("counters", {})
    if (not isinstance(shown, list) or len(shown) > MAX_WARNINGS or not isinstance(counts, dict)
            or not set(counts) <= set(TRACE_COUNTERS)):
        raise Refused("side_effect", "malformed record of what the trace did")
    warned = []
    for item in shown:
        if not isinstance(item, list) or len(item) != 5 or not isinstance(item[1], list) or len(item[1]) != 2:
            raise Refused("side_effect", "malformed record of what the trace did")
        message, (owner, name), filename, lineno, module = item
        warned.append(Shown(_text(message), (_text(owner), _text(name)), _text(filename), _count(lineno, 0),
                            _text(module)))
    added: list[tuple[str, str, int]] = []
    for group, values in counts.items():
        if not isinstance(values, dict) or len(values) > MAX_COUNTS:
            raise Refused("side_effect", "malformed record of what the trace did")
        added.extend((group, _text(name), _count(n)) for name, n in values.items())
    return Effects(tuple(warned), tuple(added), read_shapes(raw["shapes"]) if "shapes" in raw else ())


def warning_class(module: str, qualname: str) -> type[Warning] | None:
    """The warning class of that module and qualified name, read from the namespaces of modules already imported
    (nothing is imported, no attribute hook runs); None where there is none."""
    obj: Any = builtins if module == "builtins" else sys.modules.get(module)
    for part in qualname.split("."):
        namespace = getattr(obj, "__dict__", None)
        obj = namespace.get(part) if isinstance(namespace, Mapping) else None
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else None


def shown_record(msg: Any, frame: Any) -> Shown | None:
    """What :func:`shown_again` needs to show ``msg`` (a :class:`warnings.WarningMessage`) again, the frame that
    warned found from ``frame`` up; None where it could not be shown as it was: a class not found again by its name,
    a warning made of other arguments than its text, an object it is about (a ``ResourceWarning``'s), code outside an
    imported module's namespace."""
    category: Any = getattr(msg, "category", None)
    message: Any = getattr(msg, "message", None)
    if not isinstance(category, type) or type(message) is not category or getattr(msg, "source", None) is not None:
        return None
    text, filename, lineno = str(message), getattr(msg, "filename", None), getattr(msg, "lineno", None)
    owner, name = getattr(category, "__module__", None), getattr(category, "__qualname__", None)
    if (getattr(message, "args", None) != (text,) or not isinstance(owner, str) or not isinstance(name, str) or "<locals>" in name
            or warning_class(owner, name) is not category or not isinstance(filename, str)
            or type(lineno) is not int or max(len(text), len(filename)) > MAX_TEXT):
        return None
    for _ in range(64):
        if frame is None:
            return None
        if frame.f_code.co_filename == filename and frame.f_lineno == lineno:
            module = frame.f_globals.get("__name__")
            if not isinstance(module, str) or getattr(sys.modules.get(module), "__dict__", None) is not frame.f_globals:
                return None
            return Shown(text, (owner, name), filename, lineno, module)
        frame = frame.f_back
    return None


def shown_again(effects: Effects) -> None:
    """The warnings a stored variant's trace showed, shown again as the trace showed them: through
    :func:`warnings.warn_explicit`, in the registry of the module that warned, so that the filters of the moment
    decide as they would have. Raises :class:`Refused` before showing any where a class or module is not there; what
    a filter makes of a warning (``error``) is raised."""
    found = []
    for shown in effects.warnings:
        category = warning_class(*shown.category)
        scope = getattr(sys.modules.get(shown.module), "__dict__", None)
        registry = scope.setdefault("__warningregistry__", {}) if isinstance(scope, dict) else None
        if category is None or not isinstance(registry, dict):
            raise Refused("side_effect", f"{'.'.join(shown.category)} or {shown.module} is not there to warn again")
        found.append((shown, category, scope, registry))
    for shown, category, scope, registry in found:
        warnings.warn_explicit(shown.message, category, shown.filename, shown.lineno, shown.module, registry, scope)


def count_again(effects: Effects, table: Any) -> None:
    """What a stored variant's trace added to torch's counters ``table``, added again."""
    for group, name, n in effects.counters:
        table[group][name] += n


_BACKEND = threading.local()  # depth of the backend compiles (Inductor, AOTAutograd) this thread is in


def watch_warnings(state: ReuseState, compile_id: Any, output_graph: Any = None) -> None:
    """Notes the warnings shown while Dynamo traces a frame (in its :class:`Trace`, ``state.traces`` by compile id):
    the interpreter shows every warning through ``warnings._showwarnmsg``, looked up at each warning (pytest's
    capture replaces what it calls, not it). Nothing traced calls it: Dynamo sees the same ``warnings.warn`` as
    without this. A warning shown while the frame's graph is compiled by its backend (``output_graph``'s
    ``call_user_compiler``: Inductor generating code) is not the frame's: the graph comes from torch's own caches
    where a frame is taken from the store, as where it is traced again, and neither shows it."""
    call_user_compiler = getattr(output_graph, "call_user_compiler", None)
    if call_user_compiler is not None and not getattr(call_user_compiler, "_megacache_watch", False):
        @functools.wraps(call_user_compiler)
        def in_backend(*args: Any, **kwargs: Any) -> Any:
            _BACKEND.depth = getattr(_BACKEND, "depth", 0) + 1
            try:
                return call_user_compiler(*args, **kwargs)
            finally:
                _BACKEND.depth -= 1

        in_backend._megacache_watch = True  # type: ignore[attr-defined]
        PATCHES.replace(output_graph, "call_user_compiler", in_backend,
                        "what a trace does inside its backend is told apart from what the trace does")

    def note(msg: Any, frame: Any) -> None:
        if getattr(_BACKEND, "depth", 0):
            return
        trace = None
        try:
            current = compile_id()
            trace = state.traces.get(str(current)) if current is not None else None
            if trace is None or trace.shown is None:
                return
            shown = shown_record(msg, frame)
            trace.shown = [*trace.shown, shown] if shown is not None and len(trace.shown) < MAX_WARNINGS else None
        except Exception:  # noqa: BLE001 - watching never changes a warning; one not noted leaves the frame unstored
            if trace is not None:
                trace.shown = None

    show = getattr(warnings, "_showwarnmsg", None)
    if show is not None and not getattr(show, "_megacache_watch", False):
        @functools.wraps(show)
        def showwarnmsg(msg: Any) -> Any:
            frame = sys._getframe(1)
            if not hasattr(warnings, "_showwarnmsg_impl"):
                note(msg, frame)
                return show(msg)
            # noted only where it reaches what shows or records it: torch hides some of its own warnings behind a
            # ``warnings.showwarning`` of its own (``torch._logging.hide_warnings``: a non-leaf tensor's ``.grad``
            # read while Dynamo wraps it), and one hidden so was never shown
            impl, reached = warnings._showwarnmsg_impl, []

            def reaching(shown: Any) -> Any:
                reached.append(shown)
                return impl(shown)

            warnings._showwarnmsg_impl = reaching
            try:
                return show(msg)
            finally:
                if warnings._showwarnmsg_impl is reaching:
                    warnings._showwarnmsg_impl = impl
                if reached:
                    note(msg, frame)

        showwarnmsg._megacache_watch = True  # type: ignore[attr-defined]
        PATCHES.replace(warnings, "_showwarnmsg", showwarnmsg,
                        "a warning shown while a frame is traced is kept, to be shown again where its variant is taken")


class _FailedLoadRecord(logging.Filter):
    """Keeps torch's "Failed to load package" record (logged with its traceback) from the session's handlers."""

    def __init__(self) -> None:
        super().__init__()
        self.detail: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Failed to load package"):
            return True
        if self.detail is None:
            exc = record.exc_info[1] if record.exc_info else None
            cause = exc.__cause__ if exc is not None and exc.__cause__ is not None else exc
            self.detail = f"{type(cause).__name__}: {cause}" if cause is not None else record.getMessage()
        record.exc_info = None
        return False


@contextlib.contextmanager
def failed_load_contained(state: ReuseState) -> Iterator[None]:
    """torch's ``DynamoCache.load`` catches its own failure to load a stored entry (bytes that do not unpickle): it
    logs a warning with the traceback, counts ``dynamo_cache_error`` and returns None, so the frame is traced. Such
    an entry counts as refused here (``load_failed``), its log record is kept from the session, and the unraisable
    exceptions that torch's objects raise while the load runs (the half-loaded graphs' ``CompiledFxGraph.__del__``,
    collected here) are dropped; any other unraisable exception goes on to the hook that was there, at once (a hook
    must not keep what it is given)."""
    from torch._dynamo.utils import counters

    with _LOAD_LOCK:  # the process's unraisable hook is swapped by one load at a time
        before = counters["dynamo_cache"]["dynamo_cache_error"]
        record = _FailedLoadRecord()
        logger = logging.getLogger("torch._dynamo.package")
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if not _of_torch(unraisable.object):
                previous(unraisable)

        sys.unraisablehook = hook
        logger.addFilter(record)
        try:
            yield
        finally:
            logger.removeFilter(record)
            failed = record.detail is not None or counters["dynamo_cache"]["dynamo_cache_error"] > before
            try:
                if failed:
                    gc.collect()  # the half-loaded objects in reference cycles (the traceback's frames)
            finally:
                sys.unraisablehook = previous
            if failed:
                state.refuse("load_failed", record.detail or "torch failed to load the stored entry")


_LOAD_LOCK = threading.RLock()

# The logger and the start of each warning torch logs about caching precompile's own bookkeeping.
BOOKKEEPING = (("torch._dynamo.package", "Backend not found"), ("torch._dynamo.output_graph", "Detected a package bypass"))


class _Bookkeeping(logging.Filter):
    """Drops the records of one logger whose message starts with ``start`` (torch's message, before its arguments)."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def bookkeeping_quiet() -> None:
    """Keeps torch's warnings about caching precompile's bookkeeping (:data:`BOOKKEEPING`) from the session's handlers
    and from pytest's log capture: a filter on each logger, once per process. Every other record of those loggers
    goes on as before."""
    for name, start in BOOKKEEPING:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Bookkeeping) and f.start == start for f in logger.filters):
            logger.addFilter(_Bookkeeping(start))


def _of_torch(obj: object) -> bool:
    """Whether ``obj`` (what raised an unraisable exception: a ``__del__`` method, an object) is torch's."""
    module = getattr(obj, "__module__", None)
    return (module if isinstance(module, str) else type(obj).__module__).startswith("torch")
