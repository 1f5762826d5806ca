"""What the plugin replaces in torch, each a named :class:`Patch`: what it replaces, why, and how it is undone; a
registry (:class:`Patches`) holds them in the order they were put in place and removes them all, last first
(:meth:`Patches.remove_all`), so that torch's own objects and values are torch's again (a test, a process that wants
torch back). As ``unittest.mock.patch.stopall`` and pytest's ``MonkeyPatch.undo`` do: what the owner itself held is
kept (a class's own ``staticmethod`` or ``classmethod`` object, not what the attribute reads as), and an attribute the
owner did not hold (inherited) is deleted again. A module's setting that it keeps elsewhere than in its ``__dict__``
(torch's config modules: ``torch._inductor.config.compile_threads``) is set back to the value it read as, as torch's
own ``config.patch`` does on exit.

Two registries: Dynamo reuse's (:mod:`.dynamo`, which ``dynamo.uninstall()`` removes) and :data:`PATCHES`, the rest
of the plugin's (torch's compile callback lists, the config flags the session sets, the vector-ISA check's
``subprocess``). Imports only the standard library (a child process imports it with :mod:`.isaprobe`); no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["PATCHES", "Patch", "Patches"]

_MISSING: Any = object()


@dataclass(frozen=True)
class Patch:
    """``owner.name`` (a class's or a module's attribute, or a module's setting) replaced by ``replacement``, for
    the reason ``why``."""

    owner: Any
    name: str
    why: str
    original: Any  # what the owner itself held (its __dict__'s value), or _MISSING where it inherited the attribute
    replacement: Any
    setting: bool = False  # a module's setting kept outside its __dict__: ``original`` is the value it read as
    hand_back: Callable[[Any], None] | None = None  # before undo: what the replacement gathered, into the original

    @property
    def inherited(self) -> bool:
        """Whether the owner did not hold the attribute itself (it is deleted again on undo)."""
        return self.original is _MISSING

    def undo(self) -> None:
        """What the owner held before, in place again (left alone where something else replaced it since)."""
        current = getattr(self.owner, self.name, _MISSING) if self.setting else _own(self.owner, self.name)
        if current is not self.replacement:
            return
        if self.hand_back is not None:
            self.hand_back(self.original)
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


def _own(owner: Any, name: str) -> Any:
    try:
        return vars(owner).get(name, _MISSING)
    except TypeError:  # an object without a __dict__: what it reads as
        return getattr(owner, name, _MISSING)


def _setting(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is a module's setting it keeps outside its ``__dict__`` (a module's ``__getattr__``,
    torch's ``ConfigModule``): a module's own attribute is always in its ``__dict__``, it inherits none."""
    return isinstance(owner, ModuleType) and name not in vars(owner) and hasattr(owner, name)


class Patches:
    """The patches in place in this process (torch's state is process-wide), oldest first."""

    def __init__(self) -> None:
        self.applied: list[Patch] = []

    def replace(self, owner: Any, name: str, replacement: Any, why: str,
                hand_back: Callable[[Any], None] | None = None) -> None:
        """``owner.name`` replaced by ``replacement`` (a ``staticmethod`` or ``classmethod`` object for a class's),
        recorded with ``why``; ``hand_back``, where given, is called with the original before it is put back."""
        setting = _setting(owner, name)
        original = getattr(owner, name) if setting else _own(owner, name)
        setattr(owner, name, replacement)
        self.applied.append(Patch(owner, name, why, original, replacement, setting, hand_back))

    def remove(self, owner: Any, name: str) -> bool:
        """The newest patch of ``owner.name`` undone; whether there was one."""
        for index in range(len(self.applied) - 1, -1, -1):
            patch = self.applied[index]
            if patch.owner is owner and patch.name == name:
                del self.applied[index]
                patch.undo()
                return True
        return False

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
