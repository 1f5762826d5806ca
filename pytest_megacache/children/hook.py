"""Child processes' own torch cache counters, for the session report (the design coverage.py uses for subprocesses).

The package installs ``pytest_megacache_children.pth`` into site-packages. At every interpreter start that line looks
up :data:`SPOOL_ENV` and does nothing else when it is absent. When the plugin has set it (to an absolute directory),
the line imports :mod:`pytest_megacache.children`, which registers a small exit handler, still without importing this module. At a
normal exit, if ``torch._dynamo.utils`` is loaded, that handler imports this module and calls :func:`exit_handler`,
which writes one small JSON record of torch's own counters into the spool directory when torch compiled anything in
that process. The plugin reads the records back with :func:`read_spool`. :func:`bootstrap` arms a process the same
way by hand (an interpreter that skips site-packages ``.pth`` files: ``python -S``, an embedded one).

:mod:`pytest_megacache.children` also makes a child that imports torch ask its parent for the restore and wait until it has
settled (:data:`READY_ENV`, a file the parent creates then, :class:`RestoreSignal`; :data:`WAIT_ENV`, how long it
waits at most): the child then compiles on the restored files, after the parent's snapshot of the cache directories,
so that what it compiles is carried, even when the parent itself never imports torch. A child that never imports
torch never waits.

What writes a record: a new Python interpreter that inherited the variable (``subprocess``, torchrun's workers,
``multiprocessing`` / ``torch.multiprocessing`` *spawn* children, their own children) and ends through normal
interpreter shutdown (returning from main, ``sys.exit``, an uncaught exception). What writes nothing: a process
killed by a signal (SIGKILL, SIGTERM with no handler) or ending in ``os._exit``; a *forked* child (``fork`` and
``forkserver`` start methods, a bare ``os.fork()``: no new interpreter, and its counters began as its parent's);
a child started with a cleared environment or ``python -S``; an interpreter that does not have this package
installed; a process that is not Python; a process that called :func:`disarm` (the plugin's own pytest
processes, xdist workers included).

Imports: the standard library only (``tempfile`` and ``shutil`` only when the parent creates and removes a spool),
the package's ``__init__``, :mod:`pytest_megacache.children` (the variables' names) and :mod:`.fsutil` (which writes and reads the
records), never torch, pytest or boto3; the exit handler reads ``torch._dynamo.utils`` only when it is already
imported.

A record holds counters and harmless identity only: pid, parent pid, and ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE`` when each is a small non-negative integer; torch's CPU vector-ISA load checks the child ran and took
from a record (:mod:`.isaprobe`, when the child armed it) and the seconds in them; the largest of torch's own compile
timings by name (``torch._dynamo.utils.compilation_time_metrics``: they nest). Never argv, and no other
environment value.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..fsutil import Refused, read_regular, write_atomic
from . import READY_ENV, SPOOL_ENV, WAIT_ENV, WANTED_SUFFIX

__all__ = [
    "MAX_FILES",
    "MAX_RECORD_BYTES",
    "READY_ENV",
    "RECORD_VERSION",
    "SPOOL_ENV",
    "WAIT_ENV",
    "WANTED_SUFFIX",
    "ChildRecord",
    "RestoreSignal",
    "Spool",
    "bootstrap",
    "collect",
    "disarm",
    "exit_handler",
    "read_spool",
]

RECORD_VERSION = 2
MAX_RECORD_BYTES = 16 * 1024  # a record is about 600 bytes
MAX_FILES = 1000  # records read per spool; more are counted, not read
MAX_LISTED = 100_000  # directory entries looked at per spool
MAX_COUNT = 10**12  # counters, compiles, graphs
MAX_PID = 2**31 - 1
MAX_RANK = 1_000_000  # RANK, LOCAL_RANK, WORLD_SIZE
MAX_SECONDS = 10.0**7
# torch's dynamo_timed key around one frame's whole compile (Dynamo trace, AOTAutograd, Inductor), torch 2.7-2.13:
# torch/_dynamo/convert_frame.py. Cleared by torch._dynamo.reset(), as torch's own compile_times() is.
COMPILE_METRIC = "_compile.compile_inner"
RANK_ENV = (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"))
TEMP_PREFIX = "."  # a record being written: ".<pid>-<hex>.json.<pid>-<hex>.tmp" (fsutil.write_atomic), never read
RECORD_SUFFIX = ".json"
MAX_PHASES = 12  # torch's compile timings kept per record, the largest first
PHASE_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.<>")
_INT_FIELDS = ("pid", "ppid", "compiles", "graphs", "isa_run", "isa_reused")
_SECONDS_FIELDS = ("compile_seconds", "isa_seconds")
_KEYS = frozenset({"v", "compiled", "counters", "phases", *_INT_FIELDS, *_SECONDS_FIELDS,
                   *(key for key, _ in RANK_ENV)})

_armed = False  # bootstrap() registered exit_handler
_disarmed = False
_done = False  # exit_handler ran (the .pth's and bootstrap()'s registrations both call it: one record)


# --- the child's side -------------------------------------------------------------------------------------------
def bootstrap() -> None:
    """Register :func:`exit_handler` if :data:`SPOOL_ENV` is set: what the ``.pth`` line does, for an interpreter
    that skips it. Idempotent (with the ``.pth`` line too: one record per process); never raises."""
    global _armed
    try:
        spool = os.environ.get(SPOOL_ENV)
        if spool and not (_armed or _disarmed):
            atexit.register(exit_handler, os.getpid(), os.getppid(), spool)
            _armed = True
    except Exception:  # noqa: BLE001 - arming must never fail the process
        pass


def disarm() -> None:
    """Write nothing from this process (the plugin calls it in pytest processes, xdist workers included, which
    inherit the variable). Covers the ``.pth`` line's handler and :func:`bootstrap`'s, before or after them."""
    global _disarmed
    _disarmed = True
    try:
        atexit.unregister(exit_handler)
    except Exception:  # noqa: BLE001
        pass


def exit_handler(start_pid: int, start_ppid: int, spool: str) -> None:
    """At interpreter exit: write this process's record into ``spool`` if torch compiled anything here.

    ``start_pid`` / ``start_ppid`` are the pids when the handler was registered (a forked child, whose pid differs,
    writes nothing). ``spool`` must be absolute (children start in other directories; a relative one would scatter
    records there). No exception of any kind leaves it (a traceback in someone else's stderr, or a SystemExit taken
    for theirs); it takes no lock, opens no socket, and writes one small file."""
    global _done
    try:
        if _disarmed or _done:
            return
        _done = True
        if os.getpid() != start_pid or not os.path.isabs(spool) or "\0" in spool:
            return
        record = collect()
        if record is None:
            return
        record["pid"], record["ppid"] = min(start_pid, MAX_PID), min(start_ppid, MAX_PID)
        data = json.dumps(record, sort_keys=True, allow_nan=False, separators=(",", ":")).encode("ascii")
        if len(data) <= MAX_RECORD_BYTES:
            _write_record(spool, start_pid, data)
    except BaseException:  # noqa: BLE001
        pass


def collect() -> dict[str, Any] | None:
    """This process's counters as a record (without pid/ppid), or None when torch compiled nothing here.

    Reads ``torch._dynamo.utils`` only if it is already imported; never imports torch."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    from ..torch_adapter import COUNTER_NAMES  # imports no torch

    raw = getattr(utils, "counters", None)
    counters: dict[str, int] = {}
    for group, names in COUNTER_NAMES.items():
        values = _group(raw, group)
        for name in names:
            counters[name] = _clamp_count(values.get(name, 0)) if values is not None else 0
    stats = _group(raw, "stats")
    graphs = _clamp_count(stats.get("unique_graphs", 0)) if stats is not None else 0
    compiles, seconds = 0, 0.0
    metrics = getattr(utils, "compilation_time_metrics", None)
    timings = metrics.get(COMPILE_METRIC) if isinstance(metrics, dict) else None
    if isinstance(timings, list):
        compiles = _clamp_count(len(timings))
        seconds = _seconds(timings)
    if not (graphs or compiles or any(counters.values())):
        return None
    isa_run, isa_reused, isa_seconds = _isa_checks()
    record: dict[str, Any] = {
        "v": RECORD_VERSION, "compiled": True, "compiles": compiles, "graphs": graphs,
        "compile_seconds": seconds, "counters": counters, "isa_run": isa_run, "isa_reused": isa_reused,
        "isa_seconds": isa_seconds, "phases": _phases(metrics),
    }
    for key, env in RANK_ENV:
        record[key] = _small_int(os.environ.get(env))
    return record


