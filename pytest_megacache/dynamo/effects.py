"""What a trace or a load does besides its result, kept apart from Dynamo reuse's wrappers
(:mod:`pytest_megacache.dynamo`):

- **Warnings shown while a frame is traced.** A frame taken from the store is not traced, so what its trace showed would not
  be shown: :func:`watch_warnings` notes the compiles during which Dynamo's trace showed a warning (not its backend's
  compile, whose graph comes from torch's caches either way), and such a frame is never stored (:func:`code_key`
  names it).
- **A stored entry torch fails to load.** :func:`failed_load_contained` counts it as refused and keeps torch's log
  record and its objects' unraisable exceptions from the session.
- **torch's warnings about caching precompile's own bookkeeping** ("Backend not found" where a variant's compiled
  graph was not stored, "Detected a package bypass" where a frame is not stored): a session without the plugin never
  turns caching precompile on, so never prints them. :func:`bookkeeping_quiet` keeps them from the session; the
  report counts what they say (refused frames and variants, by reason).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any, Protocol


class ReuseState(Protocol):
    warned: set[str]

    def refuse(self, reason: str, detail: str) -> None: ...


def code_key(code: Any) -> tuple[str, int, str]:
    """A code object (or torch's serialized form of one) by file, first line and name."""
    return (str(getattr(code, "co_filename", "")), int(getattr(code, "co_firstlineno", 0)),
            str(getattr(code, "co_name", "")))


_BACKEND = threading.local()  # depth of the backend compiles (Inductor, AOTAutograd) this thread is in


def watch_warnings(state: ReuseState, compile_id: Any, output_graph: Any = None) -> None:
    """Notes the compiles during which a warning is shown while Dynamo traces: the interpreter shows every warning
    through ``warnings._showwarnmsg``, looked up at each warning (pytest's capture replaces what it calls, not it).
    Nothing traced calls it: Dynamo sees the same ``warnings.warn`` as without this. A warning shown while the
    frame's graph is compiled by its backend (``output_graph``'s ``call_user_compiler``: Inductor generating code)
    is not the frame's: the graph comes from torch's own caches where a frame is taken from the store, as where it is
    traced again, and neither shows it."""
    import warnings

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
        output_graph.call_user_compiler = in_backend

    def note(*_args: Any, **_kwargs: Any) -> None:
        if getattr(_BACKEND, "depth", 0):
            return
        try:
            current = compile_id()
            if current is not None:
                state.warned.add(str(current))
        except Exception:  # noqa: BLE001 - watching never changes a warning
            pass

    show = getattr(warnings, "_showwarnmsg", None)
    if show is not None and not getattr(show, "_megacache_watch", False):
        @functools.wraps(show)
        def showwarnmsg(msg: Any) -> Any:
            note()
            return show(msg)

        showwarnmsg._megacache_watch = True  # type: ignore[attr-defined]
        warnings._showwarnmsg = showwarnmsg  # type: ignore[attr-defined]


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
