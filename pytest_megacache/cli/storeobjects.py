"""What the store commands share: the store their options name, the objects in it that follow the layout, and the
filters that pick some of them (by scope and by fingerprint); also the command's name and its usage errors.

The layout is ``<prefix>/<scope>/<fingerprint key>/<object name>.mcb`` (:class:`.layout.Layout`): one segment of
scope (a branch, '/' written as '+') and four of fingerprint key. :func:`scan` counts anything else under the
prefix and leaves it alone. The store options resolve as in a pytest session (:mod:`.storeopts`, then
``MEGACACHE_*``; no ini file).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ..fingerprint import TorchUnavailable, compute
from ..layout import FINGERPRINT_SEGMENTS, SCOPE_MAX, Layout, valid_key, valid_scope
from ..settings import OPTIONS, Settings, SettingsError, resolve
from ..stores import ObjectInfo, Store, from_settings
from .storeopts import STORE_FIELDS, cli_flags

PROG = "pytest-megacache"  # the command's name, as its error lines start


class UsageProblem(Exception):
    """A bad argument or setting: one line on stderr and exit status 2."""


def this_key() -> str | None:
    """This environment's fingerprint key, or None without a usable torch."""
    try:
        return compute().key
    except TorchUnavailable:
        return None


@dataclass(frozen=True)
class StoredObject:
    """One object laid out as ``prefix/scope/fingerprint/name``."""

    prefix: str
    scope: str
    fingerprint: str
    info: ObjectInfo

    @property
    def folder(self) -> str:
        return Layout(self.prefix).folder(self.scope, self.fingerprint)

    @property
    def path(self) -> str:
        """The object's address below the prefix, as ``inspect --store-object`` takes it."""
        return f"{self.scope}/{self.fingerprint}/{self.info.name}"


@dataclass(frozen=True)
class ObjectFilter:
    """Which stored objects a command works on: one scope and/or one fingerprint, or all."""

    scope: str | None = None  # None: every scope
    fingerprint: str | None = None  # None: every fingerprint

    def matches(self, obj: StoredObject) -> bool:
        return self.scope in (None, obj.scope) and self.fingerprint in (None, obj.fingerprint)


def scan(store: Store, prefix: str) -> tuple[list[StoredObject], int]:
    """The objects below ``prefix`` that follow the layout, and how many others were ignored."""
    layout = Layout(prefix)
    objects: list[StoredObject] = []
    ignored = 0
    for folder, info in store.walk(prefix):
        parsed = layout.parse_folder(folder)
        if parsed is None:
            ignored += 1
            continue
        objects.append(StoredObject(prefix, *parsed, info))
    return objects, ignored


def _store_settings(args: argparse.Namespace) -> Settings:
    """The store options, through the plugin's own resolution: command line, then MEGACACHE_* (no ini)."""
    env_names = {opt.env for opt in OPTIONS if opt.name in STORE_FIELDS}
    env = {k: v for k, v in os.environ.items() if k in env_names}
    try:
        return resolve(cli=lambda name: getattr(args, name, None) if name in STORE_FIELDS else None,
                       env=env, ini=lambda _name: None)
    except SettingsError as exc:
        raise UsageProblem(cli_flags(str(exc))) from exc


def open_store(args: argparse.Namespace) -> tuple[Store, Settings]:
    """The store a command's options (or ``MEGACACHE_*``) name, and the settings it was made from."""
    settings = _store_settings(args)
    if not (settings.bucket or settings.directory):
        raise UsageProblem("no store configured: pass --bucket or --dir (or set MEGACACHE_BUCKET or MEGACACHE_DIR)")
    try:
        return from_settings(settings), settings
    except ValueError as exc:  # botocore refuses a malformed endpoint when the client is built
        raise UsageProblem(f"cannot use this store: {exc}") from exc


def scope_arg(text: str | None) -> str | None:
    """``--scope``: a branch name as the plugin writes it (``/`` as ``+``), checked for shape; None: every scope."""
    if text is None:
        return None
    scope = text.replace("/", "+")  # a branch name as the plugin writes it
    if not valid_scope(scope):
        raise UsageProblem(f"--scope {text!r}: a scope is one segment of letters, digits and '_.+-' "
                           f"(at most {SCOPE_MAX}, not starting with '.')")
    return scope


def _fingerprint(text: str) -> str | None:
    """``all`` -> None, ``this`` -> this environment's key, else a key checked for shape."""
    if text == "all":
        return None
    if text == "this":
        key = this_key()
        if key is None:
            raise UsageProblem("--fingerprint this: no usable torch here to compute the fingerprint from")
        return key
    if not valid_key(text):
        raise UsageProblem(f"--fingerprint {text!r}: expected this, all or a key of {FINGERPRINT_SEGMENTS} segments "
                           "(as `pytest-megacache key` prints it)")
    return text


def object_filter(args: argparse.Namespace) -> ObjectFilter:
    return ObjectFilter(scope_arg(args.scope), _fingerprint(getattr(args, "fingerprint", "all")))


def object_ref(ref: str, prefix: str) -> StoredObject:
    """``SCOPE/FINGERPRINT/NAME`` (optionally with the prefix in front) -> the object's address."""
    parsed = Layout(prefix).parse_path(ref.strip("/"))
    if parsed is None:
        raise UsageProblem(f"--store-object {ref!r}: expected SCOPE/FINGERPRINT/NAME.mcb "
                           "(as `pytest-megacache ls -v` lists them)")
    scope, key, name = parsed
    return StoredObject(prefix, scope, key, ObjectInfo(name, 0, 0.0))
