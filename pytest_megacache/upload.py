"""The upload: what a session compiled that the store lacks, stored as objects under the restore limits (one, or
several parts of one group), written to scratch files a chunk at a time and stored from them; then, when the scope
holds too many objects or they overlap, the merged whole stored and what it covers deleted (:mod:`.compaction`).
Everything runs within the upload's deadline (``--megacache-upload-timeout``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from . import bundle as bundlemod
from . import envpolicy
from .bundle import PRECOMPILE_KIND, Entries, Entry, Limits
from .compaction import PART_FIELD, Compaction, Held
from .errors import BundleError, LocalDiskError, StoreError, note_free, redact_cut
from .files import FileRoot, torch_cache_ident
from .report import TorchStats, UploadStats, human_bytes
from .scratch import Scratch, unlink
from .stores import Deadline, ObjectInfo, Store, bounded, new_object_name
from .torch_adapter import MISS_COUNTERS, TorchAdapter, counter_sum

# The reasons Dynamo reuse refuses a stored entry when it loads it (counted as ``dynamo_refused_<reason>``).
# (not `global_changed`: such a variant is kept in the entry written, for the processes where it holds)
REFUSED_AT_LOAD = ("load_failed", "code_changed", "collision", "missing_module")
MAX_COLD_SECONDS = 500  # artifacts whose cold compile seconds one object's header records
AOT_KIND = bundlemod.TORCH_PREFIX + "aot_autograd"
MAX_COMPILE_SECONDS = 86_400.0  # what one recorded compile may claim to have cost


def artifact_ident(artifact: str) -> tuple[str, str]:
    """``(kind, name)`` of a torch artifact named ``type:key`` (as torch's counters and the headers name them)."""
    typ, _, key = artifact.partition(":")
    return (bundlemod.TORCH_PREFIX + typ, key)


_ident = artifact_ident


def plural_entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


# xdist workers' copies of each dynamic-shape profile, by its (kind, key)
Profiles = Mapping[tuple[str, str], Sequence[Entry]]


class Reloading(Protocol):
    def reload(self) -> None: ...


class Owner(Protocol):
    """What the upload reads of its session: where it writes, what the restore gave, and where to say a problem."""

    folder: str
    fingerprint: str
    limits: Limits
    signing_keys: list[bytes]
    scratch: Scratch
    compact_after: int
    upload_timeout: float
    meta: dict[str, object]
    notes: list[str]
    torch_stats: TorchStats

    @property
    def restore(self) -> Reloading: ...  # what it restored is read back before a merge (:meth:`.restore.Restore.reload`)

    @property
    def restored(self) -> Entries: ...

    @property
    def roots(self) -> Sequence[FileRoot]: ...  # the cache directories whose new files travel

    @property
    def before(self) -> dict[str, set[str]]: ...  # their files when the restore settled, per kind

    @property
    def restored_own(self) -> Entries: ...

    @property
    def restored_objects(self) -> list[ObjectInfo]: ...

    @property
    def restored_held(self) -> list[Held]: ...

    @property
    def restored_headers(self) -> list[bundlemod.Header]: ...

    def problem(self, message: str) -> None: ...

    def bounded_store(self, deadline: Deadline) -> Store: ...

    def store_error(self, what: str, exc: StoreError) -> None: ...

    def own_units(self) -> list[Held]: ...

    def needs_merge(self) -> bool: ...


class Upload:
    """One session's upload; its figures in :attr:`stats`."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.stats = UploadStats()

    def collect(self, adapter: TorchAdapter | None) -> Entries:
        """What this session compiled or hit: torch's artifacts (none without ``adapter``) plus the files it added."""
        session = Entries()
        before = TorchAdapter.counters() if adapter is not None else {}
        try:
            container = adapter.save() if adapter is not None else None
        except Exception as exc:  # noqa: BLE001
            self.owner.problem(f"torch.compiler.save_cache_artifacts failed: {type(exc).__name__}: {exc}")
            container = None
        if adapter is not None:  # Dynamo entries refused while written (an entry that does not pickle) count too
            self.owner.torch_stats.saved(before, TorchAdapter.counters())
        if container is not None:
            refused: list[str] = []
            try:
                session.update(bundlemod.entries_from_torch(container, refused))
            except BundleError as exc:
                self.owner.problem(f"torch's saved artifacts failed validation, not uploading them: {exc}")
            if refused:  # one artifact with an odd key costs that artifact, not all of them
                self.owner.problem(f"not uploading {len(refused)} of torch's artifacts: {'; '.join(refused[:3])}")
        # torch's on-disk cache entries that neither this process recorded nor the restore brought: compiled
        # by a child process (torchrun, mp.spawn, subprocess) into the same directory. They travel as files.
        owner, others = self.owner, self.owner.torch_stats.other_processes
        known = {e.ident for e in session} | {e.ident for e in owner.restored.of_kind_prefix(bundlemod.TORCH_PREFIX)}
        for root in owner.roots:
            entries, skipped = root.collect(owner.before.get(root.kind, set()), scratch_dir=owner.scratch.path())
            for entry in entries:
                ident = torch_cache_ident(entry.name) if root.name == "inductor" else None
                if ident in known:
                    continue  # mega-cache carries it
                if ident is not None:
                    layer = ident[0][len(bundlemod.TORCH_PREFIX):]
                    others[layer] = others.get(layer, 0) + 1
                session.add(entry)
            self.stats.files_skipped.extend(skipped)
        return session

    def run(self, session: Entries, worker_entries: Entries | None,
            worker_profiles: Profiles | None) -> None:
        """Store what is new of ``session`` (what the session collected) and of its workers' entries and profiles;
        merge the scope's objects with it when they are too many or overlap, then compact."""
        up = self.stats
        owner = self.owner
        deadline = Deadline(owner.upload_timeout, "the upload", "--megacache-upload-timeout")
        if worker_entries is not None:
            session.merge(worker_entries)
        if worker_profiles:
            session.merge(self.merge_worker_profiles(worker_profiles, owner.upload_timeout))
        self.say_skipped()
        session = self.scrubbed(session)
        up.session_entries = len(session)
        new = session.minus(owner.restored)  # a profile that changed under its key counts as new
        up.new_entries = new.counts()
        merge_only = not new and owner.needs_merge()
        if not new and not merge_only:
            # Collecting and comparing what the session saved (a child process may have compiled even when
            # this one did not: the cache directories are looked at either way).
            up.reason = "nothing new" if owner.torch_stats.compiled else "nothing was compiled"
            return
        up.attempted = True
        # A Dynamo entry traced again in place of a stored one that was refused when loaded: the older object's copy
        # would be fetched (and refused) by every restore until a merge drops it, so merge now.
        refused = sum(owner.torch_stats.counters.get(f"dynamo_refused_{reason}", 0) for reason in REFUSED_AT_LOAD)
        replaces = bool(refused) and any(e.kind == PRECOMPILE_KIND and e.ident in owner.restored_own for e in new)
        compact = merge_only or replaces or len(owner.own_units()) + 1 > owner.compact_after
        payload = Entries()
        if compact:
            owner.restore.reload()
            try:
                payload = self.scrubbed(owner.restored_own)
            except BundleError as exc:  # a restored file changed in its cache directory since: not merged this time
                owner.notes.append(f"compaction skipped: {redact_cut(str(exc))}; uploading the new entries alone and "
                                   "keeping every stored object")
                compact = merge_only = False
                if not new:
                    up.attempted, up.reason = False, "nothing new"
                    return
        payload.merge(new)  # a changed profile replaces the restored one
        compact = compact and len(payload) > len(new)
        try:
            store = owner.bounded_store(deadline)
            stored = self.store_parts(store, deadline, payload, quiet=compact and bool(new))
            if stored is None and compact and new:  # the merged whole cannot be stored: the new entries alone
                owner.notes.append("compaction skipped: the merged objects would be over the restore limits; "
                                  "uploading the new entries alone and keeping every stored object")
                compact, merge_only = False, False
                stored = self.store_parts(store, deadline, new)
        except StoreError as exc:
            owner.store_error("upload", exc)
            up.reason = "upload failed"
            return
        except LocalDiskError as exc:  # this machine's disk, not the store: said as such; the store is fine
            left = new if new else payload
            what = f"{plural_entries(len(left))} ({human_bytes(left.raw_bytes())} raw) not uploaded"
            owner.problem(f"{exc}; {what}")
            up.reason = f"{exc.disk}: {what}"
            return
        if stored is None:
            up.reason = "over the restore limits"
            return
        mine, parts, stored_bytes = stored
        if merge_only:
            up.converged, up.merged_objects, up.merged_bytes = len(owner.restored_held), parts, stored_bytes
        else:
            up.objects, up.bytes, up.raw_bytes = parts, stored_bytes, mine.entries.raw_bytes()
        if compact:
            try:
                self._compact(store, deadline, mine)
            except (StoreError, LocalDiskError) as exc:
                owner.notes.append(f"compaction stopped after {up.compacted + up.superseded} deletions ({exc}); "
                                  "what is left is merged next time")
            except Exception as exc:  # noqa: BLE001 - a cache bug must never fail the session
                owner.problem(f"compaction failed unexpectedly: {type(exc).__name__}: {redact_cut(str(exc))}")

    def not_collected(self, exc: LocalDiskError) -> None:
        """The local disk refused the scratch directory the compiled files are collected into: said as such."""
        what = "the compiled artifacts of this session not uploaded"
        self.owner.problem(f"{exc}; {what}")
        self.stats.reason = f"{exc.disk}: {what}"

    def say_skipped(self) -> None:
        """The files the collect left out of this upload, in one problem: how many, their bytes, the first of them
        (and the local disk's state when it refused a copy)."""
        skipped = self.stats.files_skipped
        if not skipped:
            return
        size = sum(getattr(s, "size", 0) for s in skipped)
        self.stats.files_skipped_bytes = size
        local = next((str(note) for s in skipped if (note := getattr(s, "local", None))), None)
        first = redact_cut(str(skipped[0]), 200)
        self.owner.problem((f"{local}; " if local else "")
                           + f"{len(skipped)} file(s) ({human_bytes(size)}) left out of the upload, first {first}")

    def merged_meta(self, entries: Entries, sources: Sequence[Held]) -> dict[str, object]:
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
            self.owner.problem(f"not storing {sum(dropped.values())} compiled entries: they hold the value of "
                         f"{', '.join(sorted(dropped))}, which may be a secret")
        return out

    def store_parts(self, store: Store, deadline: Deadline, payload: Entries, sources: Sequence[Held] | None = None,
                    quiet: bool = False) -> tuple[Held, int, int] | None:
        """``payload`` stored as objects a restore accepts, headed with what this upload records of it (a merge's of
        ``sources``): :meth:`Parts.store`."""
        def meta(entries: Entries) -> dict[str, object]:
            return self.merged_meta(entries, sources) if sources is not None else self.upload_meta(entries)

        return Parts(self.owner, meta).store(store, deadline, payload, quiet)

    def merge_worker_profiles(self, copies: Profiles, timeout: float,
                              merge: Callable[[bytes | None, Sequence[bytes], float], bytes | None] | None = None,
                              ) -> Entries:
        """One profile per key from the copies xdist workers handed over (each grew the restored one with
        its own frames): merged as torch merges them, or nothing when they add nothing to the restored one."""
        from .bundle import MERGE_TIMEOUT, ProfileMergeError, merge_profiles

        merge = merge or merge_profiles
        out = Entries()
        for ident, entries in copies.items():
            base = self.owner.restored.get(ident)
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
                self.owner.problem(f"could not merge the xdist workers' dynamic-shape profiles ({exc}); keeping the "
                             "newest, so some functions may compile static first in the next run")
                out.add(entries[-1])
                continue
            self.stats.profiles_merged += 1
            if merged is not None:
                out.add(Entry(ident[0], ident[1], merged))
        return out

    def restored_cold_seconds(self) -> dict[tuple[str, str], float]:
        return restored_cold_seconds(self.owner.restored_headers)

    def cold_seconds(self, payload: Entries) -> dict[str, float]:
        """For the torch artifacts in ``payload``: each new one's share of the backend seconds of the test that
        produced it (what a later hit on it spares: Dynamo still traces the frame; all of the test's compile seconds
        where torch kept no metrics), and what restored objects recorded for the others (a compaction keeps them).
        Where the test stored AOTAutograd entries, they carry it all: a hit on one takes its graphs from it, and torch
        records no hit on them. Stored Dynamo entries have none here: each variant carries what its trace took."""
        out: dict[str, float] = {}
        for record in self.owner.torch_stats.per_test.values():
            fresh = [a for a in record["artifacts"] if _ident(a) in payload and _ident(a) not in self.owner.restored
                     and _ident(a)[0] != PRECOMPILE_KIND]
            fresh = [a for a in fresh if _ident(a)[0] == AOT_KIND] or fresh
            spared = float(record.get("backend", record["seconds"]))
            for artifact in fresh:
                out.setdefault(artifact, round(spared / len(fresh), 4))
        for (kind, key), seconds in self.restored_cold_seconds().items():
            if (kind, key) in payload:
                out.setdefault(f"{kind[len(bundlemod.TORCH_PREFIX):]}:{key}", seconds)
        return dict(list(out.items())[:MAX_COLD_SECONDS])

    def upload_meta(self, payload: Entries) -> dict[str, object]:
        ts = self.owner.torch_stats
        misses = counter_sum(ts.counters, MISS_COUNTERS)
        return {"producer": {**self.owner.meta, "misses": misses, "compile_seconds": round(ts.compile_seconds, 3)},
                "cold_seconds": self.cold_seconds(payload)}

    def _compact(self, store: Store, deadline: Deadline, mine: Held) -> None:
        """After storing ``mine``, the merged whole: delete what it covers, and merge what concurrent sessions stored
        meanwhile (:class:`.compaction.Compaction`)."""
        owner = self.owner
        Compaction(store=store, deadline=deadline, folder=owner.folder, fingerprint=owner.fingerprint,
                   limits=owner.limits, signing_keys=owner.signing_keys, scratch=owner.scratch,
                   restored=owner.restored, restored_units=owner.own_units(),
                   inputs={info.name for info in owner.restored_objects}, stats=self.stats, scrub=self.scrubbed,
                   store_merged=lambda entries, sources: self.store_parts(store, deadline, entries, sources)).run(mine)


class Parts:
    """A payload stored as objects a restore accepts (:meth:`store`): split by entry under :class:`Limits`, each part
    encoded with its header (``meta`` gives what the header records of its entries), stored and let go before the
    next; an entry over the limits on its own is named as a problem and left out."""

    def __init__(self, owner: Owner, meta: Callable[[Entries], dict[str, object]]) -> None:
        self.owner, self.meta = owner, meta

    def store(self, store: Store, deadline: Deadline, payload: Entries, quiet: bool = False
              ) -> tuple[Held, int, int] | None:
        """Store ``payload`` as objects a restore accepts (under :class:`Limits`): one, or several parts of one group
        (split by entry, never inside one; :data:`PART_FIELD` in each header), each encoded, stored and let go
        before the next is encoded. An entry over the limits on its own is not stored (a problem names how many).
        Returns what was stored as one unit, the number of objects and their bytes; None when nothing was (said as a
        problem unless ``quiet``: the caller tries something else). A part
        that fails to store stops the rest (StoreError): those stored are an unfinished group, which no compaction
        deletes or counts on until it is stale (:func:`units`)."""
        signing_key = self.owner.signing_keys[0] if self.owner.signing_keys else None
        too_big: list[str] = []
        todo = self._split(payload, too_big)
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
                extra = self.meta(entries)
                if group is not None:
                    extra[PART_FIELD] = {"group": group, "index": len(names),
                                         **({} if todo else {"count": len(names) + 1})}
                path = os.path.join(self.owner.scratch.path(), name := new_object_name())
                try:
                    header, size = bundlemod.write_object(path, entries, self.owner.fingerprint, extra, signing_key)
                except OSError as exc:  # the scratch directory's disk: nothing of the object is stored
                    note_free(exc, path)
                    unlink(path)
                    raise LocalDiskError.of(exc, path, f"writing the upload's object ({plural_entries(len(entries))}, "
                                                       f"{human_bytes(entries.raw_bytes())} raw)") from exc
                why = self._over_limits(header, size)
                if why is not None:
                    unlink(path)
                    if len(chunk) == 1:
                        too_big.append(f"{chunk[0].kind}:{chunk[0].name[:80]} ({why})")
                        if not todo and names:
                            todo.append([])  # the group's last part, empty: it says how many parts there are
                    else:  # compressed, it is still over: in two halves, as parts of a group
                        todo.extend([chunk[len(chunk) // 2:], chunk[:len(chunk) // 2]])
                        group = group or new_object_name()
                    continue
                try:
                    bounded(lambda: store.put_file(self.owner.folder, name, path), deadline,  # noqa: B023 - waited for
                            "upload")
                finally:
                    unlink(path)
                names.append(name)
                stored.merge(entries)
                created.append(header.created)
                total += size
        except (ValueError, BundleError) as exc:  # a header a decoder would refuse: never written
            self.owner.problem(f"not uploading: {redact_cut(str(exc))}")
            return None
        finally:
            if too_big and not (quiet and not names):
                self.owner.problem(f"not storing {plural_entries(len(too_big))}: each alone would be over the restore "
                             f"limits, so no session could restore it: {'; '.join(too_big[:3])}")
        if not names:
            return None
        if group is None:
            return Held(names[0], created[0], stored), 1, total
        return Held(group, min(created), stored, (), tuple(names)), len(names), total

    def _split(self, payload: Entries, too_big: list[str]) -> list[list[Entry]]:
        """``payload`` split by entry, in order, into parts whose raw size and count are under the restore limits; an
        entry over them on its own is named in ``too_big`` and left out."""
        budget = min(self.owner.limits.max_raw_bytes, self.owner.limits.max_object_bytes) - 8  # 8: the payload's own head
        parts: list[list[Entry]] = []
        chunk: list[Entry] = []
        size = 0
        for entry in payload:
            cost = bundlemod.encoded_size(entry)
            if cost > budget:
                too_big.append(f"{entry.kind}:{entry.name[:80]} ({cost} bytes)")
                continue
            if chunk and (size + cost > budget or len(chunk) >= self.owner.limits.max_entries):
                parts.append(chunk)
                chunk, size = [], 0
            chunk.append(entry)
            size += cost
        if chunk:
            parts.append(chunk)
        return parts

    def _over_limits(self, header: bundlemod.Header, size: int) -> str | None:
        """Why a restore would refuse an object of ``size`` bytes with ``header`` for its size, or None."""
        if size > self.owner.limits.max_object_bytes:
            return f"object of {size} bytes is over the limit of {self.owner.limits.max_object_bytes}"
        if header.raw_size > self.owner.limits.max_raw_bytes:
            return f"{header.raw_size} bytes decompressed, over the limit of {self.owner.limits.max_raw_bytes}"
        return None


def restored_cold_seconds(headers: Sequence[bundlemod.Header]) -> dict[tuple[str, str], float]:
    """What the objects of ``headers`` recorded of each artifact's cold compile seconds (each checked: a finite range).
    Not a Dynamo entry's, which objects written before its variants carried their own held (they were shares of
    the tests' seconds that its graphs' entries also held)."""
    out: dict[tuple[str, str], float] = {}
    for header in headers:
        table = header.extra.get("cold_seconds")
        if isinstance(table, dict):
            for artifact, value in table.items():
                seconds = bundlemod.number(value, 0.0, MAX_COMPILE_SECONDS)  # unverified input: a finite range
                if isinstance(artifact, str) and seconds is not None and (ident := _ident(artifact))[0] != PRECOMPILE_KIND:
                    out.setdefault(ident, seconds)
    return out

