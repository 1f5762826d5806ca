"""torch's functions that Dynamo reuse replaces, each a named :class:`Patch`: what it replaces, why, and how it is
undone; one registry (:data:`PATCHES`) holds them in the order they were put in place and removes them all, last
first (:meth:`Patches.remove_all`), so that torch's own functions are torch's again (a session that turns reuse off,
a test). As ``unittest.mock.patch.stopall`` and pytest's ``MonkeyPatch.undo`` do: what the owner itself held is kept
(a class's own ``staticmethod`` or ``classmethod`` object, not what the attribute reads as), and an attribute the
owner did not hold (inherited) is deleted again. No torch imported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["PATCHES", "Patch", "Patches"]

_MISSING: Any = object()


@dataclass(frozen=True)
class Patch:
    """``owner.name`` (a class's or a module's attribute) replaced by ``replacement``, for the reason ``why``."""

    owner: Any
    name: str
    why: str
    original: Any  # what the owner itself held (its __dict__'s value), or _MISSING where it inherited the attribute
    replacement: Any

    @property
    def inherited(self) -> bool:
        """Whether the owner did not hold the attribute itself (it is deleted again on undo)."""
        return self.original is _MISSING

    def undo(self) -> None:
        """What the owner held before, in place again (left alone where something else replaced it since)."""
        if _own(self.owner, self.name) is not self.replacement:
            return
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


def _own(owner: Any, name: str) -> Any:
    try:
        return vars(owner).get(name, _MISSING)
    except TypeError:  # an object without a __dict__: what it reads as
        return getattr(owner, name, _MISSING)


class Patches:
    """The patches in place in this process (torch's state is process-wide), oldest first."""

    def __init__(self) -> None:
        self.applied: list[Patch] = []

    def replace(self, owner: Any, name: str, replacement: Any, why: str) -> None:
        """``owner.name`` replaced by ``replacement`` (a ``staticmethod`` or ``classmethod`` object for a class's),
        recorded with ``why``."""
        original = _own(owner, name)
        setattr(owner, name, replacement)
        self.applied.append(Patch(owner, name, why, original, replacement))

    def remove_all(self) -> int:
        """Every patch undone, the last first; how many there were."""
        count = len(self.applied)
        while self.applied:
            self.applied.pop().undo()
        return count

    def __iter__(self) -> Iterator[Patch]:
        return iter(list(self.applied))

    def __len__(self) -> int:
        return len(self.applied)


PATCHES = Patches()