def _seconds(timings: list[Any]) -> float:
    total = 0.0
    for t in timings[:1_000_000]:
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0:
            total += float(t)
    return round(min(total, MAX_SECONDS), 6)


def _phases(metrics: Any) -> dict[str, float]:
    """The :data:`MAX_PHASES` largest of torch's compile timings, summed per name (names of torch's own code)."""
    if not isinstance(metrics, dict):
        return {}
    sums = [(_seconds(v), k) for k, v in list(metrics.items())[:10_000]
            if isinstance(k, str) and _phase_name(k) and isinstance(v, list)]
    sums.sort(key=lambda pair: (-pair[0], pair[1]))
    return {name: total for total, name in sums[:MAX_PHASES] if total > 0}


def _phase_name(name: str) -> bool:
    return 0 < len(name) <= 80 and all(c in PHASE_NAME for c in name)


def _isa_checks() -> tuple[int, int, float]:
    """torch's vector-ISA checks this process ran and took from a record, and their seconds: read from
    :mod:`.isaprobe` only when the process armed it (imported); zeros otherwise."""
    probe = sys.modules.get(__package__.rpartition(".")[0] + ".isaprobe") if __package__ else None
    if probe is None:
        return 0, 0, 0.0
    counts = probe.counts()
    return (_clamp_count(counts.get("run", 0)), _clamp_count(counts.get("reused", 0)),
            round(min(max(float(probe.check_seconds()), 0.0), MAX_SECONDS), 6))


