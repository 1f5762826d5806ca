"""The cache flow as plain Python: a session's restore, load, collect and upload.

:class:`CacheSession` coordinates one session over one object per phase: the restore (:mod:`.restore`: its thread,
deadline and staging), the load into torch (:class:`Load`), the upload (:mod:`.upload`) and its compaction
(:mod:`.compaction`). The pytest plugin drives it from hooks; the CLI and benchmarks can drive it directly. Nothing
here imports pytest or torch (torch is reached through :class:`TorchAdapter`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import bundle as bundlemod
from .bundle import PRECOMPILE_KIND, Entries, Entry, Limits
from .compaction import PART_FIELD, STALE_GROUP_SECONDS, Held, units
from .errors import BundleError, LocalDiskError, StoreError, redact_cut
from .files import FileRoot, inductor_cache_dir, place_dynamo, torch_cache_ident
from .report import LoadStats, RestoreStats, TorchStats, UploadStats, unstorable_note, unused_note
from .restore import RESTORE_GRACE, Diagnosis, Restore, Stager, nearest_fingerprint, producer_selections
from .scratch import Scratch
from .stores import Deadline, ObjectInfo, Store, bounded
from .torch_adapter import LoadResult, MegaCache, TorchAdapter
from .upload import Profiles, Upload, artifact_ident, plural_entries, restored_cold_seconds

__all__ = [
    "PART_FIELD", "RESTORE_GRACE", "STALE_GROUP_SECONDS", "CacheSession", "Diagnosis", "Held", "nearest_fingerprint",
    "other_process_layers", "plural_entries", "units", "without_torch_twins",
]

# Store failures that make every later call fail too: report once, do not try to upload.
STORE_DOWN_KINDS = frozenset({"unreachable", "no-bucket", "denied", "credentials", "config", "timeout"})
_ident = artifact_ident


class CacheSession:
    """One session's traffic with the cache. Thread-safe where the restore thread is involved.

    Every store operation runs against a wall-clock budget (:mod:`deadline`): the restore (connecting,
    listing, fetching) against ``restore_timeout`` from its start, the upload (and compaction) against
    ``upload_timeout``. Waiting for the restore is paid once (:class:`.restore.Restore`)."""

    def __init__(
        self,
        *,
        store_factory: Callable[[], Store],
        folder: str,
        fingerprint: str,
        roots: list[FileRoot],
        reads: bool,
        writes: bool,
        compact_after: int = 8,
        limits: Limits = bundlemod.DEFAULT_LIMITS,
        read_folders: Sequence[str] | None = None,
        signing_keys: Sequence[bytes] = (),
        meta: Mapping[str, object] | None = None,
        restore_timeout: float = 120.0,
        upload_timeout: float = 60.0,
        diagnosis: Diagnosis | None = None,
        stage: Stager | None = None,
        on_settled: Callable[[], None] | None = None,
    ) -> None:
        self._store_factory = store_factory
        self._store: Store | None = None
        self.folder = folder  # where this session writes (its scope)
        # Where it reads, in order: its own scope first, then the default branch's.
        self.read_folders = list(dict.fromkeys(read_folders or [folder]))
        self.signing_keys = list(signing_keys)
        self.meta = dict(meta or {})
        self.fingerprint = fingerprint
        self.roots = roots
        self.reads = reads
        self.writes = writes
        self.compact_after = compact_after
        self.limits = limits
        self.restore_timeout = restore_timeout
        self.upload_timeout = upload_timeout
        self.diagnosis = diagnosis
        self.stage = stage  # an xdist controller's: stages the restore for its workers (entries, fingerprint, ok, selections)
        self.on_settled = on_settled  # called once the restore has settled (done or given up): children may go on
        self.problems: list[str] = []
        self.notes: list[str] = []  # said once in the summary; not problems
        self._problem_lock = threading.Lock()
        self._reported = 0
        self._store_down = False
        self.scratch = Scratch()  # the objects fetched and the compiled files restored or collected
        self.restore = Restore(self)
        self.upload = Upload(self)
        self.load = Load(self)
        self.torch_stats = TorchStats()

    # --- what the phases found --------------------------------------------------------------------
    @property
    def restore_stats(self) -> RestoreStats:
        return self.restore.stats

    @property
    def upload_stats(self) -> UploadStats:
        return self.upload.stats

    @property
    def restored(self) -> Entries:
        """Every entry the restore gave."""
        return self.restore.restored

    @restored.setter
    def restored(self, entries: Entries) -> None:
        self.restore.restored = entries

    @property
    def restored_objects(self) -> list[ObjectInfo]:
        return self.restore.objects

    @property
    def restored_own(self) -> Entries:
        return self.restore.own

    @property
    def restored_held(self) -> list[Held]:
        return self.restore.held

    @property
    def restored_headers(self) -> list[bundlemod.Header]:
        return self.restore.headers

    @property
    def before(self) -> dict[str, set[str]]:
        """The cache directories' files when the restore settled: what the session adds is what is new since."""
        return self.restore.before

    @property
    def wait_seconds(self) -> float:
        return self.restore.wait_seconds

    @property
    def store_down(self) -> bool:
        """A store that failed in a way every later call would too: no upload is tried."""
        return self._store_down or self.restore.store_down

    @store_down.setter
    def store_down(self, down: bool) -> None:
        self._store_down = down

    def close(self) -> None:
        """Remove the scratch directory (what is restored is in place by now, what is new is uploaded)."""
        self.scratch.close()

    # --- problems ---------------------------------------------------------------------------------
    def problem(self, message: str) -> None:
        with self._problem_lock:
            self.problems.append(message)

    def new_problems(self) -> list[str]:
        """Problems not yet handed out (the plugin warns about each exactly once)."""
        with self._problem_lock:
            out = self.problems[self._reported :]
            self._reported = len(self.problems)
        return out

    def store_error(self, what: str, exc: StoreError) -> None:
        if exc.kind in STORE_DOWN_KINDS:
            self._store_down = True
        self.problem(f"{what}: {exc}")

    def store(self) -> Store:
        """The store, built on first use (building an S3 client reads the AWS configuration)."""
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def bounded_store(self, deadline: Deadline) -> Store:
        return bounded(self.store, deadline, "connecting to the store")

    # --- restore ----------------------------------------------------------------------------------
    def start_restore(self, background: bool = True) -> None:
        """Start the restore against its budget; in a daemon thread unless ``background`` is False."""
        self.restore.start(background)

    @property
    def restore_finished(self) -> bool:
        """The restore ran to its end (successfully or not) in time; its result may be used."""
        return self.restore.finished

    def wait_restore(self) -> bool:
        """Wait for the restore until its deadline, at most; True if it finished in time (paid once)."""
        return self.restore.wait()

    def wait_diagnosis(self) -> None:
        """Until the why-miss diagnosis is done, or the restore's deadline."""
        self.restore.wait_diagnosis()

    # --- load -------------------------------------------------------------------------------------
    @property
    def load_stats(self) -> LoadStats:
        return self.load.stats

    def load_into_torch(self, loader: Callable[[bytes], LoadResult] = MegaCache.load) -> None:
        """Called on the first compile: wait for the restore, validate, hand torch its artifacts (:class:`Load`)."""
        self.load.run(loader)

    # --- collect, merge, upload ------------------------------------------------------------------
    def account(self, adapter: TorchAdapter | None, workers: Sequence[Mapping[str, Any]] = ()) -> TorchStats:
        """torch's figures for this session (and its xdist workers'), with per-layer use and seconds saved."""
        ts = TorchStats.from_adapter(adapter) if adapter is not None else TorchStats()
        for worker in workers:
            ts.add(worker)
        restored_torch = {e.ident for e in self.restored.of_kind_prefix(bundlemod.TORCH_PREFIX)}
        # Dynamo reuse installs entries where torch.compile() wraps a function: every one this process installed
        installed = [_ident(f"{kind}:{key}") for kind, key in TorchAdapter.seen_artifacts()
                     if kind == "precompile"] if adapter is not None else []
        ts.count_use(restored_cold_seconds(self.restored_headers), restored_torch, _ident, installed,
                     self.restored.counts(), bundlemod.TORCH_PREFIX)
        self.torch_stats = ts
        return ts

    def producer_selections(self) -> set[str]:
        """The test selections of the sessions that stored the restored objects."""
        return producer_selections(self.restored_headers)

    def expects_full_coverage(self, selection: str | None) -> bool:
        """Whether a restored object came from a session that ran this very selection of tests: everything
        that session compiled was uploaded, so this one should find all of it cached."""
        return bool(selection) and selection in self.producer_selections()

    def check_unused(self, selection: str | None) -> None:
        """Restored objects that torch hit none of: a note, never a problem (:func:`.report.unused_note`)."""
        note = unused_note(self.restore_stats, self.torch_stats, self.load_stats, self.expects_full_coverage(selection))
        self.notes.extend([note] if note else [])

    def check_unstorable(self, eager_backward: bool = False) -> None:
        """AOTAutograd graphs compiled but never stored: a note (:func:`.report.unstorable_note`)."""
        note = unstorable_note(self.torch_stats, eager_backward)
        self.notes.extend([note] if note else [])

    def finish(self, adapter: TorchAdapter | None, *, workers: Sequence[Mapping[str, Any]] = (),
               worker_entries: Entries | None = None, worker_profiles: Profiles | None = None) -> None:
        """Record torch's counters, then upload what is new (this process's and its xdist workers'); with nothing
        new, merge the objects of this scope when there are too many of them or they overlap (:meth:`needs_merge`)."""
        self.account(adapter, workers)
        if worker_entries is not None:
            # Workers sharing cache directories (the user chose them) each find the graphs the other workers
            # recorded (they travel in those workers' torch entries: dropped here) and what the others' children
            # wrote: the graphs other processes compiled are counted once, from what the workers handed over.
            worker_entries = without_torch_twins(worker_entries, self.restored)
            if workers:
                self.torch_stats.other_processes = other_process_layers(worker_entries)
        up = self.upload_stats
        # Wait even when nothing compiled, so a broken store is reported in every session (paid once).
        if self.reads and not self.wait_restore():
            up.reason = "restore unfinished"
            return
        if not self.writes:
            up.reason = "read-only mode"
            return
        if not self.torch_stats.compiled and not self.roots and not worker_entries and not self.needs_merge():
            up.reason = "nothing was compiled"
            return
        if self.store_down:
            up.reason = "store unavailable"
            return
        start = time.perf_counter()
        try:
            self.upload.run(self.upload.collect(adapter), worker_entries, worker_profiles)
        except LocalDiskError as exc:  # the scratch directory made to collect the compiled files: this machine's disk
            self.upload.not_collected(exc)
        finally:
            up.seconds = time.perf_counter() - start

    def own_units(self) -> list[Held]:
        """The objects of this scope the restore used, as compaction units (a whole group of parts is one)."""
        return units(self.restored_held)[0]

    def needs_merge(self) -> bool:
        """Whether this scope's objects should be merged even with nothing new to store: more of them than
        ``compact_after``, or the same entry in more than one (each later restore would fetch it again)."""
        if not (self.reads and self.writes and self.restore_finished and self.restore_stats.ok):
            return False
        held = self.own_units()
        return len(held) > self.compact_after or sum(len(h.entries) for h in held) > len(self.restored_own)

    def scrubbed(self, entries: Entries) -> Entries:
        """``entries`` as they may be stored (:meth:`.upload.Upload.scrubbed`)."""
        return self.upload.scrubbed(entries)


