"""``pytest-megacache key``, ``inspect``, ``ls`` and ``prune``: the commands that look at a store (or at bundle
files) and print what they find, and the one that deletes from it.

An object that fails validation is refused on a line naming it (exit status 1), and the others are still shown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from .. import bundle as bundlemod
from ..errors import BundleError, StoreError
from ..fingerprint import TorchUnavailable, compute
from ..layout import Layout
from ..report import human_age, human_bytes, plural
from ..stores import ObjectInfo, Store
from .storeobjects import (
    PROG,
    ObjectFilter,
    StoredObject,
    UsageProblem,
    object_filter,
    object_ref,
    open_store,
    scan,
    scope_arg,
    this_key,
)

# --- ls ----------------------------------------------------------------------------------------------


@dataclass
class Group:
    scope: str
    fingerprint: str
    objects: list[ObjectInfo]
    duplicated: int | None = None  # raw bytes of entries held by more than one object (ls --duplicates)
    unreadable: int = 0  # objects --duplicates could not read or validate

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def newest(self) -> float:
        return max(o.modified for o in self.objects)

    @property
    def oldest(self) -> float:
        return min(o.modified for o in self.objects)


def group(objects: Iterable[StoredObject]) -> list[Group]:
    groups: dict[tuple[str, str], Group] = {}
    for obj in objects:
        groups.setdefault((obj.scope, obj.fingerprint), Group(obj.scope, obj.fingerprint, [])).objects.append(obj.info)
    return [groups[k] for k in sorted(groups)]


def duplicated_bytes(store: Store, prefix: str, g: Group) -> tuple[int, int]:
    """Raw bytes of the entries that ``g``'s objects hold more than once (what every restore of that fingerprint
    fetches and decompresses again), and how many of its objects could not be read and validated. Reads each
    object of a fingerprint with more than one."""
    if len(g.objects) < 2:
        return 0, 0
    folder = Layout(prefix).folder(g.scope, g.fingerprint)
    seen: set[tuple[str, str]] = set()
    duplicated = unreadable = 0
    for info in g.objects:
        try:
            blob = store.get(folder, info.name, bundlemod.DEFAULT_LIMITS.max_object_bytes)
            entries = bundlemod.decode(blob, g.fingerprint)[1] if blob is not None else None
        except (StoreError, BundleError):
            entries = None
        if entries is None:
            unreadable += 1
            continue
        for entry in entries:
            if entry.ident in seen:
                duplicated += len(entry.data)
            seen.add(entry.ident)
    return duplicated, unreadable


def _group_json(g: Group, this: str | None, now: float) -> dict[str, object]:
    extra: dict[str, object] = {} if g.duplicated is None else {"duplicated_bytes": g.duplicated,
                                                                 "unreadable": g.unreadable}
    return {**extra,
        "scope": g.scope, "fingerprint": g.fingerprint, "this": g.fingerprint == this,
        "objects": len(g.objects), "bytes": g.size,
        "newest": g.newest, "oldest": g.oldest,
        "newest_age_s": round(now - g.newest, 3), "oldest_age_s": round(now - g.oldest, 3),
        "names": [{"name": o.name, "bytes": o.size, "modified": o.modified} for o in g.objects],
    }


def _table(rows: list[list[str]], right: frozenset[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]


def _ls_lines(groups: list[Group], this: str | None, now: float, verbose: bool) -> list[str]:
    dups = any(g.duplicated is not None for g in groups)
    rows = [["SCOPE", "FINGERPRINT", "OBJECTS", "SIZE", "NEWEST", "OLDEST"] + (["DUPLICATED"] if dups else [])]
    extra: dict[int, list[str]] = {}  # table row -> object lines after it (-v)
    for g in groups:
        mark = " (this)" if g.fingerprint == this else ""
        dup = [] if not dups else [human_bytes(g.duplicated or 0) + (f" ({g.unreadable} unread)" if g.unreadable
                                                                      else "")]
        rows.append([g.scope, g.fingerprint + mark, str(len(g.objects)), human_bytes(g.size),
                     human_age(now - g.newest), human_age(now - g.oldest), *dup])
        if verbose:
            extra[len(rows) - 1] = [f"    {o.name}  {human_bytes(o.size):>9}  {human_age(now - o.modified):>4}"
                                    for o in g.objects]
    lines = []
    for i, line in enumerate(_table(rows, right=frozenset({2, 3, 4, 5, 6}))):
        lines.append(line)
        lines.extend(extra.get(i, []))
    return lines


def cmd_ls(args: argparse.Namespace) -> int:
    store, settings = open_store(args)
    only = object_filter(args)
    this = this_key()
    objects, ignored = scan(store, settings.prefix)
    groups = group(o for o in objects if only.matches(o))
    if args.duplicates:
        for g in groups:
            g.duplicated, g.unreadable = duplicated_bytes(store, settings.prefix, g)
    now = time.time()
    if args.json:
        print(json.dumps([_group_json(g, this, now) for g in groups], indent=2))
        return 0
    if not groups:
        print(f"no objects in {settings.store_label()}" + ("" if only == ObjectFilter() else " matching the filter"))
    else:
        print("\n".join(_ls_lines(groups, this, now, args.verbose)))
        total = sum(g.size for g in groups)
        count = sum(len(g.objects) for g in groups)
        print(f"{plural(count, 'object')}, {human_bytes(total)}, {plural(len(groups), 'fingerprint')} in "
              f"{plural(len({g.scope for g in groups}), 'scope')} ({settings.store_label()})")
    if ignored:
        print(f"({plural(ignored, 'object')} outside the <scope>/<fingerprint>/ layout ignored)")
    return 0


# --- prune -------------------------------------------------------------------------------------------


def select_for_prune(objects: Iterable[StoredObject], older_than_days: float | None, max_bytes: int | None,
                     now: float) -> list[StoredObject]:
    """Objects older than the cutoff, then the oldest of the rest beyond the size budget; oldest first."""
    pool = sorted(objects, key=lambda o: (o.info.modified, o.info.name))
    doomed: set[StoredObject] = set()
    if older_than_days is not None:
        cutoff = now - older_than_days * 86400
        doomed.update(o for o in pool if o.info.modified < cutoff)
    if max_bytes is not None:
        kept, over = 0, False
        for obj in reversed([o for o in pool if o not in doomed]):  # newest first
            over = over or kept + obj.info.size > max_bytes
            if over:
                doomed.add(obj)
            else:
                kept += obj.info.size
    return [o for o in pool if o in doomed]


def _describe(obj: StoredObject, now: float) -> str:
    return f"{obj.path}  {human_bytes(obj.info.size)}  {human_age(now - obj.info.modified)}"


def cmd_prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_bytes is None:
        raise UsageProblem("prune needs a criterion: --older-than DAYS and/or --max-bytes SIZE")
    store, settings = open_store(args)
    only = ObjectFilter(scope_arg(args.scope))
    objects = [o for o in scan(store, settings.prefix)[0] if only.matches(o)]
    now = time.time()
    doomed = select_for_prune(objects, args.older_than, args.max_bytes, now)
    freed = sum(o.info.size for o in doomed)
    where = settings.store_label() + (f" (scope {only.scope})" if only.scope else "")
    left = f"{plural(len(objects) - len(doomed), 'object')} ({human_bytes(sum(o.info.size for o in objects) - freed)}) remain"
    if not doomed:
        print(f"nothing to prune in {where}: {left}")
        return 0
    if not args.yes:
        for obj in doomed:
            print(f"would delete {_describe(obj, now)}")
        print(f"dry run: nothing deleted. {len(doomed)} of {plural(len(objects), 'object')} ({human_bytes(freed)}) in {where} "
              "would go; run again with --yes to delete them")
        return 0
    for done, obj in enumerate(doomed):
        try:
            store.delete(obj.folder, obj.info.name)
        except StoreError as exc:
            raise StoreError(f"deleted {done} of {plural(len(doomed), 'object')}, then: {exc}", exc.kind) from exc
        print(f"deleted {_describe(obj, now)}")
    print(f"deleted {plural(len(doomed), 'object')} from {where}, freed {human_bytes(freed)}; {left}")
    return 0


# --- key / inspect -----------------------------------------------------------------------------------


def cmd_key(args: argparse.Namespace) -> int:
    try:
        fp = compute()
    except TorchUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"key": fp.key, "digest": fp.digest, **fp.parts}, indent=2, sort_keys=True))
    else:
        # Usable as an actions/cache key: no spaces, '/' replaced by '-'.
        print(fp.key.replace("/", "-") if args.flat else fp.key)
    return 0


def _created(seconds: float) -> str:
    if seconds <= 0:
        return ""
    try:
        return f", created {datetime.fromtimestamp(seconds, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
    except (OverflowError, OSError, ValueError):  # decode bounds it; this is the platform's own limit
        return ""


def _show_bundle(label: str, blob: bytes, folder_key: str | None, verbose: bool) -> int:
    """Validate one bundle and print its header and entry counts (names with ``verbose``)."""
    try:
        header, entries = bundlemod.decode(blob)  # raises BundleError and nothing else, whatever the bytes
    except BundleError as exc:
        print(f"{label}: refused: {exc}")
        return 1
    created = _created(header.created)
    print(f"{label}: fingerprint {header.fingerprint}, {header.entries} entries, "
          f"{human_bytes(header.payload_size)} compressed, {human_bytes(header.raw_size)} raw{created}")
    if verbose and header.extra:
        print(f"  header extra: {json.dumps(dict(header.extra), sort_keys=True)}")
    for kind, count in entries.counts().items():
        print(f"  {kind}: {count}")
        if verbose:
            for entry in entries:
                if entry.kind == kind:
                    print(f"    {entry.name}  {human_bytes(len(entry.data))}  mode {entry.mode:o}")
    if folder_key is not None and header.fingerprint != folder_key:
        print(f"{label}: refused: its header names another fingerprint than its folder ({folder_key})")
        return 1
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if not args.paths and not args.store_objects:
        raise UsageProblem("inspect needs bundle files and/or --store-object SCOPE/FINGERPRINT/NAME")
    status = 0
    for path in args.paths:
        try:
            with open(path, "rb") as fh:
                blob = fh.read()
        except OSError as exc:
            print(f"{path}: refused: {exc}")
            status = 1
            continue
        status |= _show_bundle(path, blob, None, args.verbose)
    if args.store_objects:
        store, settings = open_store(args)
        for ref in args.store_objects:
            obj = object_ref(ref, settings.prefix)
            try:
                fetched = store.get(obj.folder, obj.info.name, bundlemod.DEFAULT_LIMITS.max_object_bytes)
            except StoreError as exc:
                if exc.kind != "too-large":
                    raise
                print(f"{obj.path}: refused: {exc}")
                status = 1
                continue
            if fetched is None:
                print(f"{obj.path}: not found in {settings.store_label()}")
                status = 1
                continue
            status |= _show_bundle(obj.path, fetched, obj.fingerprint, args.verbose)
    return status
