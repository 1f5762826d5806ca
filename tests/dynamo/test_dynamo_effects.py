"""What a frame's trace does that a test can see (``dynamo.effects``), without torch: torch's counters it adds to and
the warnings it shows, recorded while it is traced, stored as plain data, checked when read back, and done again
where the stored variant is taken."""

from __future__ import annotations

import collections
import json
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_megacache.dynamo import effects as de
from pytest_megacache.dynamo import proofs as dp

MODULE = '''
import warnings


class ProbeWarning(UserWarning):
    pass


def make_local():
    class LocalWarning(UserWarning):
        pass

    return LocalWarning


LocalWarning = make_local()


def warns(category=ProbeWarning, text="shown while traced"):
    warnings.warn(text, category)


def warns_with_arguments():
    warnings.warn(ProbeWarning("two", 2))
'''


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[types.ModuleType]:
    """A module of its own (imported: in ``sys.modules``), and ``warnings._showwarnmsg`` put back afterwards."""
    path = tmp_path / "megacache_probe.py"
    path.write_text(MODULE)
    module = types.ModuleType("megacache_probe")
    module.__file__ = str(path)
    exec(compile(MODULE, str(path), "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "megacache_probe", module)
    monkeypatch.setattr(warnings, "_showwarnmsg", warnings._showwarnmsg)  # type: ignore[attr-defined]
    yield module


def _traced(probe: types.ModuleType, *calls: Any) -> de.Trace:
    """A trace (compile "1/0") during which ``calls`` ran, every warning shown."""
    trace = de.Trace({})
    # watched once per process (by the first state): the watch of an earlier call of this test taken off first
    warnings._showwarnmsg = getattr(warnings._showwarnmsg, "__wrapped__", warnings._showwarnmsg)  # type: ignore[attr-defined]
    de.watch_warnings(types.SimpleNamespace(traces={"1/0": trace}), lambda: "1/0")  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for call in calls:
            call()
    return trace


def _stored(record: dict[str, Any] | None) -> de.Effects:
    """What a later process reads back: the record through JSON, as the stored guards carry it."""
    packed = dp.pack_guards([], "ctx", b"torch's pickle", effects=record)
    return dp.unpack_guards(packed)[4]


def test_what_a_trace_added_to_torchs_counters_is_added_again() -> None:
    table: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    table["stats"].update(unique_graphs=3, calls_captured=10)
    table["graph_break"]["an earlier break"] = 1
    trace = de.Trace(table)
    table["frames"]["total"] += 1  # counted around the compile, where a frame taken from the store passes too
    table["stats"].update(unique_graphs=2, calls_captured=7)
    table["graph_break"]["Call to `torch._dynamo.graph_break()`"] += 1
    table["resumes"]["torch_dynamo_resume_in_f_at_3"] += 1
    table["inductor"]["fxgraph_cache_miss"] += 2  # its backend's compile: from torch's caches either way
    record = de.effects_of(trace, table)
    assert record == {"counters": {"stats": {"unique_graphs": 2, "calls_captured": 7},
                                   "graph_break": {"Call to `torch._dynamo.graph_break()`": 1},
                                   "resumes": {"torch_dynamo_resume_in_f_at_3": 1}}}
    warm: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    warm["stats"]["unique_graphs"] = 5
    de.count_again(_stored(record), warm)
    assert warm == {"stats": {"unique_graphs": 7, "calls_captured": 7},
                    "graph_break": {"Call to `torch._dynamo.graph_break()`": 1},
                    "resumes": {"torch_dynamo_resume_in_f_at_3": 1}}
    assert de.effects_of(de.Trace(table), table) == {}  # a trace that added nothing: nothing stored, none made
    assert de.effects_of(None, table) is None  # a trace not seen: not stored


def test_a_warning_hidden_while_traced_is_not_shown_again(probe: types.ModuleType) -> None:
    """torch hides some of its own warnings while it traces behind a ``warnings.showwarning`` of its own
    (``torch._logging.hide_warnings``, which passes on only what its filter keeps): one hidden so was never shown,
    and is not noted to be shown again; one its filter passes on is."""
    prior = warnings.showwarning

    def hiding(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:  # as hide_warnings makes it
        if "hidden" not in str(message):
            prior(message, category, *args, **kwargs)

    def under_hiding(text: str) -> Any:
        def call() -> None:
            warnings.showwarning = hiding
            try:
                probe.warns(UserWarning, text)
            finally:
                warnings.showwarning = prior
        return call

    trace = _traced(probe, under_hiding("hidden by torch"), under_hiding("passed on"))
    assert trace.shown is not None and [w.message for w in _stored(de.effects_of(trace, {})).warnings] == ["passed on"]


def test_a_warning_shown_while_traced_is_shown_again_as_it_was(probe: types.ModuleType) -> None:
    with warnings.catch_warnings(record=True) as original:
        warnings.simplefilter("always")
        probe.warns()
    trace = _traced(probe, probe.warns, lambda: probe.warns(UserWarning, "a builtin class"))
    assert trace.shown is not None and len(trace.shown) == 2
    effects = _stored(de.effects_of(trace, {}))
    assert [(w.message, w.category, w.module) for w in effects.warnings] == [
        ("shown while traced", ("megacache_probe", "ProbeWarning"), "megacache_probe"),
        ("a builtin class", ("builtins", "UserWarning"), "megacache_probe")]
    with pytest.warns(UserWarning) as again:
        de.shown_again(effects)
    [first, second] = again.list
    assert (first.category, first.filename, first.lineno) == (probe.ProbeWarning, original[0].filename,
                                                               original[0].lineno)
    assert (second.category, str(second.message)) == (UserWarning, "a builtin class")
    # the filters of the moment decide, as for the trace's own warning
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=probe.ProbeWarning, module="megacache_probe")
        with pytest.raises(probe.ProbeWarning):
            de.shown_again(effects)
    with warnings.catch_warnings(record=True) as ignored:
        warnings.filterwarnings("ignore", module="megacache_probe")
        de.shown_again(effects)
    assert ignored == []
    # "default": once per place, in the registry of the module that warned, as warnings.warn notes it
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        probe.warns()
        de.shown_again(effects)
    assert [str(w.message) for w in shown] == ["shown while traced", "a builtin class"]


def test_a_warning_that_cannot_be_shown_again_leaves_the_frame_unstored(probe: types.ModuleType) -> None:
    assert _traced(probe, probe.warns).shown  # the module's own class: found again by name
    assert _traced(probe, lambda: probe.warns(probe.LocalWarning)).shown is None  # a class made in a function
    assert _traced(probe, probe.warns_with_arguments).shown is None  # made of more than its text
    scope: dict[str, Any] = {"__name__": "not_imported", "warnings": warnings}
    exec(compile("def f():\n    warnings.warn('from exec', UserWarning)\n", "<exec>", "exec"), scope)
    assert _traced(probe, scope["f"]).shown is None  # code outside an imported module's namespace
    trace = _traced(probe, probe.warns, lambda: probe.warns(probe.LocalWarning))
    assert trace.shown is None and de.effects_of(trace, {}) is None  # one such warning is enough


def test_a_stored_warning_whose_class_is_gone_shows_nothing_and_is_refused(
        probe: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    effects = _stored(de.effects_of(_traced(probe, lambda: probe.warns(UserWarning), probe.warns), {}))
    monkeypatch.delattr(probe, "ProbeWarning")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(dp.Refused) as refused:
            de.shown_again(effects)
    assert shown == [] and refused.value.reason == "side_effect"  # not even the first: the frame is traced instead
    monkeypatch.delitem(sys.modules, "megacache_probe")
    with pytest.raises(dp.Refused):
        de.shown_again(_stored({"warnings": [["w", ["builtins", "UserWarning"], "f.py", 1, "megacache_probe"]]}))


def test_a_class_is_found_only_among_imported_modules_and_only_a_warning_class() -> None:
    assert de.warning_class("builtins", "DeprecationWarning") is DeprecationWarning
    assert de.warning_class("builtins", "ValueError") is None  # not a warning
    assert de.warning_class("warnings", "WarningMessage") is None
    assert de.warning_class("megacache_never_imported", "W") is None


GOOD = ["text", ["builtins", "UserWarning"], "/p/m.py", 3, "m"]


@pytest.mark.parametrize("record", [
    [], "text", {"warnings": [], "other": 1}, {"warnings": {}}, {"counters": []},
    {"warnings": [GOOD[:4]]}, {"warnings": [[*GOOD[:3], True, "m"]]}, {"warnings": [[*GOOD[:3], -1, "m"]]},
    {"warnings": [[*GOOD[:3], "3", "m"]]}, {"warnings": [[GOOD[0], ["builtins"], *GOOD[2:]]]},
    {"warnings": [[3, *GOOD[1:]]]}, {"warnings": [["x" * 5000, *GOOD[1:]]]}, {"warnings": [GOOD] * 33},
    {"counters": {"inductor": {"fxgraph_cache_hit": 1}}}, {"counters": {"stats": {"unique_graphs": 0}}},
    {"counters": {"stats": {"unique_graphs": True}}}, {"counters": {"stats": {"unique_graphs": 1.0}}},
    {"counters": {"stats": {"unique_graphs": -1}}}, {"counters": {"stats": []}},
    {"counters": {"graph_break": {str(i): 1 for i in range(257)}}},
])
def test_a_stored_record_of_another_form_is_refused(record: Any) -> None:
    """Read back from a stored variant: plain data of the expected types and sizes, else the entry is refused."""
    data = dp.pack_guards([], "ctx", b"torch's pickle")
    header = json.dumps({"proofs": [], "context": "ctx", "effects": record}).encode()
    forged = data[:data.index(b"\n") + 1] + len(header).to_bytes(8, "big") + header + b"torch's pickle"
    with pytest.raises(dp.Refused) as refused:
        dp.unpack_guards(forged)
    assert refused.value.reason == "side_effect"
    assert de.read_effects({"warnings": [GOOD], "counters": {"stats": {"unique_graphs": 2}}}) == de.Effects(
        (de.Shown("text", ("builtins", "UserWarning"), "/p/m.py", 3, "m"),), (("stats", "unique_graphs", 2),))
