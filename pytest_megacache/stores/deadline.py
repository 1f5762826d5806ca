"""Wall-clock budgets for everything that may block on a store.

botocore's ``read_timeout`` is per socket read: a body trickled at one byte a second never trips it, and
``concurrent.futures`` threads are joined at interpreter exit, so a thread stuck in such a read holds the
process after the tests have finished. Here every store operation runs in a *daemon* thread of its own, and
the caller waits for it only until an absolute deadline: past it, the caller goes on (the operation counts as
failed) and the thread, if it is still blocked, dies with the interpreter instead of holding it.

A store's client library makes its loggers as it imports its modules, in those threads, while pytest lists every
logger as it starts each phase of the session and of each test (its logging plugin attaches its handlers to the
loggers that do not propagate): a logger made at that moment failed the session ("dictionary changed size during
iteration"). Before any such thread starts, logging's record of loggers lists its loggers as a copy taken at once
(:func:`loggers_listed_at_once`).

Any exception an operation raises (botocore's ``ProfileNotFound`` while building a client, a ``ValueError``
for a malformed endpoint, an ``OSError``) arrives as :class:`StoreError`: one type crosses this boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import StoreError, redact_cut

T = TypeVar("T")
_PENDING = object()  # bounded_map's mark for an item not finished yet
R = TypeVar("R")


class Deadline:
    """An absolute point in time (monotonic clock) that a budget of ``seconds`` ends at."""

    def __init__(self, seconds: float, what: str, setting: str = "") -> None:
        self.seconds = seconds
        self.what = what  # "the restore"
        self.setting = setting  # the option that sets it, named in the message
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def error(self, operation: str) -> StoreError:
        setting = f", {self.setting}" if self.setting else ""
        return StoreError(f"{operation} did not finish within the budget of {self.what} ({self.seconds:g} s{setting})",
                          "timeout")


class _ListedAtOnce(dict):  # type: ignore[type-arg]
    """logging's record of loggers (its manager's ``loggerDict``), whose ``values()`` is a list of them taken at once
    (a copy in one C call, which no other thread interrupts), not a view that a logger made meanwhile invalidates."""

    def values(self) -> list[logging.Logger | logging.PlaceHolder]:  # type: ignore[override]
        return list(super().values())


def loggers_listed_at_once() -> None:
    """logging's record of loggers made a :class:`_ListedAtOnce` with the same loggers, once (see above)."""
    manager = logging.Logger.manager
    with logging._lock:  # type: ignore[attr-defined] # logging's own lock, held where it adds a logger
        if not isinstance(manager.loggerDict, _ListedAtOnce):
            manager.loggerDict = _ListedAtOnce(manager.loggerDict)


def as_store_error(what: str, exc: BaseException) -> StoreError:
    """``exc`` as a :class:`StoreError` (unchanged if it is one), its message masked and cut."""
    if isinstance(exc, StoreError):
        return exc
    return StoreError(f"{what}: {redact_cut(f'{type(exc).__name__}: {exc}')}", "config" if _is_config(exc) else "other")


def _is_config(exc: BaseException) -> bool:
    # botocore's configuration problems (a missing profile, an invalid endpoint) are permanent for the session.
    name = type(exc).__name__
    return name in {"ProfileNotFound", "InvalidConfigError", "NoRegionError", "InvalidRegionError"} or isinstance(
        exc, ValueError)


def bounded(fn: Callable[[], T], deadline: Deadline, what: str) -> T:
    """``fn()`` run in a daemon thread, waited for until ``deadline``; raises :class:`StoreError` on any failure.

    Past the deadline the thread is left behind: it is a daemon, so it never holds the process at exit."""
    [outcome] = bounded_map(lambda _item: fn(), [None], deadline, 1, what)
    if isinstance(outcome, StoreError):
        raise outcome
    return outcome


def bounded_map(fn: Callable[[T], R], items: Sequence[T], deadline: Deadline, workers: int, what: str = "fetching",
                ) -> list[R | StoreError]:
    """``fn`` over ``items`` in up to ``workers`` daemon threads, in order, each result or its failure as a
    :class:`StoreError`; items not finished by ``deadline`` get the deadline's error."""
    if deadline.expired():
        return [deadline.error(what) for _ in items]
    results: list[R | StoreError | object] = [_PENDING] * len(items)  # an outcome may be None (a put)
    lock = threading.Lock()
    pending = iter(range(len(items)))
    all_done = threading.Event()
    left = [len(items)]

    def next_index() -> int | None:
        with lock:
            return next(pending, None)

    def worker() -> None:
        while (i := next_index()) is not None:
            try:
                outcome: R | StoreError = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - everything crosses as StoreError
                outcome = as_store_error(what, exc)
            with lock:
                results[i] = outcome
                left[0] -= 1
                if left[0] == 0:
                    all_done.set()

    if not items:
        return []
    threads = max(1, min(workers, len(items)))
    loggers_listed_at_once()
    for n in range(threads):
        name = f"megacache-{what.split()[0]}" + (f"-{n}" if threads > 1 else "")
        threading.Thread(target=worker, name=name, daemon=True).start()
    all_done.wait(deadline.remaining())
    with lock:
        return [deadline.error(what) if r is _PENDING else r for r in results]  # type: ignore[misc]
