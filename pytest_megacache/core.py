"""The cache flow as plain Python: restore, load, collect, merge, upload.

The pytest plugin drives it from hooks; the CLI and benchmarks can drive it directly. Nothing here
imports pytest or torch (torch is reached through :class:`TorchAdapter`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import bundle as bundlemod
from . import envpolicy
from .bundle import Entries, Entry, Limits
from .deadline import Deadline, bounded, bounded_map
from .errors import BundleError, StoreError, redact, redact_cut
from .files import FileRoot, torch_cache_ident
from .layout import OBJECT_SUFFIX, Layout, valid_object_name
from .report import LoadStats, RestoreStats, TorchStats, UploadStats
from .stores import ObjectInfo, Store, new_object_name
from .torch_adapter import HIT_COUNTERS, MISS_COUNTERS, LoadResult, TorchAdapter, counter_sum

# Store failures that make every later call fail too: report once, do not try to upload.
STORE_DOWN_KINDS = frozenset({"unreachable", "no-bucket", "denied", "credentials", "config", "timeout"})
FETCH_WORKERS = 8
# Past the restore's budget (every store operation in it stops there), how long a waiter gives the restore
# thread to write what it fetched before going on without it (slow local disk, a starved CPU).
RESTORE_GRACE = 1.0
MAX_COLD_SECONDS = 500  # artifacts whose cold compile seconds one object's header records
MAX_COMPILE_SECONDS = 86_400.0  # what one recorded compile may claim to have cost


def _ident(artifact: str) -> tuple[str, str]:
    typ, _, key = artifact.partition(":")
    return (bundlemod.TORCH_PREFIX + typ, key)


@dataclass
class Fetched:
    folder: str
    info: ObjectInfo
    size: int
    path: str | None  # where it was fetched to (a scratch file), until it is decoded
    created: float = 0.0  # what its header says (unverified until it is decoded): newest first
    header: bundlemod.Header | None = None
    entries: Entries | None = None
    vanished: bool = False  # listed, then gone when fetched: a compaction deleted it (what it held is elsewhere)


@dataclass(frozen=True)
class Diagnosis:
    """Where to look, when nothing is stored for this fingerprint, for the nearest one that is (why-miss)."""

    prefix: str
    scopes: Sequence[str]
    key: str
    parts: Mapping[str, object]


# Listings of the read folders a restore makes when an object it listed was gone when fetched (a compaction
# deleted it, having stored what it held in a newer object): the first and at most two more.
RESTORE_ROUNDS = 3
# Listings of the folder a compaction makes to merge what concurrent sessions stored meanwhile (each may merge
# once more, but the last); what is left then is merged by the next compaction.
COMPACTION_ROUNDS = 4


@dataclass
class _Held:
    """An object of the write folder as a compaction sees it, validated, with what it holds; or a whole group of
    parts (objects one session wrote together, :data:`PART_FIELD`), which counts as one."""

    name: str  # the object's name, or its group's id
    created: float  # from its header (a group's: its oldest part's): every session reads the same value
    entries: Entries
    headers: tuple[bundlemod.Header, ...] = ()  # () for what this session wrote
    parts: tuple[str, ...] = ()  # a group's objects; () for one object

    @property
    def objects(self) -> tuple[str, ...]:
        """The stored objects it is: deleting it deletes each."""
        return self.parts or (self.name,)

    @property
    def rank(self) -> tuple[float, str]:
        """Newer is greater: (created, name), unique within a folder."""
        return (self.created, self.name)

    def order(self) -> tuple[int, float, str]:
        return (len(self.entries), *self.rank)


# The header field that marks an object as one part of a group (what one session wrote together because one object
# would be over the restore limits): {"group": id, "index": i}, and in the last part "count": n as well (parts are
# encoded and stored one at a time). A group counts as one object for compaction: it covers or is covered whole,
# once every part is listed.
PART_FIELD = "part"
MAX_PARTS = 4096
# A group some of whose parts are missing is being uploaded or deleted; past this age it is neither (every upload and
# deletion is bounded by its session's budget), and each part left is taken as an object of its own.
STALE_GROUP_SECONDS = 3600.0


def _part_of(header: bundlemod.Header | None) -> tuple[str, int, int | None] | None:
    """(group id, index, count: the last part's only) from a header's part field, when it is a well-formed one."""
    doc = header.extra.get(PART_FIELD) if header is not None else None
    if not isinstance(doc, dict):
        return None
    group, index, count = doc.get("group"), doc.get("index"), doc.get("count")
    if (not isinstance(group, str) or not valid_object_name(group) or isinstance(index, bool)
            or not isinstance(index, int) or not 0 <= index < MAX_PARTS):
        return None
    if count is None:
        return group, index, None
    if isinstance(count, bool) or not isinstance(count, int) or count != index + 1:
        return None
    return group, index, count


def units(objects: Sequence[_Held], now: float | None = None) -> tuple[list[_Held], list[str]]:
    """The objects of a folder as compaction units: each object on its own, and each group whose every part is
    there as one; also the objects of groups not whole yet (neither deleted nor merged for now). A group's parts
    left past :data:`STALE_GROUP_SECONDS` are objects of their own."""
    now = time.time() if now is None else now
    out: list[_Held] = []
    groups: dict[str, dict[int, _Held]] = {}
    counts: dict[str, set[int]] = {}
    for held in objects:
        part = next(filter(None, (_part_of(h) for h in held.headers)), None)
        if part is None:
            out.append(held)
            continue
        groups.setdefault(part[0], {}).setdefault(part[1], held)
        counts.setdefault(part[0], set()).update([part[2]] if part[2] is not None else [])
    pending: list[str] = []
    for gid, parts in sorted(groups.items()):
        count = min(counts.get(gid) or {0})
        if len(counts.get(gid, ())) == 1 and len(parts) == count and max(parts) == count - 1:
            entries = Entries()
            for i in range(count):
                entries.merge(parts[i].entries)
            out.append(_Held(gid, min(p.created for p in parts.values()), entries,
                             tuple(h for i in range(count) for h in parts[i].headers),
                             tuple(parts[i].name for i in range(count))))
        elif all(now - p.created > STALE_GROUP_SECONDS for p in parts.values()):
            out.extend(parts.values())
        else:
            pending.extend(p.name for p in parts.values())
    return out, pending


def _covers(big: _Held, small: _Held) -> bool:
    """Whether ``small`` may be deleted because ``big`` is stored: ``big`` holds an entry of every ``(kind, name)``
    that ``small`` does and, with the same ones, is the newer; for a profile (mutable) that differs, ``big`` is
    the newer too (a restore takes the newest object's). A strict order: no two objects cover each other."""
    if small.name == big.name or len(small.entries) > len(big.entries):
        return False
    newer = big.rank > small.rank
    if len(small.entries) == len(big.entries) and not newer:
        return False
    for entry in small.entries:
        other = big.entries.get(entry.ident)
        if other is None or (entry.kind in bundlemod.MUTABLE_KINDS and other.data != entry.data and not newer):
            return False
    return True


class CacheSession:
    """One session's traffic with the cache. Thread-safe where the restore thread is involved.

    Every store operation runs against a wall-clock budget (:mod:`deadline`): the restore (connecting,
    listing, fetching) against ``restore_timeout`` from its start, the upload (and compaction) against
    ``upload_timeout``. Waiting for the restore is paid once: whoever waits first waits until the restore's
    deadline at most, and every later wait returns at once."""

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
        stage_dir: Path | None = None,
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
        self.stage_dir = stage_dir  # an xdist controller's: where the restore is staged for its workers
        self.on_settled = on_settled  # called once the restore has settled (done or given up): children may go on
        self.problems: list[str] = []
        self.notes: list[str] = []  # said once in the summary; not problems
        self._problem_lock = threading.Lock()
        self._reported = 0
        self.store_down = False
        self.restored = Entries()
        self.restored_objects: list[ObjectInfo] = []  # objects of the write folder (compaction input)
        self.restored_own = Entries()  # what those objects hold
        self.restored_held: list[_Held] = []  # those objects, with what each holds (compaction input)
        self.restored_headers: list[bundlemod.Header] = []
        self.before: dict[str, set[str]] = {}
        self.restore_stats = RestoreStats()
        self.load_stats = LoadStats()
        self.upload_stats = UploadStats()
        self.torch_stats = TorchStats()
        self._thread: threading.Thread | None = None
        self._deadline: Deadline | None = None
        self.wait_seconds = 0.0  # time callers spent blocked in wait_restore (the restore's cost to the session)
        self._state_lock = threading.Lock()
        self._state = "idle"  # idle -> running -> committing -> done, or running -> abandoned
        self._settled = threading.Event()  # done or abandoned: nobody waits any more
        self._diagnosed = threading.Event()
        self._loaded = False
        self._scratch: str | None = None
        self._scratch_lock = threading.Lock()

    # --- scratch space ----------------------------------------------------------------------------
    def scratch(self) -> str:
        """The session's scratch directory, made on first use: the objects fetched, and the compiled files restored
        or collected, each in a file of its own, so that they are never all in memory. Removed by :meth:`close`,
        or at interpreter exit."""
        with self._scratch_lock:
            if self._scratch is None:
                self._scratch = tempfile.mkdtemp(prefix="pytest-megacache-scratch-")
                weakref.finalize(self, shutil.rmtree, self._scratch, True)
            return self._scratch

    def close(self) -> None:
        """Remove the scratch directory (what is restored is in place by now, what is new is uploaded)."""
        with self._scratch_lock:
            scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

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

    def _store_error(self, what: str, exc: StoreError) -> None:
        if exc.kind in STORE_DOWN_KINDS:
            self.store_down = True
        self.problem(f"{what}: {exc}")

    def store(self) -> Store:
        """The store, built on first use (building an S3 client reads the AWS configuration)."""
        if self._store is None:
            self._store = self._store_factory()
        return self._store

    def _bounded_store(self, deadline: Deadline) -> Store:
        return bounded(self.store, deadline, "connecting to the store")

    # --- restore ----------------------------------------------------------------------------------
    def start_restore(self, background: bool = True) -> None:
        """Start the restore against its budget; in a daemon thread unless ``background`` is False."""
        with self._state_lock:
            if self._state != "idle":
                return
            self._state = "running"
        self._deadline = Deadline(self.restore_timeout, "the restore", "--megacache-timeout")
        if not self.reads:
            self._snapshot()
            self._settle("done")
            self._diagnosed.set()
            return
        if background:
            self._thread = threading.Thread(target=self._restore_guarded, name="megacache-restore", daemon=True)
            self._thread.start()
        else:
            self._restore_guarded()

    @property
    def restore_finished(self) -> bool:
        """The restore ran to its end (successfully or not) in time; its result may be used."""
        return self._state == "done"

    def wait_restore(self) -> bool:
        """Wait for the restore until its deadline, at most; True if it finished in time.

        The first wait that reaches the deadline abandons the restore (one problem, said once); every wait
        after that returns at once, so the budget is paid once per session whoever waits."""
        if self._settled.is_set() or self._deadline is None:
            return self.restore_finished
        started = time.perf_counter()
        try:
            return self._wait_restore()
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _wait_restore(self) -> bool:
        assert self._deadline is not None
        if self._settled.wait(self._deadline.remaining() + RESTORE_GRACE):
            return self.restore_finished
        with self._state_lock:
            committing = self._state == "committing"
            if self._state == "running":
                self._state = "abandoned"
        if committing:  # writing validated files to local disk: part of the session's own time
            self._settled.wait()
            return self.restore_finished
        if self._state == "abandoned" and not self._settled.is_set():
            self.store_down = True  # what did not answer in time would not take an upload either
            self.problem(f"restore did not finish within {self.restore_timeout:g} s (--megacache-timeout); "
                         "the session went on without it and uploads nothing")
            self._snapshot()
            self._mark_settled()
            self._diagnosed.set()
        return self.restore_finished

    def _settle(self, state: str) -> None:
        with self._state_lock:
            if self._state != "abandoned":
                self._state = state
        self._mark_settled()

    def _mark_settled(self) -> None:
        self._settled.set()
        if self.on_settled is not None:
            try:
                self.on_settled()
            except Exception as exc:  # noqa: BLE001
                self.problem(f"signalling the end of the restore: {type(exc).__name__}: {redact_cut(str(exc))}")

    def _commit(self) -> bool:
        """Whether the restore may still write its result (it was not abandoned)."""
        with self._state_lock:
            if self._state != "running":
                return False
            self._state = "committing"
            return True

    def _restore_guarded(self) -> None:
        try:
            self._restore()
        except Exception as exc:  # noqa: BLE001 - a cache bug must never fail the session
            self.problem(f"restore failed unexpectedly: {type(exc).__name__}: {redact_cut(str(exc))}")
        finally:
            if self._state in ("running", "committing"):  # not abandoned: the waiter snapshotted then
                self._snapshot()
                self._stage()
                self._settle("done")
        try:
            self._diagnose()
        finally:
            self._diagnosed.set()

    def _stage(self) -> None:
        """For an xdist controller: what was restored, staged for the workers before anyone may use it."""
        if self.stage_dir is None:
            return
        from . import xdist

        try:
            xdist.stage(self.stage_dir, self.restored, self.fingerprint, self.restore_stats.ok,
                        sorted(self.producer_selections()))
        except Exception as exc:  # noqa: BLE001
            self.problem(f"staging the restore for the xdist workers: {type(exc).__name__}: {redact_cut(str(exc))}")

    def _snapshot(self) -> None:
        try:
            self.before = {root.kind: root.snapshot() for root in self.roots}
        except Exception as exc:  # noqa: BLE001 - a cache directory we cannot read: collect nothing from it
            self.problem(f"cannot read the cache directories: {type(exc).__name__}: {redact_cut(str(exc))}")

    def _fetch(self, store: Store, folder: str, info: ObjectInfo) -> Fetched:
        """One object, fetched into a scratch file a chunk at a time (decoded later, by :meth:`_decode`)."""
        path = self._fetch_file(store, folder, info.name)
        if path is None:  # deleted by a concurrent compaction: its content is in a newer object
            return Fetched(folder, info, 0, None, vanished=True)
        with open(path, "rb") as fh:
            doc = bundlemod.peek_header(fh.read(bundlemod.HEADER_PREFIX_BYTES)) or {}
        created = bundlemod.number(doc.get("created"), 0.0, bundlemod.MAX_CREATED) or 0.0
        return Fetched(folder, info, os.path.getsize(path), path, created)

    def _fetch_file(self, store: Store, folder: str, name: str) -> str | None:
        """The object in a new scratch file (its path), or None when it is gone."""
        fd, path = tempfile.mkstemp(dir=self.scratch(), suffix=OBJECT_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as dest:
                found = store.fetch(folder, name, self.limits.max_object_bytes, dest)
        except BaseException:
            _unlink(path)
            raise
        if not found:
            _unlink(path)
            return None
        return path

    def _decode(self, got: Fetched, held: Entries | None) -> None:
        """Validate and decode a fetched object (then drop its file); its defect is its own, named problem. An entry
        of ``held`` stands for the object's copy of it (:func:`.bundle.read_object`)."""
        if got.path is None:
            return
        try:
            with open(got.path, "rb") as fh:
                header, decoded = bundlemod.read_object(fh, self.fingerprint, self.limits, self.signing_keys,
                                                        self.scratch(), held)
        except (BundleError, OSError) as exc:  # read_object turns what a hostile object provokes into a BundleError
            self.problem(f"refused {got.folder}/{got.info.name}: {redact_cut(str(exc))}")
            return
        finally:
            _unlink(got.path)
        got.header, got.entries = header, decoded.entries
        self.restore_stats.raw_fetched += decoded.entries.raw_bytes()
        self.restore_stats.raw_decompressed += decoded.decompressed

    def _fetch_all(self, store: Store, listing: list[tuple[str, ObjectInfo]], deadline: Deadline) -> list[Fetched]:
        """Every listed object, fetched and validated. An object deleted between the listing and its fetch was
        covered by an object stored before it went: the folders are listed again for what is new (a few times at
        most), so a restore that races a compaction still gets every entry."""
        results: list[Fetched] = []
        done = {(folder, info.name) for folder, info in listing}
        failed = late = 0
        for round_ in range(RESTORE_ROUNDS):
            outcomes = bounded_map(lambda item: self._fetch(store, *item), listing, deadline, FETCH_WORKERS)
            for (folder, info), outcome in zip(listing, outcomes, strict=True):
                if isinstance(outcome, StoreError):
                    failed += 1
                    if outcome.kind == "timeout":
                        late += 1
                    else:
                        self.problem(f"fetching {info.name}: {outcome}")
                    results.append(Fetched(folder, info, 0, None))
                else:
                    results.append(outcome)
            if round_ == RESTORE_ROUNDS - 1 or not any(isinstance(o, Fetched) and o.vanished for o in outcomes):
                break
            try:
                again = [(folder, info) for folder in self.read_folders
                         for info in bounded(lambda f=folder: store.list(f), deadline, "listing the store")  # type: ignore[misc]
                         if (folder, info.name) not in done]
            except StoreError:
                break  # what was fetched stands
            listing = again
            done.update((folder, info.name) for folder, info in listing)
            self.restore_stats.objects_listed += len(listing)
            if not listing:
                break
        if late:  # one fault, one problem: not one per object the budget cut short
            self.problem(f"restore: {late} of {len(results)} objects were not fetched within the budget of the restore "
                         f"({self.restore_timeout:g} s, --megacache-timeout); the session went on without them")
        if failed and failed == len(results):
            self.store_down = True  # nothing came through: an upload would not either
        return results

    def _restore(self) -> None:
        stats = self.restore_stats
        stats.attempted = True
        start = time.perf_counter()
        assert self._deadline is not None
        deadline = self._deadline
        listing: list[tuple[str, ObjectInfo]] = []
        try:
            store = self._bounded_store(deadline)
            for folder in self.read_folders:
                listing.extend((folder, info) for info in bounded(lambda f=folder: store.list(f), deadline,  # type: ignore[misc]
                                                                   "listing the store"))
        except StoreError as exc:
            self.store_down = True  # a store that cannot list will not take an upload: one fault, one warning
            self.problem(f"restore: {exc}")
            stats.seconds = time.perf_counter() - start
            return
        stats.objects_listed = len(listing)
        results = self._fetch_all(store, listing, deadline)
        merged = Entries()
        # Newest first (by the time each object records), so that the newest copy of a mutable artifact is taken;
        # an entry taken already stands for the later objects' copies, whose frames are then not decompressed.
        results.sort(key=lambda got: (got.created, got.info.name), reverse=True)
        for got in results:
            stats.bytes_fetched += got.size
            if deadline.expired():  # the session goes on without this restore: nothing more is decoded
                if got.path is not None:
                    _unlink(got.path)
                continue
            self._decode(got, merged)
            if got.entries is None or got.header is None:
                stats.objects_rejected += got.size > 0
                continue
            merged.update(got.entries)
            stats.objects_used += 1
            stats.folders[got.folder] = stats.folders.get(got.folder, 0) + 1
            self.restored_headers.append(got.header)
            if got.folder == self.folder:
                self.restored_objects.append(got.info)
                self.restored_own.update(got.entries)  # newest first: its copy of a profile wins
                self.restored_held.append(_Held(got.info.name, got.header.created, got.entries, (got.header,)))
        stats.raw_unique = merged.raw_bytes()
        if not self._commit():
            return  # abandoned: the session went on without this restore; write nothing now
        try:
            for root in self.roots:
                written, present = root.restore(merged, stats.files_refused)
                stats.files_written += written
                stats.files_present += present
        except (OSError, BundleError) as exc:
            self.problem(f"restoring compiled files failed ({exc}); those kernels will be rebuilt")
        if stats.files_refused:
            self.problem(f"{len(stats.files_refused)} restored files were refused and not written, the rest were "
                         f"(what they held is rebuilt): {'; '.join(stats.files_refused[:3])}")
        self.restored = merged
        stats.entries = merged.counts()
        stats.ok = True
        stats.seconds = time.perf_counter() - start

    def _diagnose(self) -> None:
        """Why nothing was restored: after the restore settled (off the critical path), within its budget."""
        stats, target, deadline = self.restore_stats, self.diagnosis, self._deadline
        if target is None or deadline is None or not (stats.ok and stats.objects_listed == 0):
            return
        try:
            store = self._bounded_store(deadline)
            stats.why_miss = bounded(lambda: nearest_fingerprint(store, target.prefix, target.scopes, target.key,
                                                                 target.parts), deadline, "the why-miss diagnosis")
        except StoreError as exc:
            stats.why_miss = f"unknown ({exc})"

    def wait_diagnosis(self) -> None:
        """Until the why-miss diagnosis is done, or the restore's deadline."""
        if self._deadline is not None:
            self._diagnosed.wait(self._deadline.remaining())

    # --- load -------------------------------------------------------------------------------------
    def load_into_torch(self, loader: Callable[[bytes], LoadResult] = TorchAdapter.load) -> None:
        """Called on the first compile: wait for the restore, validate, hand torch its artifacts."""
        if self._loaded:
            return
        self._loaded = True
        if not self.reads:
            return
        waiting = time.perf_counter()
        finished = self.wait_restore()
        self.load_stats.waited = round(time.perf_counter() - waiting, 4)
        if not finished:
            return
        try:
            container = self.restored.torch_container()
        except BundleError as exc:
            self.problem(f"restored artifacts refused: {exc}")
            return
        if container is None:
            return
        try:
            result = loader(container)
        except Exception as exc:  # noqa: BLE001 - torch's loader, whatever it raises: a cold run, not a failure
            result = LoadResult(False, error=f"{type(exc).__name__}: {redact_cut(str(exc))}")
        self.load_stats = LoadStats(True, result.ok, result.artifacts, result.seconds, result.error,
                                    self.load_stats.waited)
        if not result.ok:
            self.problem(f"torch did not load the restored artifacts: {result.error}")

    # --- collect, merge, upload ------------------------------------------------------------------
    def collect(self, adapter: TorchAdapter | None) -> Entries:
        """What this session compiled or hit: torch's artifacts (none without ``adapter``) plus the files it added."""
        session = Entries()
        try:
            container = adapter.save() if adapter is not None else None
        except Exception as exc:  # noqa: BLE001
            self.problem(f"torch.compiler.save_cache_artifacts failed: {type(exc).__name__}: {exc}")
            container = None
        if container is not None:
            refused: list[str] = []
            try:
                session.update(bundlemod.entries_from_torch(container, refused))
            except BundleError as exc:
                self.problem(f"torch's saved artifacts failed validation, not uploading them: {exc}")
            if refused:  # one artifact with an odd key costs that artifact, not all of them
                self.problem(f"not uploading {len(refused)} of torch's artifacts: {'; '.join(refused[:3])}")
        # torch's on-disk cache entries that neither this process recorded nor the restore brought: compiled
        # by a child process (torchrun, mp.spawn, subprocess) into the same directory. They travel as files.
        known = {e.ident for e in session} | {e.ident for e in self.restored.of_kind_prefix(bundlemod.TORCH_PREFIX)}
        for root in self.roots:
            entries, skipped = root.collect(self.before.get(root.kind, set()), scratch_dir=self.scratch())
            for entry in entries:
                ident = torch_cache_ident(entry.name) if root.name == "inductor" else None
                if ident in known:
                    continue  # mega-cache carries it
                if ident is not None:
                    layer = ident[0][len(bundlemod.TORCH_PREFIX):]
                    self.torch_stats.other_processes[layer] = self.torch_stats.other_processes.get(layer, 0) + 1
                session.add(entry)
            self.upload_stats.files_skipped.extend(skipped)
        return session

    def account(self, adapter: TorchAdapter | None, workers: Sequence[Mapping[str, Any]] = ()) -> TorchStats:
        """torch's figures for this session (and its xdist workers'), with per-layer use and seconds saved."""
        ts = TorchStats.from_adapter(adapter) if adapter is not None else TorchStats()
        for worker in workers:
            ts.add(worker)
        cold = self.restored_cold_seconds()
        restored_torch = {e.ident for e in self.restored.of_kind_prefix(bundlemod.TORCH_PREFIX)}
        used: set[tuple[str, str]] = set()
        for record in ts.per_test.values():
            hits = [a for a in map(_ident, record["artifacts"]) if a in restored_torch]
            record["seconds_saved"] = round(sum(cold.get(a, 0.0) for a in hits), 3)
            used.update(hits)
        if adapter is not None:
            # Dynamo reuse installs entries when torch.compile() wraps a function, outside any compile: every entry
            # this process installed, whichever test (or import) wrapped it
            used.update(a for a in (_ident(f"{kind}:{key}") for kind, key in TorchAdapter.seen_artifacts()
                                    if kind == "precompile") if a in restored_torch)
        ts.seconds_saved = round(sum(cold.get(a, 0.0) for a in used), 3)
        for kind, count in self.restored.counts().items():
            if kind.startswith(bundlemod.TORCH_PREFIX):
                ts.layers[kind[len(bundlemod.TORCH_PREFIX):]] = {"restored": count, "used": 0}
        for kind, _key in used:
            ts.layers.setdefault(kind[len(bundlemod.TORCH_PREFIX):], {"restored": 0, "used": 0})["used"] += 1
        self.torch_stats = ts
        return ts

    def restored_cold_seconds(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for header in self.restored_headers:
            table = header.extra.get("cold_seconds")
            if isinstance(table, dict):
                for artifact, value in table.items():
                    seconds = bundlemod.number(value, 0.0, MAX_COMPILE_SECONDS)  # unverified input: a finite range
                    if isinstance(artifact, str) and seconds is not None:
                        out.setdefault(_ident(artifact), seconds)
        return out

    def cold_seconds(self, payload: Entries) -> dict[str, float]:
        """For the torch artifacts in ``payload``: each new one's share of the compile seconds of the test
        that produced it, and what restored objects recorded for the others (a compaction keeps them)."""
        out: dict[str, float] = {}
        for record in self.torch_stats.per_test.values():
            fresh = [a for a in record["artifacts"] if _ident(a) in payload and _ident(a) not in self.restored]
            for artifact in fresh:
                out.setdefault(artifact, round(float(record["seconds"]) / len(fresh), 4))
        for (kind, key), seconds in self.restored_cold_seconds().items():
            if (kind, key) in payload:
                out.setdefault(f"{kind[len(bundlemod.TORCH_PREFIX):]}:{key}", seconds)
        return dict(list(out.items())[:MAX_COLD_SECONDS])

    def upload_meta(self, payload: Entries) -> dict[str, object]:
        ts = self.torch_stats
        misses = counter_sum(ts.counters, MISS_COUNTERS)
        return {"producer": {**self.meta, "misses": misses, "compile_seconds": round(ts.compile_seconds, 3)},
                "cold_seconds": self.cold_seconds(payload)}

    def producer_selections(self) -> set[str]:
        """The test selections of the sessions that stored the restored objects (an xdist controller's staged
        object lists those of the objects it restored)."""
        out: set[str] = set()
        for header in self.restored_headers:
            producer = header.extra.get("producer")
            if not isinstance(producer, dict):
                continue
            if isinstance(producer.get("selection"), str):
                out.add(producer["selection"])
            listed = producer.get("selections")
            if isinstance(listed, list):
                out.update(item for item in listed[:64] if isinstance(item, str))
        return out

    def expects_full_coverage(self, selection: str | None) -> bool:
        """Whether a restored object came from a session that ran this very selection of tests: everything
        that session compiled was uploaded, so this one should find all of it cached."""
        return bool(selection) and selection in self.producer_selections()

    def check_unused(self, selection: str | None) -> None:
        """Restored objects that torch hit none of: a note, never a problem. The environment settings that
        change keys are in the fingerprint (another folder), so what is left is a session that compiled only
        graphs the store lacks (new or changed code or config, another shard): healthy, and said so, with the
        likely causes when the objects came from a run of these very tests. After a failed load, that failure
        was the problem already."""
        r, t = self.restore_stats, self.torch_stats
        hits, misses = counter_sum(t.counters, HIT_COUNTERS), counter_sum(t.counters, MISS_COUNTERS)
        if not (r.objects_used and t.compiled and hits == 0 and misses > 0) or (self.load_stats.called
                                                                               and not self.load_stats.ok):
            return
        note = (f"restored {r.objects_used} object(s); this session compiled only graphs they do not hold "
                f"({misses} misses)")
        if self.expects_full_coverage(selection):
            note += (": they were stored by a run of these same tests, so the code or an Inductor/Dynamo setting "
                     "changed since (config patches in code, OMP_NUM_THREADS, model code)")
        else:
            note += ": new or changed code, or other tests than the runs that stored them"
        self.notes.append(note)

    def check_unstorable(self, eager_backward: bool = False) -> None:
        """AOTAutograd graphs compiled but never stored (a note), counted from torch's own counters (misses minus
        entries saved). torch stores an AOTAutograd entry only once the graph's backward is compiled, which is
        lazy (a forward whose inputs require grad, in tests that never call ``.backward()``, is never stored
        unless ``eager_backward``: ``--megacache-eager-backward``), and only when Inductor compiled every part
        through its FX-graph cache (``_should_save_cache``: a part with nothing for Inductor to compile, or one
        that bypassed the FX cache, has no key). The counters cannot tell the two apart, so the note names both,
        or only the second when backwards are compiled eagerly."""
        t = self.torch_stats
        unsaved = t.counters.get("autograd_cache_miss", 0) - t.counters.get("autograd_cache_saved", 0)
        if "autograd_cache_saved" not in t.counters or unsaved <= 0:
            return
        tests = [nodeid for nodeid, rec in t.per_test.items()
                 if rec["counters"].get("autograd_cache_miss", 0) > rec["counters"].get("autograd_cache_saved", 0)]
        named = f" (in {', '.join(tests[:3])}{f' and {len(tests) - 3} more' if len(tests) > 3 else ''})" if tests else ""
        no_key = ("a part that Inductor did not compile through its FX-graph cache (nothing for it to compile, or "
                  "a cache bypass) has no key")
        why = (f"with backwards compiled eagerly, the reason left is that {no_key}" if eager_backward else
               "torch stores an entry only once its backward is compiled (a forward whose inputs require grad in a "
               "test that never calls backward(): run inference-only tests under torch.no_grad() or "
               f"torch.inference_mode(), or opt in to --megacache-eager-backward), and never when {no_key}")
        self.notes.append(f"{unsaved} AOTAutograd graph(s) compiled but not stored{named}, so they miss in every run: "
                          + why)

    def merge_worker_profiles(self, copies: Mapping[tuple[str, str], Sequence[Entry]], timeout: float,
                              merge: Callable[[bytes | None, Sequence[bytes], float], bytes | None] | None = None,
                              ) -> Entries:
        """One profile per key from the copies xdist workers handed over (each grew the restored one with
        its own frames): merged as torch merges them, or nothing when they add nothing to the restored one."""
        from .pgo import MERGE_TIMEOUT, ProfileMergeError, merge_profiles

        merge = merge or merge_profiles
        out = Entries()
        for ident, entries in copies.items():
            base = self.restored.get(ident)
            base_data = base.data if base is not None else None
            distinct = list(dict.fromkeys(e.data for e in entries if e.data != base_data))
            if not distinct:
                continue
            if len(distinct) == 1 and base_data is None:
                out.add(Entry(ident[0], ident[1], distinct[0]))
                continue
            try:
                merged = merge(base_data, distinct, max(timeout, MERGE_TIMEOUT))
            except ProfileMergeError as exc:
                self.problem(f"could not merge the xdist workers' dynamic-shape profiles ({exc}); keeping the "
                             "newest, so some functions may compile static first in the next run")
                out.add(entries[-1])
                continue
            self.upload_stats.profiles_merged += 1
            if merged is not None:
                out.add(Entry(ident[0], ident[1], merged))
        return out

    def finish(self, adapter: TorchAdapter | None, *,
               workers: Sequence[Mapping[str, Any]] = (), worker_entries: Entries | None = None,
               worker_profiles: Mapping[tuple[str, str], Sequence[Entry]] | None = None) -> None:
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
            self._upload(adapter, worker_entries, worker_profiles)
        finally:
            up.seconds = time.perf_counter() - start

    def own_units(self) -> list[_Held]:
        """The objects of this scope the restore used, as compaction units (a whole group of parts is one)."""
        return units(self.restored_held)[0]

    def needs_merge(self) -> bool:
        """Whether this scope's objects should be merged even with nothing new to store: more of them than
        ``compact_after``, or the same entry in more than one (each later restore would fetch it again)."""
        if not (self.reads and self.writes and self.restore_finished and self.restore_stats.ok):
            return False
        held = self.own_units()
        return len(held) > self.compact_after or sum(len(h.entries) for h in held) > len(self.restored_own)

    def _upload(self, adapter: TorchAdapter | None, worker_entries: Entries | None,
                worker_profiles: Mapping[tuple[str, str], Sequence[Entry]] | None) -> None:
        up = self.upload_stats
        deadline = Deadline(self.upload_timeout, "the upload", "--megacache-upload-timeout")
        session = self.collect(adapter)
        if worker_entries is not None:
            session.merge(worker_entries)
        if worker_profiles:
            session.merge(self.merge_worker_profiles(worker_profiles, self.upload_timeout))
        session = self.scrubbed(session)
        up.session_entries = len(session)
        new = session.minus(self.restored)  # a profile that changed under its key counts as new
        up.new_entries = new.counts()
        merge_only = not new and self.needs_merge()
        if not new and not merge_only:
            # Collecting and comparing what the session saved (a child process may have compiled even when
            # this one did not: the cache directories are looked at either way).
            up.reason = "nothing new" if self.torch_stats.compiled else "nothing was compiled"
            return
        up.attempted = True
        compact = merge_only or len(self.own_units()) + 1 > self.compact_after
        payload = self.scrubbed(self.restored_own) if compact else Entries()
        payload.merge(new)  # a changed profile replaces the restored one
        compact = compact and len(payload) > len(new)
        try:
            store = self._bounded_store(deadline)
            stored = self._store_parts(store, deadline, payload, quiet=compact and bool(new))
            if stored is None and compact and new:  # the merged whole cannot be stored: the new entries alone
                self.notes.append("compaction skipped: the merged objects would be over the restore limits; "
                                  "uploading the new entries alone and keeping every stored object")
                compact, merge_only = False, False
                stored = self._store_parts(store, deadline, new)
        except StoreError as exc:
            self._store_error("upload", exc)
            up.reason = "upload failed"
            return
        if stored is None:
            up.reason = "over the restore limits"
            return
        mine, parts, stored_bytes = stored
        if merge_only:
            up.converged, up.merged_objects, up.merged_bytes = len(self.restored_held), parts, stored_bytes
        else:
            up.objects, up.bytes, up.raw_bytes = parts, stored_bytes, mine.entries.raw_bytes()
        if compact:
            try:
                self._compact(store, deadline, mine)
            except StoreError as exc:
                self.notes.append(f"compaction stopped after {up.compacted + up.superseded} deletions ({exc}); "
                                  "what is left is merged next time")
            except Exception as exc:  # noqa: BLE001 - a cache bug must never fail the session
                self.problem(f"compaction failed unexpectedly: {type(exc).__name__}: {redact_cut(str(exc))}")

    def _compact(self, store: Store, deadline: Deadline, mine: _Held) -> None:
        """After uploading ``mine``, the merged whole: delete what it covers, then take in what concurrent sessions
        stored meanwhile, until the folder holds one merged object (or one group of parts). Objects that share no
        entry with it (uploads of other graphs) stay beside it: they duplicate nothing, and the next compaction
        merges them.

        No entry is lost: an object is deleted only after an object that covers it (:func:`_covers`) has been
        stored, and read back and validated (or written by this session). Covering is a strict order: the
        coverer holds every ``(kind, name)`` the other does and more, or the same ones and a later ``(created,
        name)`` from its header, which every session reads alike. So no two objects cover each other: of two
        with the same entries, every session deletes the same one, the older, and two sessions can never delete
        each other's. Following who covered a deleted object, each step to a greater one, ends at an object that
        nobody deletes and that holds every entry of the chain. An object that fails validation or cannot be
        read (its content unknown) is never deleted here and covers nothing. A group of parts (one merged whole
        over the restore limits, written as several objects) is one unit in all of this: it covers, or is
        deleted, only once every part of it is listed and read; a group with a part missing (being uploaded or
        deleted) is neither, until it is stale.

        The folder settles: a session stores a merged object only before listing the folder again, so the
        session that lists last sees every merged object the others stored; it deletes those its own covers,
        gives way to one that covers its own (and goes on with that one), and merges the rest that share entries
        with it. Listings are bounded (:data:`COMPACTION_ROUNDS`, then the next compaction goes on), and so is
        the time (the upload's deadline: a store operation cut short deletes nothing more)."""
        inputs = {info.name for info in self.restored_objects}
        # What the restore read of this folder, the session's own: each that ``mine`` covers is deleted without
        # being read again. The rest (a profile newer than the merged one, an entry not copied) is read and
        # compared below with whatever else the folder holds.
        for held in self.own_units():
            if _covers(mine, held):
                self._delete_unit(store, deadline, held, inputs)
        self._converge(store, deadline, mine, inputs)

    def _delete_unit(self, store: Store, deadline: Deadline, held: _Held, inputs: set[str],
                     own: set[str] | None = None) -> None:
        """Delete the objects of one unit that a stored one covers (the caller checked); counted."""
        for name in held.objects:
            bounded(lambda n=name: store.delete(self.folder, n), deadline, "compaction")  # type: ignore[misc]
            if name in inputs:
                self.upload_stats.compacted += 1
            elif own is None or name not in own:
                self.upload_stats.superseded += 1

    def _read_held(self, store: Store, name: str) -> _Held | None:
        """An object of the write folder, read whole and validated as a restore validates it (its signature
        included); None when it is gone (deleted meanwhile, so an object that covers it exists)."""
        path = self._fetch_file(store, self.folder, name)
        if path is None:
            return None
        try:
            with open(path, "rb") as fh:
                header, decoded = bundlemod.read_object(fh, self.fingerprint, self.limits, self.signing_keys,
                                                        self.scratch(), self.restored)
        finally:
            _unlink(path)
        return _Held(name, header.created, decoded.entries, (header,))

    def _converge(self, store: Store, deadline: Deadline, mine: _Held, inputs: set[str]) -> None:
        """List the folder again; delete what the merged object covers, give way to an object that covers it,
        and merge the objects that share entries with it into a new one; until nothing is left to do, for
        :data:`COMPACTION_ROUNDS` listings at most."""
        current, own = mine, set(mine.objects)
        seen: dict[str, _Held] = {}  # objects read so far (immutable: each is read once)
        left: set[str] = set()  # never deleted or merged here: unreadable, refused, or not copied whole
        for round_ in range(COMPACTION_ROUNDS):
            listing = bounded(lambda: store.list(self.folder), deadline, "compaction")
            unread = [info.name for info in listing if info.name not in seen and info.name not in left
                      and info.name not in own and info.name not in current.objects]
            outcomes = bounded_map(lambda name: self._read_held(store, name), unread, deadline, FETCH_WORKERS,
                                   "compaction")
            for name, got in zip(unread, outcomes, strict=True):
                if isinstance(got, StoreError):
                    if got.kind == "timeout":
                        raise got
                    left.add(name)  # refused (or unreadable): what it holds is unknown, so it stays
                elif got is not None:
                    seen[name] = got
            listed = {info.name for info in listing}
            peers, _pending = units([held for name, held in seen.items()
                                     if name in listed and name not in left and name not in current.objects])
            peers = [p for p in peers if not left.intersection(p.objects)]
            # An object that covers the current one: the current one goes, and that one is carried on with.
            while (cover := max((p for p in peers if _covers(p, current)), key=_Held.order, default=None)) is not None:
                self._delete_unit(store, deadline, current, inputs, own)
                peers.remove(cover)
                current = cover
            for peer in [p for p in peers if _covers(current, p)]:
                self._delete_unit(store, deadline, peer, inputs, own)
                peers.remove(peer)
            # What is left and shares entries with the current one (concurrent merges, uploads of the same
            # graphs) is merged; an object of entries the current one lacks altogether stays as it is.
            overlapping = [p for p in peers if any(e.ident in current.entries for e in p.entries)]
            if not overlapping or round_ == COMPACTION_ROUNDS - 1:
                return
            merged = self._merge_held(store, deadline, current, overlapping, inputs, own, left)
            if merged is None:
                return
            current = merged

    def _merge_held(self, store: Store, deadline: Deadline, current: _Held, peers: list[_Held], inputs: set[str],
                    own: set[str], left: set[str]) -> _Held | None:
        """One object (or one group of parts) holding ``current`` and ``peers`` (merged oldest first: the newest
        profile wins), stored; then each of them that it covers deleted. None when there is nothing such an object
        could replace, or it may not be written."""
        union = Entries()
        for held in sorted([current, *peers], key=lambda h: h.rank):
            union.merge(held.entries)
        union = self.scrubbed(union)  # as what the session merged: no entry holding a secret's value is copied
        taken = [p for p in peers if all(e.ident in union for e in p.entries)]
        left.update(name for p in peers if p not in taken for name in p.objects)
        if not taken or not all(e.ident in union for e in current.entries):
            return None
        stored = self._store_parts(store, deadline, union, [current, *taken])
        if stored is None:
            return None
        merged, parts, stored_bytes = stored
        own.update(merged.objects)
        self.upload_stats.remerged += parts
        self.upload_stats.remerged_bytes += stored_bytes
        for held in [current, *taken]:
            if _covers(merged, held):
                self._delete_unit(store, deadline, held, inputs, own)
            else:  # a newer profile in it (a clock ahead of this one): it stays rather than being merged again
                left.update(held.objects)
        return merged

    def _merged_meta(self, entries: Entries, sources: Sequence[_Held]) -> dict[str, object]:
        """The header fields of a merged object: this session's, with the cold compile seconds that the merged
        objects recorded for the entries it holds."""
        table = self.cold_seconds(entries)
        for header in (h for held in sources for h in held.headers):
            recorded = header.extra.get("cold_seconds")
            if not isinstance(recorded, dict):
                continue
            for artifact, value in recorded.items():
                seconds = bundlemod.number(value, 0.0, MAX_COMPILE_SECONDS)  # unverified input: a finite range
                if (isinstance(artifact, str) and seconds is not None and _ident(artifact) in entries
                        and len(table) < MAX_COLD_SECONDS):
                    table.setdefault(artifact, seconds)
        return {**self.upload_meta(entries), "cold_seconds": table}

    def scrubbed(self, entries: Entries) -> Entries:
        """``entries`` as they may be stored: torch's repro lines blanked in each (:func:`envpolicy.scrub_torch_artifact`:
        mega-cache artifacts, child processes' FX-graph and AOTAutograd files, Triton's files, profiles alike), and
        any entry that still holds a value of the environment that may be a secret left out (one problem names the
        variables, never their values)."""
        pieces = envpolicy.stored_pieces(os.environ)
        out = Entries()
        dropped: dict[str, int] = {}
        for entry in entries:
            raw = entry.data  # one entry in memory at a time (a file entry is read from its scratch file)
            data = envpolicy.scrub_torch_artifact(raw)
            if (name := envpolicy.stored_secret(data, pieces)) is not None:
                dropped[name] = dropped.get(name, 0) + 1
                continue
            out.add(entry if data is raw else entry.with_data(data))
        if dropped:
            self.problem(f"not storing {sum(dropped.values())} compiled entries: they hold the value of "
                         f"{', '.join(sorted(dropped))}, which may be a secret")
        return out

    def _store_parts(self, store: Store, deadline: Deadline, payload: Entries, sources: Sequence[_Held] | None = None,
                     quiet: bool = False) -> tuple[_Held, int, int] | None:
        """Store ``payload`` as objects a restore accepts (under :class:`Limits`): one, or several parts of one group
        (split by entry, never inside one; :data:`PART_FIELD` in each header), each encoded, stored and let go
        before the next is encoded. An entry over the limits on its own is not stored (a problem names how many).
        Returns what was stored as one unit, the number of objects and their bytes; None when nothing was (said as a
        problem unless ``quiet``: the caller tries something else). A part
        that fails to store stops the rest (StoreError): those stored are an unfinished group, which no compaction
        deletes or counts on until it is stale (:func:`units`)."""
        signing_key = self.signing_keys[0] if self.signing_keys else None
        budget = min(self.limits.max_raw_bytes, self.limits.max_object_bytes) - 8  # 8: the payload's own head
        todo: list[list[Entry]] = []
        chunk: list[Entry] = []
        size = 0
        too_big: list[str] = []
        for entry in payload:
            cost = bundlemod.encoded_size(entry)
            if cost > budget:
                too_big.append(f"{entry.kind}:{entry.name[:80]} ({cost} bytes)")
                continue
            if chunk and (size + cost > budget or len(chunk) >= self.limits.max_entries):
                todo.append(chunk)
                chunk, size = [], 0
            chunk.append(entry)
            size += cost
        if chunk:
            todo.append(chunk)
        todo.reverse()
        group = new_object_name() if len(todo) > 1 else None
        names: list[str] = []
        stored = Entries()
        created: list[float] = []
        total = 0
        try:
            while todo:
                chunk = todo.pop()
                entries = Entries(chunk)
                extra = self._merged_meta(entries, sources) if sources is not None else self.upload_meta(entries)
                if group is not None:
                    extra[PART_FIELD] = {"group": group, "index": len(names),
                                         **({} if todo else {"count": len(names) + 1})}
                path = os.path.join(self.scratch(), name := new_object_name())
                header, size = bundlemod.write_object(path, entries, self.fingerprint, extra, signing_key)
                why = self._over_limits(header, size)
                if why is not None:
                    _unlink(path)
                    if len(chunk) == 1:
                        too_big.append(f"{chunk[0].kind}:{chunk[0].name[:80]} ({why})")
                        if not todo and names:
                            todo.append([])  # the group's last part, empty: it says how many parts there are
                    else:  # compressed, it is still over: in two halves, as parts of a group
                        todo.extend([chunk[len(chunk) // 2:], chunk[:len(chunk) // 2]])
                        group = group or new_object_name()
                    continue
                try:
                    bounded(lambda: store.put_file(self.folder, name, path), deadline,  # noqa: B023 - waited for
                            "upload")
                finally:
                    _unlink(path)
                names.append(name)
                stored.merge(entries)
                created.append(header.created)
                total += size
        except (ValueError, BundleError) as exc:  # a header a decoder would refuse: never written
            self.problem(f"not uploading: {redact_cut(str(exc))}")
            return None
        finally:
            if too_big and not (quiet and not names):
                self.problem(f"not storing {plural_entries(len(too_big))}: each alone would be over the restore "
                             f"limits, so no session could restore it: {'; '.join(too_big[:3])}")
        if not names:
            return None
        if group is None:
            return _Held(names[0], created[0], stored), 1, total
        return _Held(group, min(created), stored, (), tuple(names)), len(names), total

    def _over_limits(self, header: bundlemod.Header, size: int) -> str | None:
        """Why a restore would refuse an object of ``size`` bytes with ``header`` for its size, or None."""
        if size > self.limits.max_object_bytes:
            return f"object of {size} bytes is over the limit of {self.limits.max_object_bytes}"
        if header.raw_size > self.limits.max_raw_bytes:
            return f"{header.raw_size} bytes decompressed, over the limit of {self.limits.max_raw_bytes}"
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def plural_entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


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


def nearest_fingerprint(store: Store, prefix: str, scopes: Sequence[str], key: str,
                        parts: Mapping[str, object]) -> str | None:
    """Why nothing was found: the stored fingerprint closest to ``key`` and what differs from ``parts``.

    It reads the listing of ``prefix`` and the header of one object (a ranged read), nothing more: the
    header is unverified, so what it says is only shown, cut short, never acted on.

    Folders are ``prefix/scope/<4-part key>``. Closeness: shared key segments, preferring the
    session's own scopes, then the newest object."""
    mine = key.split("/")
    layout = Layout(prefix)
    best: tuple[tuple[int, int, float], str, str, str, str] | None = None
    unread: set[str] = set()  # scopes that hold this very fingerprint but are not read by this session
    for folder, info in store.walk(prefix):
        parsed = layout.parse_folder(folder)
        if parsed is None:
            continue
        scope, other = parsed[0], parsed[1].split("/")
        if other == mine:
            if scope not in scopes:
                unread.add(scope)
            continue
        rank = (sum(a == b for a, b in zip(mine, other, strict=True)), scope in scopes, info.modified)
        if best is None or rank > best[0]:
            best = (rank, folder, info.name, scope, parsed[1])
    if unread:
        return (f"this fingerprint is stored only in scope(s) this session does not read: {', '.join(sorted(unread)[:5])} "
                f"(reads {', '.join(scopes)}; see --megacache-scope / --megacache-default-scope)")
    if best is None:
        return "nothing is stored under this prefix yet"
    _rank, folder, name, scope, stored_key = best
    diffs: list[str] = []
    head = store.head(folder, name, bundlemod.HEADER_PREFIX_BYTES)
    doc = bundlemod.peek_header(head) if head is not None else None
    producer = doc.get("producer") if doc is not None else None
    theirs = producer.get("fingerprint_parts") if isinstance(producer, dict) else None
    if isinstance(theirs, dict):
        for name_ in sorted(set(parts) | set(theirs)):
            mine_, other_ = parts.get(name_), theirs.get(name_)
            if name_ == "env" and isinstance(mine_, dict) and isinstance(other_, dict):
                diffs.extend(envpolicy.env_differences(other_, mine_))  # names each variable; shows no hidden value
            elif name_ not in ("device",) and mine_ != other_:
                diffs.append(f"{name_[:80]} {other_!r:.120} here {mine_!r:.120}")
    else:
        diffs = [f"key part {i + 1}: {b!r} here {a!r}" for i, (a, b) in enumerate(zip(mine, stored_key.split("/"), strict=True))
                 if a != b]
    return redact(f"nearest stored fingerprint is {stored_key} (scope {scope}); it differs in: " + ("; ".join(diffs) or "?"))
