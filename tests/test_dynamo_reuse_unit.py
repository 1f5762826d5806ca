"""Dynamo reuse's checks on their own, without torch (dynamo_proofs): what makes two code objects the same, the
paths and proofs of identity guards, the stored form of guards; and the checked releases and the report's line."""

from __future__ import annotations

import functools
import json
import math
import os
import types
from typing import Any

import pytest

from pytest_megacache import dynamo_proofs as dp
from pytest_megacache import dynamo_reuse as dr
from pytest_megacache.report import dynamo_reuse_text


def _function(source: str, name: str = "f", filename: str = "/project/mod.py",
              module: str = "mod") -> types.FunctionType:
    scope: dict[str, Any] = {"__name__": module}
    exec(compile(source, filename, "exec"), scope)
    fn = scope[name]
    assert isinstance(fn, types.FunctionType)
    return fn


def test_the_same_source_gives_the_same_digest_wherever_the_file_lies() -> None:
    a = _function("def f(x):\n    return x * 2 + 1\n", filename="/ci/a/mod.py")
    b = _function("def f(x):\n    return x * 2 + 1\n", filename="/home/me/mod.py")
    assert dp.code_digest(a.__code__) == dp.code_digest(b.__code__)


@pytest.mark.parametrize("edited", [
    "def f(x):\n    return x * 3 + 1\n",  # a constant
    "def f(x):\n    return x * 2 - 1\n",  # an operator
    "def f(y):\n    return y * 2 + 1\n",  # a variable name
    "def f(x):\n    return abs(x) * 2 + 1\n",  # a name
    "\ndef f(x):\n    return x * 2 + 1\n",  # the first line
    "def f(x):\n    def g():\n        return x * 2\n    return g() + 1\n",  # nested code
])
def test_any_edit_that_decides_behaviour_changes_the_digest(edited: str) -> None:
    base = _function("def f(x):\n    return x * 2 + 1\n")
    assert dp.code_digest(base.__code__) != dp.code_digest(_function(edited).__code__)


def test_nested_code_is_compared_recursively() -> None:
    a = _function("def f(x):\n    def g():\n        return x * 2\n    return g()\n")
    b = _function("def f(x):\n    def g():\n        return x * 3\n    return g()\n")
    assert dp.code_digest(a.__code__) != dp.code_digest(b.__code__)


def test_a_frozenset_constant_is_digested_in_a_fixed_order() -> None:
    """``x in {"a", "b"}`` compiles to a frozenset constant whose iteration order follows the hash seed."""
    code = _function("def f(x):\n    return x in {'alpha', 'beta', 'gamma', 'delta'}\n").__code__
    [const] = [c for c in code.co_consts if isinstance(c, frozenset)]
    reordered = code.replace(co_consts=tuple(frozenset(sorted(const, reverse=True)) if c is const else c
                                             for c in code.co_consts))
    assert dp.code_digest(code) == dp.code_digest(reordered)


def test_entry_ids_differ_by_module_path_and_code_but_not_by_checkout_place(tmp_path: Any) -> None:
    source = "def f(x):\n    return x + 1\n"
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    a = _function(source, filename=str(root_a / "pkg" / "calc.py"), module="pkg.calc")
    b = _function(source, filename=str(root_b / "pkg" / "calc.py"), module="pkg.calc")
    assert dp.source_id(a, str(root_a)) == dp.source_id(b, str(root_b))  # two checkouts of one project
    other_module = _function(source, filename=str(root_a / "pkg" / "other.py"), module="pkg.other")
    assert dp.source_id(other_module, str(root_a)) != dp.source_id(a, str(root_a))  # same name, same line
    edited = _function("def f(x):\n    return x + 2\n", filename=str(root_a / "pkg" / "calc.py"), module="pkg.calc")
    assert dp.source_id(edited, str(root_a)) != dp.source_id(a, str(root_a))


def test_an_entry_id_is_the_function_behind_a_bound_method() -> None:
    fn = _function("def f(self, x):\n    return x\n")

    class Holder:
        method = fn

    assert dp.source_id(Holder().method, "/") == dp.source_id(fn, "/")