def without_torch_twins(entries: Entries, restored: Entries) -> Entries:
    """``entries`` less the files of torch's on-disk caches whose artifact travels as a torch entry already (in
    ``entries`` or ``restored``): one graph, carried once."""
    known = {e.ident for e in entries.of_kind_prefix(bundlemod.TORCH_PREFIX)}
    known |= {e.ident for e in restored.of_kind_prefix(bundlemod.TORCH_PREFIX)}
    return Entries(e for e in entries if not (e.kind == bundlemod.FILE_PREFIX + "inductor"
                                              and torch_cache_ident(e.name) in known))


def other_process_layers(entries: Entries) -> dict[str, int]:
    """Per torch layer, the distinct FX-graph and AOTAutograd entries that travel as files (compiled by processes
    that did not record them: child processes)."""
    idents = {ident for e in entries if e.kind == bundlemod.FILE_PREFIX + "inductor"
              and (ident := torch_cache_ident(e.name)) is not None}
    out: dict[str, int] = {}
    for kind, _key in idents:
        layer = kind[len(bundlemod.TORCH_PREFIX):]
        out[layer] = out.get(layer, 0) + 1
    return out


class Load:
    """The load, once a session, on its first compile: the restore waited for, what it gave checked and handed to
    torch (its artifacts to torch's loader, Dynamo's entries into torch's Dynamo cache), and what that took."""

    def __init__(self, session: CacheSession) -> None:
        self.session = session
        self.stats = LoadStats()
        self.done = False  # tried once, whatever came of it

    def run(self, loader: Callable[[bytes], LoadResult]) -> None:
        if self.done:
            return
        self.done = True
        session = self.session
        if not session.reads:
            return
        waiting = time.perf_counter()
        finished = session.wait_restore()
        self.stats.waited = round(time.perf_counter() - waiting, 4)
        if not finished:
            return
        try:
            container = session.restored.torch_container()
        except BundleError as exc:
            session.problem(f"restored artifacts refused: {exc}")
            return
        dynamo = session.restored.of_kind_prefix(PRECOMPILE_KIND)
        if container is None and not dynamo:
            return
        result, unplaced = hand_to_torch(loader, container, dynamo)
        if unplaced:
            session.problem(f"restored Dynamo entries not placed (their frames are traced): {'; '.join(unplaced[:3])}")
        self.stats = LoadStats(True, result.ok, result.artifacts, result.seconds, result.error, self.stats.waited)
        if not result.ok:
            session.problem(f"torch did not load the restored artifacts: {result.error}")


def hand_to_torch(loader: Callable[[bytes], LoadResult], container: bytes | None,
                  dynamo: Sequence[Entry]) -> tuple[LoadResult, list[str]]:
    """torch's loader on ``container``, then Dynamo's stored entries into torch's Dynamo cache as files
    (:func:`.files.place_dynamo`), counted with what torch loaded; also what could not be placed, and why (a full
    disk: one reason for all of them)."""
    result, refused = LoadResult(True), list[str]()
    if container is not None:
        try:
            result = loader(container)
        except Exception as exc:  # noqa: BLE001 - torch's loader, whatever it raises: a cold run, not a failure
            result = LoadResult(False, error=f"{type(exc).__name__}: {redact_cut(str(exc))}")
    if not result.ok or not dynamo:
        return result, refused
    started = time.perf_counter()
    try:
        placed = place_dynamo(dynamo, inductor_cache_dir(), refused)
    except OSError as exc:
        return result, [f"{exc.strerror or exc}"]
    result.seconds += time.perf_counter() - started
    if placed:
        result.artifacts["precompile"] = result.artifacts.get("precompile", 0) + placed
    return result, refused
