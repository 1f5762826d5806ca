"""Where objects live in a store: ``<prefix>/<scope>/<fingerprint key>/<object name>``, in both directions.

One definition of each part, used by the settings (``--megacache-scope``, ``--megacache-prefix``), the CI
environment (a branch sanitized into a scope), the plugin, the why-miss diagnosis, the command line
(``ls``/``prune``/``pull``/``push``/``inspect``) and the stores:

- a **segment** is any one folder part a store accepts: 1 to :data:`SEGMENT_MAX` of :data:`SEGMENT_CHARS`,
  neither ``.`` nor ``..``. Prefix parts (``.cache`` is a fine prefix), scopes and fingerprint key parts
  (``torch-2.13.0+cpu``) are all segments; :func:`valid_segment` is the stores' rule for every folder part.
- a **scope** is a narrower segment: 1 to :data:`SCOPE_MAX` characters, not starting with a dot
  (:func:`valid_scope`). The settings refuse any other; :func:`pytest_megacache.ci_env.sanitize_scope` maps a
  branch name into one.
- a **fingerprint key** is :data:`FINGERPRINT_SEGMENTS` segments joined by ``/``
  (:attr:`pytest_megacache.fingerprint.Fingerprint.key`).
- an **object name** is :func:`valid_object_name`: no slashes, ends in :data:`OBJECT_SUFFIX`.

Pure and light: ``re`` only (no boto3, zstandard, torch or pytest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEGMENT_CHARS = r"A-Za-z0-9_.+\-"  # the body of a regular-expression character class: letters, digits, '_.+-'
SEGMENT_MAX = 200
SCOPE_MAX = 100
FINGERPRINT_SEGMENTS = 4
OBJECT_SUFFIX = ".mcb"
PREFIX_CHARS = r"A-Za-z0-9_.\-"  # a prefix's parts: letters, digits and '_.-' (no '+'), any length

SEGMENT_CHAR = re.compile(f"[{SEGMENT_CHARS}]")  # one character a segment (and so a scope) may hold
_SEGMENT = re.compile(f"[{SEGMENT_CHARS}]{{1,{SEGMENT_MAX}}}")
_SCOPE = re.compile(f"[{SEGMENT_CHARS.replace('.', '')}][{SEGMENT_CHARS}]{{0,{SCOPE_MAX - 1}}}")
_PREFIX = re.compile(f"[{PREFIX_CHARS}]+(/[{PREFIX_CHARS}]+)*")
_OBJECT_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,200}}{re.escape(OBJECT_SUFFIX)}")


def valid_segment(part: str) -> bool:
    """One folder part a store accepts (a prefix part, a scope, a fingerprint key part)."""
    return bool(_SEGMENT.fullmatch(part)) and part not in (".", "..")


def valid_scope(text: str) -> bool:
    """A scope: letters, digits and ``_.+-``, 1 to 100 characters, not starting with a dot."""
    return bool(_SCOPE.fullmatch(text))


def valid_key(key: str) -> bool:
    """A fingerprint key: :data:`FINGERPRINT_SEGMENTS` segments joined by ``/``."""
    parts = key.split("/")
    return len(parts) == FINGERPRINT_SEGMENTS and all(valid_segment(p) for p in parts)


def valid_prefix(text: str) -> bool:
    """A prefix (already stripped of outer slashes): parts of letters, digits and ``_.-``, no ``..`` anywhere."""
    return bool(_PREFIX.fullmatch(text)) and ".." not in text


def valid_object_name(name: str) -> bool:
    """An object's name inside its folder: no slashes, no ``..``, ends in :data:`OBJECT_SUFFIX`."""
    return bool(_OBJECT_NAME.fullmatch(name)) and ".." not in name


@dataclass(frozen=True)
class Layout:
    """``<prefix>/<scope>/<fingerprint key>`` folders holding objects, below one prefix.

    :meth:`folder` builds only what :meth:`parse_folder` parses back (it raises :class:`ValueError` on a
    scope or key outside the layout); the parsers return None for anything else under the prefix.
    """

    prefix: str

    def __post_init__(self) -> None:
        if not valid_prefix(self.prefix):
            raise ValueError(f"prefix {self.prefix[:120]!r} may hold only letters, digits, '_.-' and '/'")

    def folder(self, scope: str, key: str) -> str:
        """The folder holding the objects of fingerprint ``key`` in ``scope``."""
        if not valid_scope(scope):
            raise ValueError(f"scope {scope[:120]!r} may hold only letters, digits and '_.+-' (at most {SCOPE_MAX})")
        if not valid_key(key):
            raise ValueError(f"fingerprint key {key[:240]!r} is not {FINGERPRINT_SEGMENTS} segments of letters, "
                             "digits and '_.+-'")
        return f"{self.prefix}/{scope}/{key}"

    def parse_folder(self, folder: str) -> tuple[str, str] | None:
        """``<prefix>/<scope>/<key>`` -> (scope, key); None for a folder outside the layout."""
        if not folder.startswith(self.prefix + "/"):
            return None
        scope, _, key = folder[len(self.prefix) + 1 :].partition("/")
        if not valid_scope(scope) or not valid_key(key):
            return None
        return scope, key

    def parse_object(self, object_key: str) -> tuple[str, str, str] | None:
        """``<prefix>/<scope>/<key>/<name>`` (an object's full key) -> (scope, key, name); None outside the layout."""
        folder, _, name = object_key.rpartition("/")
        parsed = self.parse_folder(folder)
        if parsed is None or not valid_object_name(name):
            return None
        return parsed[0], parsed[1], name

    def parse_path(self, path: str) -> tuple[str, str, str] | None:
        """``<scope>/<key>/<name>``, an object's address below the prefix (as ``ls -v`` and ``inspect`` show
        it), with or without the prefix in front -> (scope, key, name); None outside the layout."""
        return self.parse_object(path) or self.parse_object(f"{self.prefix}/{path}")