def _group(raw: Any, group: str) -> Mapping[str, Any] | None:
    # torch's counters: defaultdict(Counter). .get does not insert a group into it.
    values = raw.get(group) if isinstance(raw, Mapping) else None
    return values if isinstance(values, Mapping) else None


def _clamp_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, min(int(value), MAX_COUNT))


def _small_int(value: str | None) -> int | None:
    """``value`` as an int when it is a small non-negative decimal (ASCII digits only), else None."""
    if value is None or not (0 < len(value) <= 7) or not value.isascii() or not value.isdigit():
        return None
    n = int(value)
    return n if n <= MAX_RANK else None


def _write_record(spool: str, pid: int, data: bytes) -> None:
    # The session creates the spool and removes it at its end: a child outliving the session finds none and
    # writes nothing (creating it again would leave a directory behind that nobody reads).
    write_atomic(os.path.join(spool, f"{pid}-{os.urandom(8).hex()}{RECORD_SUFFIX}"), data, mode=0o600)


# --- the parent's side ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChildRecord:
    """One child process's torch counters, validated."""

    file: str  # the record's file name in the spool
    pid: int
    ppid: int
    rank: int | None
    local_rank: int | None
    world_size: int | None
    compiled: bool
    compiles: int  # frames Dynamo compiled (since the child's last torch._dynamo.reset())
    graphs: int  # FX graphs Dynamo produced (torch's counters["stats"]["unique_graphs"])
    compile_seconds: float  # in those compiles (same window as compiles)
    counters: dict[str, int] = field(hash=False)  # every name of torch_adapter.COUNTER_NAMES (0 if absent)
    isa_run: int = 0  # torch's CPU vector-ISA load checks run in this child
    isa_reused: int = 0  # ... taken from a record instead (isaprobe)
    isa_seconds: float = 0.0  # in those checks, run or taken
    phases: dict[str, float] = field(default_factory=dict, hash=False)  # torch's largest compile timings by name

    def label(self) -> str:
        """A short name for the report: ``pid 123`` or ``rank 1 (pid 123)``."""
        return f"pid {self.pid}" if self.rank is None else f"rank {self.rank} (pid {self.pid})"

    def row(self) -> dict[str, Any]:
        """The child's entry in the session report (``torch.children``)."""
        return {"label": self.label(), "pid": self.pid, "ppid": self.ppid, "rank": self.rank,
                "local_rank": self.local_rank, "world_size": self.world_size, "compiles": self.compiles,
                "graphs": self.graphs, "compile_seconds": self.compile_seconds, "counters": dict(self.counters),
                "isa_checks": {"run": self.isa_run, "reused": self.isa_reused, "seconds": self.isa_seconds},
                "phases": dict(self.phases)}


