"""Compaction: the objects of a session's write folder merged, and what a merged object covers deleted.

The invariant: **an object is deleted only when a stored, validated object covers it** (:func:`_covers`: it holds an
entry of every ``(kind, name)`` the other does and, with the same ones, is the newer by the ``(created, name)`` its
header records). Covering is a strict order, so no two objects cover each other, and following who covered a deleted
object ends at one that nobody deletes and that holds every entry of the chain: concurrent sessions compacting at
once converge, and no stored entry is lost. An object that fails validation or cannot be read covers nothing and is
never deleted here. A group of parts (one merged whole over the restore limits, stored as several objects) is one
unit in all of this, once every part is listed (:func:`units`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import bundle as bundlemod
from .bundle import NEWEST_WINS, Entries, Limits
from .errors import BundleError, StoreError
from .layout import valid_object_name
from .report import UploadStats
from .scratch import Scratch, unlink
from .stores import Deadline, Store, bounded, bounded_map

# Objects fetched at once.
FETCH_WORKERS = 8


# Seconds a compaction waits before listing again when a group of parts is half listed (being stored or deleted).
PENDING_PAUSE = 0.2

# Listings of the folder a compaction makes to merge what concurrent sessions stored meanwhile (each may merge
# once more, but the last); what is left then is merged by the next compaction.
COMPACTION_ROUNDS = 4


@dataclass
class Held:
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


def units(objects: Sequence[Held], now: float | None = None) -> tuple[list[Held], list[str]]:
    """The objects of a folder as compaction units: each object on its own, and each group whose every part is
    there as one; also the objects of groups not whole yet (neither deleted nor merged for now). A group's parts
    left past :data:`STALE_GROUP_SECONDS` are objects of their own."""
    now = time.time() if now is None else now
    out: list[Held] = []
    groups: dict[str, dict[int, Held]] = {}
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
            out.append(Held(gid, min(p.created for p in parts.values()), entries,
                             tuple(h for i in range(count) for h in parts[i].headers),
                             tuple(parts[i].name for i in range(count))))
        elif all(now - p.created > STALE_GROUP_SECONDS for p in parts.values()):
            out.extend(parts.values())
        else:
            pending.extend(p.name for p in parts.values())
    return out, pending


def _covers(big: Held, small: Held) -> bool:
    """Whether ``small`` may be deleted because ``big`` is stored: ``big`` holds an entry of every ``(kind, name)``
    that ``small`` does and, with the same ones, is the newer; for a profile or a Dynamo entry that differs
    (:data:`.entries.NEWEST_WINS`), ``big`` is the newer too (a restore takes the newest object's). A strict
    order: no two objects cover each other."""
    if small.name == big.name or len(small.entries) > len(big.entries):
        return False
    newer = big.rank > small.rank
    if len(small.entries) == len(big.entries) and not newer:
        return False
    for entry in small.entries:
        other = big.entries.get(entry.ident)
        if other is None or (entry.kind in NEWEST_WINS and other.data != entry.data and not newer):
            return False
    return True


# What stores a merged object (or group) for a compaction: the entries and the units they came from (for the cold
# compile seconds they recorded); what was stored as one unit, the number of objects and their bytes, or None.
StoreMerged = Callable[[Entries, Sequence["Held"]], "tuple[Held, int, int] | None"]


class Compaction:
    """One compaction of ``folder`` on ``store``, within ``deadline``; counted in ``stats``. ``restored_units``:
    what the session's restore read of the folder (``inputs``: those objects' names); ``restored``: every entry the
    restore gave (a peer's copy of one of them is not decompressed again)."""

    def __init__(self, *, store: Store, deadline: Deadline, folder: str, fingerprint: str, limits: Limits,
                 signing_keys: Sequence[bytes], scratch: Scratch, restored: Entries, restored_units: list[Held],
                 inputs: set[str], stats: UploadStats, scrub: Callable[[Entries], Entries],
                 store_merged: StoreMerged) -> None:
        self.store, self.deadline, self.folder, self.fingerprint = store, deadline, folder, fingerprint
        self.limits, self.signing_keys, self.scratch = limits, list(signing_keys), scratch
        self.restored, self.restored_units, self.inputs = restored, restored_units, inputs
        self.stats, self.scrub, self.store_merged = stats, scrub, store_merged

    def run(self, mine: Held) -> None:
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
        deleted) is neither, until it is stale. While such a group is listed and nothing else is left to do, the
        compaction lists again after :data:`PENDING_PAUSE` (within its rounds): two sessions that each listed
        while the other's group was half stored would otherwise both keep theirs.

        The folder settles: a session stores a merged object only before listing the folder again, so the
        session that lists last sees every merged object the others stored; it deletes those its own covers,
        gives way to one that covers its own (and goes on with that one), and merges the rest that share entries
        with it. Listings are bounded (:data:`COMPACTION_ROUNDS`, then the next compaction goes on), and so is
        the time (the upload's deadline: a store operation cut short deletes nothing more)."""
        # What the restore read of this folder, the session's own: each that ``mine`` covers is deleted without
        # being read again. The rest (a profile newer than the merged one, an entry not copied) is read and
        # compared below with whatever else the folder holds.
        for held in self.restored_units:
            if _covers(mine, held):
                self._delete_unit(held)
        self._converge(mine)

    def _delete_unit(self, held: Held, own: set[str] | None = None) -> None:
        """Delete the objects of one unit that a stored one covers (the caller checked); counted."""
        for name in held.objects:
            bounded(lambda n=name: self.store.delete(self.folder, n), self.deadline, "compaction")  # type: ignore[misc]
            if name in self.inputs:
                self.stats.compacted += 1
            elif own is None or name not in own:
                self.stats.superseded += 1

    def _read_held(self, name: str) -> Held | None:
        """An object of the write folder, read whole and validated as a restore validates it (its signature
        included); None when it is gone (deleted meanwhile, so an object that covers it exists)."""
        path = self.scratch.fetch(self.store, self.folder, name, self.limits.max_object_bytes)
        if path is None:
            return None
        try:
            with open(path, "rb") as fh:
                header, decoded = bundlemod.read_object(fh, self.fingerprint, self.limits, self.signing_keys,
                                                        self.scratch.path(), self.restored)
        finally:
            unlink(path)
        return Held(name, header.created, decoded.entries, (header,))

    def _converge(self, mine: Held) -> None:
        """List the folder again; delete what the merged object covers, give way to an object that covers it,
        and merge the objects that share entries with it into a new one; until nothing is left to do, for
        :data:`COMPACTION_ROUNDS` listings at most."""
        current, own = mine, set(mine.objects)
        seen: dict[str, Held] = {}  # objects read so far (immutable: each is read once)
        left: set[str] = set()  # never deleted or merged here: unreadable, refused, or not copied whole
        for round_ in range(COMPACTION_ROUNDS):
            listing = bounded(lambda: self.store.list(self.folder), self.deadline, "compaction")
            unread = [info.name for info in listing if info.name not in seen and info.name not in left
                      and info.name not in own and info.name not in current.objects]
            outcomes = bounded_map(self._read_held, unread, self.deadline, FETCH_WORKERS, "compaction")
            for name, got in zip(unread, outcomes, strict=True):
                if isinstance(got, StoreError):
                    if got.kind == "timeout":
                        raise got
                    left.add(name)  # refused (or unreadable): what it holds is unknown, so it stays
                elif got is not None:
                    seen[name] = got
            listed = {info.name for info in listing}
            peers, pending = units([held for name, held in seen.items()
                                    if name in listed and name not in left and name not in current.objects])
            peers = [p for p in peers if not left.intersection(p.objects)]
            # An object that covers the current one: the current one goes, and that one is carried on with.
            while (cover := max((p for p in peers if _covers(p, current)), key=Held.order, default=None)) is not None:
                self._delete_unit(current, own)
                peers.remove(cover)
                current = cover
            for peer in [p for p in peers if _covers(current, p)]:
                self._delete_unit(peer, own)
                peers.remove(peer)
            # What is left and shares entries with the current one (concurrent merges, uploads of the same
            # graphs) is merged; an object of entries the current one lacks altogether stays as it is.
            overlapping = [p for p in peers if any(e.ident in current.entries for e in p.entries)]
            if round_ == COMPACTION_ROUNDS - 1:
                return
            if not overlapping:
                if not pending:
                    return
                # A group of parts half listed: another session is storing it or deleting it (both bounded by its
                # budget). Look again once it may have settled: a whole one is then merged or given way to. Any
                # such group counts, whatever its listed parts hold: the parts not listed may hold the shared entries.
                time.sleep(min(PENDING_PAUSE, self.deadline.remaining()))
                continue
            merged = self._merge_held(current, overlapping, own, left)
            if merged is None:
                return
            current = merged

    def _merge_held(self, current: Held, peers: list[Held], own: set[str], left: set[str]) -> Held | None:
        """One object (or one group of parts) holding ``current`` and ``peers`` (merged oldest first: the newest
        profile wins), stored; then each of them that it covers deleted. None when there is nothing such an object
        could replace, or it may not be written."""
        union = Entries()
        for held in sorted([current, *peers], key=lambda h: h.rank):
            union.merge(held.entries)
        try:
            union = self.scrub(union)  # as what the session merged: no entry holding a secret's value is copied
        except BundleError:  # a restored file changed in its cache directory since: these stay as they are
            left.update(name for p in peers for name in p.objects)
            return None
        taken = [p for p in peers if all(e.ident in union for e in p.entries)]
        left.update(name for p in peers if p not in taken for name in p.objects)
        if not taken or not all(e.ident in union for e in current.entries):
            return None
        stored = self.store_merged(union, [current, *taken])
        if stored is None:
            return None
        merged, parts, stored_bytes = stored
        own.update(merged.objects)
        self.stats.remerged += parts
        self.stats.remerged_bytes += stored_bytes
        for held in [current, *taken]:
            if _covers(merged, held):
                self._delete_unit(held, own)
            else:  # a newer profile in it (a clock ahead of this one): it stays rather than being merged again
                left.update(held.objects)
        return merged
