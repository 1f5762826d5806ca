"""The restore: a session's objects listed, fetched, checked and decoded, and their compiled files written into
place, in a thread of its own against its deadline (``--megacache-timeout``).

Waiting for it is paid once: whoever waits first waits until the deadline at most (and a grace to finish writing
what was fetched), and abandons it then; every later wait returns at once, and an abandoned restore writes nothing.
Objects are fetched into scratch files, several at once, and decoded one after another, newest first: an entry an
object gave already stands for the later objects' copies, whose frames are then not decompressed.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from . import bundle as bundlemod
from . import envpolicy
from .bundle import Entries, Limits
from .compaction import FETCH_WORKERS, Held
from .errors import BundleError, LocalDiskError, StoreError, redact, redact_cut
from .files import FileRoot
from .layout import Layout
from .report import RestoreStats
from .scratch import Scratch, local_fault, unlink
from .stores import Deadline, ObjectInfo, Store, bounded, bounded_map, loggers_listed_at_once

# Listings of the read folders a restore makes when an object it listed was gone when fetched (a compaction
# deleted it, having stored what it held in a newer object): the first and at most two more.
RESTORE_ROUNDS = 3
# Past the restore's budget (every store operation in it stops there), how long a waiter gives the restore
# thread to write what it fetched before going on without it (slow local disk, a starved CPU).
RESTORE_GRACE = 1.0
# An object the scratch directory has no room for (a full TMPDIR) is fetched and decoded in memory instead when it is
# at most this large (compressed); a larger one is left out (what it holds is compiled again).
IN_MEMORY_BYTES = 64 << 20


@dataclass(frozen=True)
class Diagnosis:
    """Where to look, when nothing is stored for this fingerprint, for the nearest one that is (why-miss)."""

    prefix: str
    scopes: Sequence[str]
    key: str
    parts: Mapping[str, object]



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
    data: bytes | None = None  # fetched into memory (the scratch directory had no room for it)
    left_out: bool = False  # no room for it in the scratch directory, too large to hold in memory
    in_memory: bool = False  # decoded with its files held in memory (no room for them in the scratch directory)


def _created(head: bytes) -> float:
    """When an object says it was made (its header's first bytes, unverified): the restore takes the newest first."""
    doc = bundlemod.peek_header(head) or {}
    return bundlemod.number(doc.get("created"), 0.0, bundlemod.MAX_CREATED) or 0.0


# An xdist controller's staging of the restore for its workers: (entries, fingerprint, ok, the producers' selections)
# -> the staged object's path, None when it staged none
Stager = Callable[[Entries, str, bool, list[str]], "str | None"]


class Owner(Protocol):
    """What the restore reads of its session: where and what to restore, and where to say a problem."""

    folder: str
    read_folders: list[str]
    fingerprint: str
    limits: Limits
    signing_keys: list[bytes]
    roots: list[FileRoot]
    reads: bool
    restore_timeout: float
    diagnosis: Diagnosis | None
    stage: Stager | None
    on_settled: Callable[[], None] | None
    scratch: Scratch

    def problem(self, message: str) -> None: ...

    def bounded_store(self, deadline: Deadline) -> Store: ...


class Restore:
    """One session's restore. Thread-safe: the restore thread writes its results, the session reads them once it
    has settled (:meth:`wait`)."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.stats = RestoreStats()
        self.restored = Entries()  # every entry restored
        self.objects: list[ObjectInfo] = []  # objects of the write folder (compaction input)
        self.own = Entries()  # what those objects hold
        self.held: list[Held] = []  # those objects, with what each holds (compaction input)
        self.headers: list[bundlemod.Header] = []  # of every object used
        self.before: dict[str, set[str]] = {}  # the cache directories' files when the restore settled
        self.store_down = False  # nothing came through: an upload would not either
        self.wait_seconds = 0.0  # time callers spent blocked in wait() (the restore's cost to the session)
        self.local_fault: LocalDiskError | None = None  # the first local disk fault (said once, at the end)
        self.staged: str | None = None  # an xdist controller's staged object, once its own copies of files are gone
        self._fault_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline: Deadline | None = None
        self._state_lock = threading.Lock()
        self._state = "idle"  # idle -> running -> committing -> done, or running -> abandoned
        self._settled = threading.Event()  # done or abandoned: nobody waits any more
        self._diagnosed = threading.Event()

    def start(self, background: bool = True) -> None:
        """Start the restore against its budget; in a daemon thread unless ``background`` is False."""
        with self._state_lock:
            if self._state != "idle":
                return
            self._state = "running"
        self._deadline = Deadline(self.owner.restore_timeout, "the restore", "--megacache-timeout")
        if not self.owner.reads:
            self._snapshot()
            self._settle("done")
            self._diagnosed.set()
            return
        if background:
            loggers_listed_at_once()  # the store's client makes loggers in that thread (stores.deadline)
            self._thread = threading.Thread(target=self._guarded, name="megacache-restore", daemon=True)
            self._thread.start()
        else:
            self._guarded()

    @property
    def finished(self) -> bool:
        """The restore ran to its end (successfully or not) in time; its result may be used."""
        return self._state == "done"

    def wait(self) -> bool:
        """Wait for the restore until its deadline, at most; True if it finished in time.

        The first wait that reaches the deadline abandons the restore (one problem, said once); every wait
        after that returns at once, so the budget is paid once per session whoever waits."""
        if self._settled.is_set() or self._deadline is None:
            return self.finished
        started = time.perf_counter()
        try:
            return self._wait()
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _wait(self) -> bool:
        assert self._deadline is not None
        if self._settled.wait(self._deadline.remaining() + RESTORE_GRACE):
            return self.finished
        with self._state_lock:
            committing = self._state == "committing"
            if self._state == "running":
                self._state = "abandoned"
        if committing:  # writing validated files to local disk: part of the session's own time
            self._settled.wait()
            return self.finished
        if self._state == "abandoned" and not self._settled.is_set():
            self.store_down = True  # what did not answer in time would not take an upload either
            self.owner.problem(f"restore did not finish within {self.owner.restore_timeout:g} s (--megacache-timeout); "
                         "the session went on without it and uploads nothing")
            self._snapshot()
            self._mark_settled()
            self._diagnosed.set()
        return self.finished

    def _settle(self, state: str) -> None:
        with self._state_lock:
            if self._state != "abandoned":
                self._state = state
        self._mark_settled()

    def _mark_settled(self) -> None:
        self._settled.set()
        if self.owner.on_settled is not None:
            try:
                self.owner.on_settled()
            except Exception as exc:  # noqa: BLE001
                self.owner.problem(f"signalling the end of the restore: {type(exc).__name__}: {redact_cut(str(exc))}")

    def _commit(self) -> bool:
        """Whether the restore may still write its result (it was not abandoned)."""
        with self._state_lock:
            if self._state != "running":
                return False
            self._state = "committing"
            return True

    def _guarded(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - a cache bug must never fail the session
            self.owner.problem(f"restore failed unexpectedly: {type(exc).__name__}: {redact_cut(str(exc))}")
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
        """For an xdist controller: what was restored, staged for the workers before anyone may use it; its own copies
        of the files go then (:func:`let_go`)."""
        if self.owner.stage is None:
            return
        try:
            staged = self.owner.stage(self.restored, self.owner.fingerprint, self.stats.ok,
                                      sorted(producer_selections(self.headers)))
        except Exception as exc:  # noqa: BLE001
            return self.owner.problem(f"staging the restore for the xdist workers: {type(exc).__name__}: "
                                      f"{redact_cut(str(exc))}")
        if staged is not None and not self.owner.roots:
            self.staged = let_go(self.restored, staged)

    def reload(self) -> None:
        """Before a merge: an xdist controller's files, read back from the object it staged (:func:`read_back`)."""
        staged, self.staged = self.staged, None
        if staged is None:
            return
        try:
            read_back(staged, self.restored, self.owner.fingerprint, self.owner.limits, self.owner.scratch.path())
        except (BundleError, OSError) as exc:
            self.owner.problem(f"reading back the staged restore for a merge: {redact_cut(str(exc))}")

    def _snapshot(self) -> None:
        try:
            self.before = {root.kind: root.snapshot() for root in self.owner.roots}
        except Exception as exc:  # noqa: BLE001 - a cache directory we cannot read: collect nothing from it
            self.owner.problem(f"cannot read the cache directories: {type(exc).__name__}: {redact_cut(str(exc))}")

    def _local(self, exc: LocalDiskError) -> None:
        with self._fault_lock:
            if self.local_fault is None:
                self.local_fault = exc

    def _run(self) -> None:
        stats = self.stats
        stats.attempted = True
        start = time.perf_counter()
        assert self._deadline is not None
        deadline = self._deadline
        listing: list[tuple[str, ObjectInfo]] = []
        try:
            store = self.owner.bounded_store(deadline)
            for folder in self.owner.read_folders:
                listing.extend((folder, info) for info in bounded(lambda f=folder: store.list(f), deadline,  # type: ignore[misc]
                                                                   "listing the store"))
        except StoreError as exc:
            self.store_down = True  # a store that cannot list will not take an upload: one fault, one warning
            self.owner.problem(f"restore: {exc}")
            stats.seconds = time.perf_counter() - start
            return
        stats.objects_listed = len(listing)
        fetching = Fetching(self.owner, self.stats, self._local)
        results = fetching.fetch_all(store, listing, deadline)
        self.store_down = self.store_down or fetching.store_down
        merged = Entries()
        # Newest first (by the time each object records), so that the newest copy of a mutable artifact is taken;
        # an entry taken already stands for the later objects' copies, whose frames are then not decompressed.
        results.sort(key=lambda got: (got.created, got.info.name), reverse=True)
        for got in results:
            stats.bytes_fetched += got.size
            if deadline.expired():  # the session goes on without this restore: nothing more is decoded
                if got.path is not None:
                    unlink(got.path)
                continue
            fetching.decode(got, merged)
            if got.left_out:
                stats.objects_left_out += 1
                continue
            if got.entries is None or got.header is None:
                stats.objects_rejected += got.size > 0
                continue
            stats.objects_in_memory += got.in_memory
            merged.update(got.entries)
            stats.objects_used += 1
            stats.folders[got.folder] = stats.folders.get(got.folder, 0) + 1
            self.headers.append(got.header)
            if got.folder == self.owner.folder:
                self.objects.append(got.info)
                self.own.update(got.entries)  # newest first: its copy of a profile wins
                self.held.append(Held(got.info.name, got.header.created, got.entries, (got.header,)))
        stats.raw_unique = merged.raw_bytes()
        if not self._commit():
            return  # abandoned: the session went on without this restore; write nothing now
        if self.local_fault is not None:
            lost = ("what they hold is compiled again" if stats.objects_left_out else
                    "nothing of the cache lost, at the cost of the memory they took")
            self.owner.problem(f"{self.local_fault}; the restore went on without the scratch directory: "
                               f"{stats.objects_in_memory} object(s) decoded in memory, {stats.objects_left_out} left out "
                               f"({lost})")
        root_path = ""
        try:
            for root in self.owner.roots:
                root_path = str(root.path)
                stats.strays_removed += root.sweep_strays()[0]
                written, present = root.restore(merged, stats.files_refused, move=True)
                stats.files_written += written
                stats.files_present += present
        except (OSError, BundleError) as exc:
            if (fault := local_fault(exc)) is not None:
                self.owner.problem(f"{LocalDiskError.of(fault, fault.filename or root_path, 'restoring compiled files')}"
                                   "; the files not written are compiled again")
            else:
                self.owner.problem(f"restoring compiled files failed ({exc}); those kernels will be rebuilt")
        if stats.files_refused:
            self.owner.problem(f"{len(stats.files_refused)} restored files were refused and not written, the rest were "
                         f"(what they held is rebuilt): {'; '.join(stats.files_refused[:3])}")
        self.restored = merged
        stats.entries = merged.counts()
        stats.ok = True
        stats.seconds = time.perf_counter() - start

    def _diagnose(self) -> None:
        """Why nothing was restored: after the restore settled (off the critical path), within its budget."""
        stats, target, deadline = self.stats, self.owner.diagnosis, self._deadline
        if target is None or deadline is None or not (stats.ok and stats.objects_listed == 0):
            return
        try:
            store = self.owner.bounded_store(deadline)
            stats.why_miss = bounded(lambda: nearest_fingerprint(store, target.prefix, target.scopes, target.key,
                                                                 target.parts), deadline, "the why-miss diagnosis")
        except StoreError as exc:
            stats.why_miss = f"unknown ({exc})"

    def wait_diagnosis(self) -> None:
        """Until the why-miss diagnosis is done, or the restore's deadline."""
        if self._deadline is not None:
            self._diagnosed.wait(self._deadline.remaining())

class Fetching:
    """The listed objects fetched, a chunk at a time, into scratch files (or into memory where the scratch directory
    has no room), and each validated and decoded into its entries; the restore's figures counted in ``stats``, a local
    disk fault told to ``local``. ``store_down``: nothing came through."""

    def __init__(self, owner: Owner, stats: RestoreStats, local: Callable[[LocalDiskError], None]) -> None:
        self.owner, self.stats, self.local = owner, stats, local
        self.store_down = False

    def fetch(self, store: Store, folder: str, info: ObjectInfo) -> Fetched:
        """One object, fetched into a scratch file a chunk at a time (decoded later, by :meth:`decode`); into
        memory when the scratch directory has no room for it and it is small enough (:data:`IN_MEMORY_BYTES`)."""
        try:
            path = self.owner.scratch.fetch(store, folder, info.name, self.owner.limits.max_object_bytes)
        except LocalDiskError as exc:
            self.local(exc)
            if info.size > IN_MEMORY_BYTES:
                return Fetched(folder, info, 0, None, left_out=True)
            buffer = io.BytesIO()
            if not store.fetch(folder, info.name, min(IN_MEMORY_BYTES, self.owner.limits.max_object_bytes), buffer):
                return Fetched(folder, info, 0, None, vanished=True)
            data = buffer.getvalue()
            return Fetched(folder, info, len(data), None, _created(data[:bundlemod.HEADER_PREFIX_BYTES]), data=data)
        if path is None:  # deleted by a concurrent compaction: its content is in a newer object
            return Fetched(folder, info, 0, None, vanished=True)
        with open(path, "rb") as fh:
            created = _created(fh.read(bundlemod.HEADER_PREFIX_BYTES))
        return Fetched(folder, info, os.path.getsize(path), path, created)

    def decode(self, got: Fetched, held: Entries | None) -> None:
        """Validate and decode a fetched object (then drop its file); its defect is its own, named problem. An entry
        of ``held`` stands for the object's copy of it (:func:`.bundle.read_object`). When the scratch directory has
        no room for its files, it is decoded again into memory if it is small enough, else left out."""
        if got.path is None and got.data is None:
            return
        try:
            got.in_memory = got.data is not None
            try:
                header, decoded = self.read(got, held, in_memory=got.in_memory)
            except (BundleError, OSError) as exc:
                fault = local_fault(exc)
                if fault is None or got.data is not None:
                    raise
                self.local(LocalDiskError.of(fault, self.owner.scratch.path(), f"decoding {got.info.name}"))
                if got.size > IN_MEMORY_BYTES:
                    got.left_out = True
                    return
                got.in_memory = True
                header, decoded = self.read(got, held, in_memory=True)
        except (BundleError, OSError) as exc:  # read_object turns what a hostile object provokes into a BundleError
            if local_fault(exc) is not None:
                got.left_out = True
            else:
                self.owner.problem(f"refused {got.folder}/{got.info.name}: {redact_cut(str(exc))}")
            return
        finally:
            if got.path is not None:
                unlink(got.path)
            got.data = None
        got.header, got.entries = header, decoded.entries
        self.stats.raw_fetched += decoded.entries.raw_bytes()
        self.stats.raw_decompressed += decoded.decompressed

    def read(self, got: Fetched, held: Entries | None, in_memory: bool) -> tuple[bundlemod.Header, bundlemod.Decoded]:
        """The object decoded, its file entries into scratch files, or kept in memory (``in_memory``)."""
        scratch_dir = None if in_memory else self.owner.scratch.path()
        owner = self.owner
        if got.data is not None:
            return bundlemod.read_object(io.BytesIO(got.data), owner.fingerprint, owner.limits, owner.signing_keys,
                                         scratch_dir, held)
        assert got.path is not None
        with open(got.path, "rb") as fh:
            return bundlemod.read_object(fh, owner.fingerprint, owner.limits, owner.signing_keys, scratch_dir, held)

    def fetch_all(self, store: Store, listing: list[tuple[str, ObjectInfo]], deadline: Deadline) -> list[Fetched]:
        """Every listed object, fetched and validated. An object deleted between the listing and its fetch was
        covered by an object stored before it went: the folders are listed again for what is new (a few times at
        most), so a restore that races a compaction still gets every entry."""
        results: list[Fetched] = []
        done = {(folder, info.name) for folder, info in listing}
        failed = late = 0
        for round_ in range(RESTORE_ROUNDS):
            outcomes = bounded_map(lambda item: self.fetch(store, *item), listing, deadline, FETCH_WORKERS)
            for (folder, info), outcome in zip(listing, outcomes, strict=True):
                if isinstance(outcome, StoreError):
                    failed += 1
                    if outcome.kind == "timeout":
                        late += 1
                    else:
                        self.owner.problem(f"fetching {info.name}: {outcome}")
                    results.append(Fetched(folder, info, 0, None))
                else:
                    results.append(outcome)
            if round_ == RESTORE_ROUNDS - 1 or not any(isinstance(o, Fetched) and o.vanished for o in outcomes):
                break
            try:
                again = [(folder, info) for folder in self.owner.read_folders
                         for info in bounded(lambda f=folder: store.list(f), deadline, "listing the store")  # type: ignore[misc]
                         if (folder, info.name) not in done]
            except StoreError:
                break  # what was fetched stands
            listing = again
            done.update((folder, info.name) for folder, info in listing)
            self.stats.objects_listed += len(listing)
            if not listing:
                break
        if late:  # one fault, one problem: not one per object the budget cut short
            self.owner.problem(f"restore: {late} of {len(results)} objects were not fetched within the budget of the restore "
                         f"({self.owner.restore_timeout:g} s, --megacache-timeout); the session went on without them")
        if failed and failed == len(results):
            self.store_down = True  # nothing came through: an upload would not either
        return results



def let_go(restored: Entries, staged: str) -> str:
    """An xdist controller's scratch copies of the files it restored, removed once ``staged`` holds them (it writes
    none into place): :func:`read_back` reads them back for a merge; read before, they fail, never misread."""
    for entry in restored:
        if entry.path is not None and entry.digest is not None and entry.kind.startswith(bundlemod.FILE_PREFIX):
            unlink(entry.path)
    return staged


def read_back(staged: str, restored: Entries, fingerprint: str, limits: Limits, scratch_dir: str) -> None:
    """The file entries of ``restored`` read back from the object ``staged`` (into scratch files), each only where
    its bytes are the ones restored (their digest). A file not read back stays unreadable: the merge that needs it
    is skipped (:class:`.bundle.BundleError`), nothing is lost."""
    with open(staged, "rb") as fh:
        decoded = bundlemod.read_object(fh, fingerprint, limits, (), scratch_dir)[1]
    for copy in decoded.entries:
        if copy.path is None:
            continue
        entry = restored.get(copy.ident)
        if entry is not None and entry.digest is not None and entry.digest == copy.digest:
            unlink(entry.moved(copy.path))
        else:
            unlink(copy.path)


def producer_selections(headers: Sequence[bundlemod.Header]) -> set[str]:
    """The test selections of the sessions that stored the objects of ``headers`` (an xdist controller's staged
    object lists those of the objects it restored)."""
    out: set[str] = set()
    for header in headers:
        producer = header.extra.get("producer")
        if not isinstance(producer, dict):
            continue
        if isinstance(producer.get("selection"), str):
            out.add(producer["selection"])
        listed = producer.get("selections")
        if isinstance(listed, list):
            out.update(item for item in listed[:64] if isinstance(item, str))
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