class _Reject(Exception):
    """A record file failed validation; the message is a fixed reason, never the file's content."""


def read_spool(path: str | os.PathLike[str]) -> tuple[list[ChildRecord], list[str]]:
    """The valid records in ``path`` (sorted by file name) and one short reason per rejected file.

    Reads at most :data:`MAX_FILES` files of at most :data:`MAX_RECORD_BYTES` each; skips files being written
    (``.*.tmp``) and names not ending in ``.json``; never follows a symbolic link, never blocks on a FIFO, never
    raises (for ``Exception``). A missing directory is an empty spool. Reasons name the file, never its content."""
    records: list[ChildRecord] = []
    rejects: list[str] = []
    try:
        spool = os.fspath(path)
        names = _list(spool, rejects)
        if names is None:
            return records, rejects
        names.sort()
        if len(names) > MAX_FILES:
            rejects.append(f"{len(names) - MAX_FILES} more record files not read (at most {MAX_FILES})")
        known = _counter_names()
        for name in names[:MAX_FILES]:
            try:
                records.append(_parse(name, _read(os.path.join(spool, name)), known))
            except _Reject as exc:
                rejects.append(f"{_shown(name)}: {exc}")
            except Exception as exc:  # noqa: BLE001 - anything unforeseen rejects the file, not the session
                rejects.append(f"{_shown(name)}: unreadable ({type(exc).__name__})")
    except Exception as exc:  # noqa: BLE001
        rejects.append(f"spool: unreadable ({type(exc).__name__})")
    return records, rejects


class RestoreSignal:
    """The parent's side of :data:`READY_ENV`: names a file in ``directory`` (the spool) for the processes this one
    starts from now on; calls ``on_request`` (once, from a daemon thread that looks every 20 ms) when a child asks
    for the restore; creates the file once the restore has settled (:meth:`set`); at :meth:`close` removes the files
    and puts the variables back as they were."""

    POLL = 0.02

    def __init__(self, directory: str, wait_seconds: float, on_request: Callable[[], None]) -> None:
        import threading  # the parent's side only

        self.path = os.path.join(directory, f".restored-{os.getpid()}")
        self._before = {name: os.environ.get(name) for name in (READY_ENV, WAIT_ENV)}
        os.environ[READY_ENV] = self.path
        os.environ[WAIT_ENV] = f"{wait_seconds:g}"
        self._on_request = on_request
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="megacache-children-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        wanted = self.path + WANTED_SUFFIX
        while not self._done.wait(self.POLL):
            if os.path.exists(wanted):
                self._done.set()
                self._on_request()  # the plugin's start_cache: contained, idempotent

    def set(self) -> None:
        self._done.set()
        try:
            with open(self.path, "wb"):
                pass
        except OSError:  # the spool is gone: the children wait until their limit, no longer
            pass

    def close(self) -> None:
        self._done.set()
        if os.environ.get(READY_ENV) == self.path:  # not changed since by someone else
            for name, value in self._before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        for path in (self.path, self.path + WANTED_SUFFIX):
            try:
                os.unlink(path)
            except OSError:
                pass


class Spool:
    """A session's spool: a private directory (0700) named in :data:`SPOOL_ENV` for the processes this one starts
    from now on, read back at the end, then removed and the variable put back as it was. It has an owner, as the
    session's scratch has (:func:`..scratch.owned_dir`): a later session removes it if this one is killed."""

    def __init__(self) -> None:
        from ..scratch import SPOOL_PREFIX, owned_dir  # the parent's side only: a child's exit imports this module

        self.path, self._owner, _swept = owned_dir(SPOOL_PREFIX)
        self._before = os.environ.get(SPOOL_ENV)
        os.environ[SPOOL_ENV] = self.path

    def read(self) -> tuple[list[ChildRecord], list[str]]:
        return read_spool(self.path)

    def close(self) -> None:
        """Idempotent; a child still running after this finds no spool and writes nothing."""
        if os.environ.get(SPOOL_ENV) == self.path:
            if self._before is None:
                del os.environ[SPOOL_ENV]
            else:
                os.environ[SPOOL_ENV] = self._before
        from ..scratch import release

        owner, self._owner = self._owner, None
        release(self.path, owner)


