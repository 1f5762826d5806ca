"""What Dynamo reuse spared in this process and what it cost: the two sides of the seconds it saved.

- **Spared**: what the stored variants taken here took to trace and compile where they were traced (each recorded it).
- **Cost**: what reuse itself spent here, none of which a run without it spends:
  - *offering* stored variants where Dynamo is about to trace a frame (proofs checked, guards built, effects done
    again, the taken variant's compiled graphs made ready), before torch's compile timings start;
  - *loading and installing* stored entries where ``torch.compile()`` wraps a function (torch reads the entry,
    checks its inlined sources, puts its globals in place), in the collection or in a test;
  - a stored compiled graph made ready where it is first called outside an offer.

The spans of the second and third kind are kept with their start and end, so that a process's phases can take them
out of the collection or the tests they happened in (:func:`cost_spans`). No torch imported here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["LEDGER", "Ledger", "completing_seconds", "cost_seconds", "cost_spans", "offered_seconds", "spared_seconds",
           "spared_tracing_seconds"]


class Ledger:
    """This process's figures (one per process: torch's state is process-wide)."""

    def __init__(self) -> None:
        self.spared = 0.0
        self.spared_tracing = 0.0  # of spared, what the variants' traces took without their backends' compiles
        self.completing = 0.0  # what compiling the backwards no test ran took here (.backwards)
        # of the cost, stored compiled graphs deserialized (.backends.Deferred): what a run without reuse spends too,
        # in the backend's cache hit for the frame it traces again
        self.loading = 0.0
        self.offered = 0.0
        self.spans: list[tuple[float, float]] = []  # (start, end), perf_counter: loading and installing, outside offers
        self._inside = threading.local()  # an offer or a span under way on this thread: nested time is counted once

    def _depth(self) -> int:
        return int(getattr(self._inside, "depth", 0))

    @contextmanager
    def _outermost(self, counted: Callable[[float, float], None]) -> Iterator[None]:
        """Times the block; ``counted(start, end)`` where no other block of the ledger encloses it on this thread."""
        outer = self._depth()
        self._inside.depth = outer + 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self._inside.depth = outer
            if outer == 0:
                counted(started, time.perf_counter())

    def offering(self) -> AbstractContextManager[None]:
        """Time spent offering stored variants (an offer may install a deferred entry: counted here, once)."""
        return self._outermost(self._offered)

    def spending(self) -> AbstractContextManager[None]:
        """Time spent loading or installing a stored entry, or making a stored graph ready, outside an offer."""
        return self._outermost(lambda start, end: self.spans.append((start, end)))

    def _offered(self, start: float, end: float) -> None:
        self.offered += end - start

    def cost(self) -> float:
        return self.offered + sum(end - start for start, end in self.spans)


LEDGER = Ledger()


def spared_seconds() -> float:
    """The seconds the stored variants taken in this process took to trace and compile where they were traced (as
    each recorded it): the compiling they spared here."""
    return LEDGER.spared


def spared_tracing_seconds() -> float:
    """Of :func:`spared_seconds`, what the variants' traces took without their backends' compiles (as those variants
    recorded it that did): what a run without reuse spends again, whose backends hit torch's caches."""
    return LEDGER.spared_tracing


def completing_seconds() -> float:
    """The seconds this process compiled backwards that no test ran, paid from what reuse spared (.backwards)."""
    return LEDGER.completing


def offered_seconds() -> float:
    """The seconds this process spent offering stored variants where Dynamo was about to trace: before torch's
    compile timings start (a frame taken is never compiled), so its own phase of the process's time."""
    return LEDGER.offered


def cost_seconds() -> float:
    """What reuse cost this process: offering, loading and installing stored entries, making stored graphs ready."""
    return LEDGER.cost()


def cost_spans() -> list[tuple[float, float]]:
    """The spans (``time.perf_counter``) in which this process loaded and installed stored entries or made stored
    graphs ready outside an offer: inside the collection or a test, outside torch's compile timings."""
    return list(LEDGER.spans)
