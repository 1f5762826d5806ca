"""The registry of what the plugin replaces in torch (``pytest_megacache.patches``), on stand-ins: no torch here
(tests/dynamo/test_dynamo_reuse.py removes the patches of a real torch)."""

from __future__ import annotations

import types
from typing import Any

from pytest_megacache.patches import Patches
from pytest_megacache.torch_adapter import _SurvivesReset


class SettingsModule(types.ModuleType):
    """Keeps its settings outside its ``__dict__`` as torch's ``ConfigModule`` does, and hides one that is deleted."""

    def __init__(self) -> None:
        super().__init__("settings")
        object.__setattr__(self, "_values", {"threads": 8, "flag": False})
        object.__setattr__(self, "_hidden", set())

    def __getattr__(self, name: str) -> Any:
        if name in self._hidden or name not in self._values:
            raise AttributeError(name)
        return self._values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value
        self._hidden.discard(name)

    def __delattr__(self, name: str) -> None:
        self._hidden.add(name)


class Base:
    @staticmethod
    def inherited() -> str:
        return "base"


class Owner(Base):
    @staticmethod
    def own() -> str:
        return "own"


def test_a_setting_is_set_back_to_what_it_read_as_not_deleted() -> None:
    settings, patches = SettingsModule(), Patches()
    patches.replace(settings, "threads", 1, "one thread")
    patches.replace(settings, "flag", True, "switched on")
    assert (settings.threads, settings.flag) == (1, True) and all(p.setting and not p.inherited for p in patches)
    assert patches.remove_all() == 2
    assert (settings.threads, settings.flag) == (8, False) and not settings._hidden


def test_a_class_keeps_its_own_object_and_loses_what_it_inherited() -> None:
    own, patches = vars(Owner)["own"], Patches()
    patches.replace(Owner, "own", staticmethod(lambda: "ours"), "ours")
    patches.replace(Owner, "inherited", staticmethod(lambda: "ours"), "ours")
    assert Owner.own() == Owner.inherited() == "ours"
    assert patches.remove_all() == 2
    assert vars(Owner)["own"] is own and "inherited" not in vars(Owner) and Owner.inherited() == "base"


def test_torch_gets_its_own_callback_list_back_with_what_was_registered_meanwhile() -> None:
    handler, patches = types.SimpleNamespace(), Patches()
    theirs = handler.start_callbacks = ["before"]
    ours = _SurvivesReset(theirs)
    patches.replace(handler, "start_callbacks", ours, "survives reset", ours.hand_back)
    handler.start_callbacks.append("meanwhile")
    assert handler.start_callbacks is ours and theirs == ["before"]
    assert patches.remove(handler, "start_callbacks") and not patches.remove(handler, "start_callbacks")
    assert handler.start_callbacks is theirs and theirs == ["before", "meanwhile"]


def test_what_was_replaced_again_since_is_left_alone() -> None:
    module, patches = types.ModuleType("m"), Patches()
    module.f = original = object()  # type: ignore[attr-defined]
    patches.replace(module, "f", object(), "ours")
    module.f = theirs = object()  # type: ignore[attr-defined]
    assert patches.remove_all() == 1 and module.f is theirs is not original  # type: ignore[attr-defined]