def _list(spool: str, rejects: list[str]) -> list[str] | None:
    names: list[str] = []
    try:
        with os.scandir(spool) as it:
            for n, entry in enumerate(it):
                if n >= MAX_LISTED:
                    rejects.append(f"spool: more than {MAX_LISTED} entries, the rest not looked at")
                    break
                if entry.name.endswith(RECORD_SUFFIX) and not entry.name.startswith(TEMP_PREFIX):
                    names.append(entry.name)
    except FileNotFoundError:
        return None
    except OSError as exc:
        rejects.append(f"spool: cannot list ({type(exc).__name__})")
        return None
    return names


def _counter_names() -> frozenset[str]:
    from ..torch_adapter import COUNTER_NAMES

    return frozenset(name for names in COUNTER_NAMES.values() for name in names)


def _shown(name: str) -> str:
    ok = len(name) <= 80 and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    return name if ok else ascii(name[:60])


def _read(full: str) -> bytes:
    try:
        return read_regular(full, MAX_RECORD_BYTES)
    except Refused as exc:  # a symbolic link, not a regular file, larger than the cap
        raise _Reject(str(exc)) from None
    except OSError as exc:
        raise _Reject(f"cannot read ({type(exc).__name__})") from None


def _no_constants(name: str) -> Any:
    raise _Reject("not JSON (NaN or Infinity)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise _Reject("a key given twice")
    return doc


def _parse(name: str, data: bytes, known: frozenset[str]) -> ChildRecord:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _Reject("not UTF-8") from None
    try:
        doc = json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except _Reject:
        raise
    except RecursionError:
        raise _Reject("not JSON (nested too deeply)") from None
    except ValueError:
        raise _Reject("not JSON") from None
    if not isinstance(doc, dict):
        raise _Reject("not a JSON object")
    if doc.get("v") != RECORD_VERSION or type(doc.get("v")) is not int:
        raise _Reject("missing or unsupported version")
    if set(doc) != _KEYS:
        unknown, missing = len(set(doc) - _KEYS), len(_KEYS - set(doc))
        raise _Reject(f"{unknown} unknown and {missing} missing keys")
    ints = {key: _int(doc[key], key, MAX_PID if key in ("pid", "ppid") else MAX_COUNT) for key in _INT_FIELDS}
    ranks = {key: None if doc[key] is None else _int(doc[key], key, MAX_RANK) for key, _ in RANK_ENV}
    if type(doc["compiled"]) is not bool:
        raise _Reject("compiled is not true or false")
    seconds = {key: _number(doc[key], key) for key in _SECONDS_FIELDS}
    phases = doc["phases"]
    if not isinstance(phases, dict) or len(phases) > MAX_PHASES or not all(map(_phase_name, phases)):
        raise _Reject(f"phases is not an object of at most {MAX_PHASES} timings by name")
    phases = {name: _number(value, "a phase") for name, value in phases.items()}
    raw = doc["counters"]
    if not isinstance(raw, dict):
        raise _Reject("counters is not an object")
    if not set(raw) <= known:
        raise _Reject(f"{len(set(raw) - known)} unknown counter names")
    counters = {name: _int(raw.get(name, 0), "a counter", MAX_COUNT) for name in sorted(known)}
    return ChildRecord(
        file=name, pid=ints["pid"], ppid=ints["ppid"], rank=ranks["rank"], local_rank=ranks["local_rank"],
        world_size=ranks["world_size"], compiled=doc["compiled"], compiles=ints["compiles"], graphs=ints["graphs"],
        compile_seconds=seconds["compile_seconds"], counters=counters, isa_run=ints["isa_run"],
        isa_reused=ints["isa_reused"], isa_seconds=seconds["isa_seconds"], phases=phases,
    )


def _number(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise _Reject(f"{what} is not a number from 0 to {MAX_SECONDS:g}")
    return float(value)


def _int(value: Any, what: str, limit: int) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise _Reject(f"{what} is not an integer from 0 to {limit}")
    return value