@pytest.mark.parametrize(("name", "steps"), [
    ("G['torch']", [("global", "torch")]),
    ("G['torch'].nn.functional.relu", [("global", "torch"), ("attr", "nn"), ("attr", "functional"),
                                       ("attr", "relu")]),
    ("G['__builtins_dict___3']['len']", [("global", "__builtins_dict___3"), ("key", "len")]),
])
def test_paths_from_the_globals_parse(name: str, steps: list[tuple[str, str]]) -> None:
    assert dp.parse_path(name) == steps


@pytest.mark.parametrize("name", ["L['self']", "G['f'].__closure__[0].cell_contents", "G['x'][0]",
                                  "___odict_getitem(G['d'], 'k')", "G['x'].y + 1"])
def test_other_sources_do_not_parse(name: str) -> None:
    assert dp.parse_path(name) is None


def test_proofs_hold_for_the_same_objects_and_fail_for_rebound_ones() -> None:
    helper = _function("def helper(x):\n    return x + 1\n", name="helper")
    scope = {"math": math, "helper": helper, "os": os}
    proofs = [dp.prove("G['math'].sqrt", math.sqrt, scope), dp.prove("G['helper']", helper, scope),
              dp.prove("G['os'].path", os.path, scope)]
    dp.check_proofs(json.loads(json.dumps(proofs)), scope)  # stored as JSON: the check reads what was stored
    dp.check_proofs(proofs, {**scope, "helper": _function("def helper(x):\n    return x + 1\n", name="helper")})
    with pytest.raises(dp.Refused) as rebound:
        dp.check_proofs(proofs, {**scope, "helper": _function("def helper(x):\n    return x - 1\n", name="helper")})
    assert rebound.value.reason == "global_changed"
    with pytest.raises(dp.Refused) as gone:
        dp.check_proofs(proofs, {"math": math, "os": os})
    assert gone.value.reason == "global_changed"


@pytest.mark.parametrize("obj", [object(), [1, 2], functools.partial(math.sqrt, 4.0), {"a": 1}])
def test_an_identity_guard_on_an_object_without_a_stable_name_is_not_provable(obj: object) -> None:
    with pytest.raises(dp.Refused) as refused:
        dp.prove("G['thing']", obj, {"thing": obj})
    assert refused.value.reason == "unsupported_guard"


def test_a_path_that_does_not_reach_the_guarded_object_is_not_provable() -> None:
    with pytest.raises(dp.Refused):
        dp.prove("G['math']", os, {"math": math})


def test_describe_names_what_another_process_can_find_again() -> None:
    assert dp.describe(math) == ["module", "math"]
    assert dp.describe(math.sqrt) == ["builtin", "builtin_function_or_method", "math", "sqrt"]
    assert dp.describe(dict) == ["class", "builtins", "dict"]
    assert dp.describe(None) == ["const", "None"]
    closure = _function("def outer():\n    k = 1\n    def f():\n        return k\n    return f\n", name="outer")()
    assert dp.describe(closure) is None  # its cells are state no description carries
    assert dp.describe("text".upper) is None  # bound to an instance


def test_guards_travel_with_their_proofs_and_without_them_are_refused() -> None:
    proofs = [{"path": [["global", "math"]], "is": ["module", "math"]}]
    packed = dp.pack_guards(proofs, b"torch's pickle")
    assert dp.unpack_guards(packed) == (proofs, b"torch's pickle")
    with pytest.raises(dp.Refused):
        dp.unpack_guards(b"torch's pickle")  # what torch stores by itself: no proofs, never used


def test_only_checked_releases_are_allowed() -> None:
    assert dr.release_checked("2.13.0+cpu") and dr.release_checked("2.11.0+cu130") and dr.release_checked("2.14.1")
    assert not any(dr.release_checked(v) for v in ("2.7.1", "2.10.0", "2.12.1", "2.15.0", "2.130.0", "nightly"))


def test_the_report_line_counts_reuse_and_refusals() -> None:
    assert dynamo_reuse_text({"fxgraph_cache_hit": 3}) == ""
    line = dynamo_reuse_text({"dynamo_reused": 5, "dynamo_traced": 2, "dynamo_stored": 2,
                              "dynamo_refused_code_changed": 1, "dynamo_refused_global_changed": 2})
    assert line == ("Dynamo reuse 5 installed / 2 traced / 3 refused (code changed 1, global changed 2), "
                    "2 stored")
