"""Dynamo reuse's checks on their own, without torch (dynamo_proofs): what makes two code objects the same, the
paths and proofs of identity guards, the stored form of guards; and the checked releases and the report's line."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pickle
import subprocess
import sys
import time
import types
from typing import Any, NamedTuple

import pytest

from pytest_megacache import dynamo as dr
from pytest_megacache.dynamo import effects as dynamo_effects
from pytest_megacache.dynamo import offers as dynamo_offers
from pytest_megacache.dynamo import proofs as dp
from pytest_megacache.dynamo import repairs as dynamo_repairs
from pytest_megacache.dynamo.paths import path_text
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


_HASH_ORDERED = """
import json
from pytest_megacache.dynamo import context, proofs
namespace = {}
exec(compile("def f(x):\\n    return x in {'alpha', 'beta', 'gamma', 'delta'}\\n", "calc.py", "exec"), namespace)
code = namespace["f"].__code__
[constant] = [c for c in code.co_consts if isinstance(c, frozenset)]
words = {"b", "a", "c"}
print(json.dumps({"constant": list(constant), "digest": proofs.code_digest(code), "words": list(words),
                  "canonical": context.canonical(words)}))
"""


def test_what_hashing_orders_is_digested_in_one_order_in_every_interpreter() -> None:
    """``x in {"a", "b"}`` compiles to a frozenset constant, and a compile setting can be a set: their iteration order
    follows the interpreter's hash seed. Two interpreters whose seeds iterate them differently digest them alike."""
    seen = []
    for seed in ("1", "2"):  # seeds under which both iterate in other orders (checked below)
        out = subprocess.run([sys.executable, "-c", _HASH_ORDERED], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, timeout=120, check=True)
        seen.append(json.loads(out.stdout))
    one, two = seen
    assert one["constant"] != two["constant"] and one["words"] != two["words"]  # the orders do differ
    assert one["digest"] == two["digest"] and one["canonical"] == two["canonical"] == "{'a','b','c'}"


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
    ("L['self']", [("local", "self")]),
    ("type(L['td'])", [("local", "td"), ("type", "")]),
    ("L['td']._tensordict['a'].__class__", [("local", "td"), ("attr", "_tensordict"), ("key", "a"),
                                            ("attr", "__class__")]),
    ("dict(type(L['s']).__mro__[1].__dict__)['p'].fget",
     [("local", "s"), ("type", ""), ("attr", "__mro__"), ("index", "1"), ("attr", "__dict__"), ("dict", ""),
      ("key", "p"), ("attr", "fget")]),
    ("type(G['x'].dataclasses.MISSING)", [("global", "x"), ("attr", "dataclasses"), ("attr", "MISSING"),
                                          ("type", "")]),
    ("list(dict.keys(G['handlers']))[0]", [("global", "handlers"), ("keys", ""), ("index", "0")]),
    ("__import__('torch').utils._pytree", [("module", "torch"), ("attr", "utils"), ("attr", "_pytree")]),
    ("type(L['seq']._modules['0'])", [("local", "seq"), ("attr", "_modules"), ("key", "0"), ("type", "")]),
    ("G['m'].handlers[list(dict.keys(G['m'].handlers))[3]]", [("global", "m"), ("attr", "handlers"), ("value", "3")]),
    ("G['f'].__closure__[0].cell_contents", [("global", "f"), ("attr", "__closure__"), ("index", "0"),
                                              ("attr", "cell_contents")]),
    ("G['torch'].nn.functional.relu", [("global", "torch"), ("attr", "nn"), ("attr", "functional"),
                                       ("attr", "relu")]),
    ("G['__builtins_dict___3']['len']", [("global", "__builtins_dict___3"), ("key", "len")]),
    # a module dict's key as torch writes it
    ("type(L['self']._modules['<a___to___b>']).__mro__[2].__call__",
     [("local", "self"), ("attr", "_modules"), ("key", "<a___to___b>"), ("type", ""), ("attr", "__mro__"),
      ("index", "2"), ("attr", "__call__")]),
])
def test_paths_from_the_globals_parse(name: str, steps: list[tuple[str, str]]) -> None:
    assert dp.parse_path(name) == steps
    assert path_text(steps) == name


@pytest.mark.parametrize("name", ["___odict_getitem(G['d'], 'k')", "G['x'].y + 1", "len(L['x'])", "type(L['x']",
                                  "S['x']", "G['x'][-1]", "G['x']['a\\'b']",
                                  "G['a'][list(dict.keys(G['b']))[0]]"])
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
    assert dp.describe(dict)[:3] == ["class", "builtins", "dict"]
    assert dp.describe(None) == ["const", "None"]
    outer = _function("def outer(k):\n    def f():\n        return k\n    return f\n", name="outer")
    assert dp.describe(outer(1)) == dp.describe(outer(1))  # a factory's product: its code and what its cells hold
    assert dp.describe(outer(1)) != dp.describe(outer(2))
    assert dp.describe(outer(object())) is None  # its cell holds state no description carries
    assert dp.find(dp.describe(outer(1))) is None  # and it has no name to be found again by
    assert dp.describe("text".upper) is None  # bound to an instance


def test_guards_travel_with_their_proofs_and_without_them_are_refused() -> None:
    proofs = [{"path": [["global", "math"]], "is": ["module", "math"]}]
    packed = dp.pack_guards(proofs, "a context", b"torch's pickle")
    assert dp.unpack_guards(packed) == (proofs, "a context", b"torch's pickle", ("", False), dynamo_effects.Effects(), 0.0,
                                        None, 0.0)
    # the modules a variant needs (those whose functions its trace inlined or imported) travel with it
    needs = dp.pack_guards(proofs, "a context", b"torch's pickle", modules=["pkg.generated", "math"])
    assert dp.unpack_guards(needs).modules == frozenset({"pkg.generated", "math"})
    tag = dp.tag_of_test("tests/t.py::test_a[secret]")
    tagged = dp.pack_guards(proofs, "a context", b"torch's pickle", tag, retraced=True)
    assert dp.unpack_guards(tagged)[3] == (tag, True) and tag != dp.tag_of_test("tests/t.py::test_b")
    assert b"secret" not in tagged and dp.guards_digest(tagged) != dp.guards_digest(packed)
    with pytest.raises(dp.Refused):
        dp.unpack_guards(b"torch's pickle")  # what torch stores by itself: no proofs, never used


def test_only_checked_releases_are_allowed() -> None:
    assert all(dr.release_checked(v) for v in ("2.13.0+cpu", "2.11.0+cu130", "2.12.1", "2.14.1", "2.15.0+cu132"))
    assert not any(dr.release_checked(v) for v in ("2.7.1", "2.10.0", "2.16.0", "2.130.0", "nightly"))


def test_only_final_releases_count_as_checked_builds() -> None:
    """torch's own final builds, for any device, against snapshots of its main branch and local builds: those have
    the minor release's number, not its internals."""
    assert all(dr.final_release(v) for v in ("2.13.0", "2.13.0+cpu", "2.11.0+cu130", "2.12.1", "2.15.0+cu132",
                                              "2.9.1+rocm6.4", "2.8.0+xpu", "2.14.1+cpu.cxx11.abi"))
    assert not any(dr.final_release(v) for v in (
        "2.15.0a0+gitecf3bae", "2.14.0.dev20260101+cpu", "2.13.0rc1", "2.13.0+git1234abc", "2.13.0+local",
        "2.5.0a0+e000cf0ad9.nv24.10", "2.13.0.post1", "2.13.0b1", "2.13.0+cu130.gitabc", "nightly", ""))


def test_the_report_line_counts_reuse_and_refusals() -> None:
    assert dynamo_reuse_text({"fxgraph_cache_hit": 3}) == ""
    line = dynamo_reuse_text({"dynamo_reused": 5, "dynamo_frames_reused": 7, "dynamo_traced": 2, "dynamo_stored": 2,
                              "dynamo_refused_code_changed": 1, "dynamo_refused_global_changed": 2})
    assert line == ("Dynamo reuse 7 frames reused / 2 traced (78 % reused) / 3 refused (code changed 1, "
                    "global changed 2), 5 entries loaded, 2 stored")


# --- proofs rooted at a frame's locals, address-named globals, module members ------------------------------------
LIB = '''
import functools


class State:
    def __init__(self, a):
        self.a = a

    @property
    def double(self):
        return self.a * @GETTER@

    def scale(self, k):
        return self.a * @METHOD@


def deco(func):
    @functools.wraps(func)
    def wrapper(*args):
        return func(*args) + 1
    return wrapper


@deco
def wrapped(x):
    return x * @WRAPPED@


def make_local_class():
    class Local:
        pass
    return Local
'''


def _module(monkeypatch: pytest.MonkeyPatch, getter: int = 2, method: int = 3, wrapped: int = 4,
            name: str = "megacache_unit_lib") -> types.ModuleType:
    """The library as a module imported under ``name`` (a new module object each call: another process's import)."""
    source = LIB.replace("@GETTER@", str(getter)).replace("@METHOD@", str(method)).replace("@WRAPPED@", str(wrapped))
    module = types.ModuleType(name)
    exec(compile(source, f"/project/{name}.py", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _stored(proof: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(json.dumps([proof]))  # the check reads what was stored, as JSON


def test_the_class_of_a_local_is_proven_by_name_and_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("type(L['s'])", "L['s'].__class__"):
        lib = _module(monkeypatch)
        proof = dp.prove(name, lib.State, {}, {"s": lib.State(1)})
        assert proof["is"][:3] == ["class", "megacache_unit_lib", "State"]
        dp.check_proofs(_stored(proof), {}, {"s": _module(monkeypatch).State(1)})  # the same source, imported again
        for edit in ({"method": 5}, {"getter": 7}):  # a method or a property's getter edited, same names and lines
            with pytest.raises(dp.Refused) as edited:
                dp.check_proofs(_stored(proof), {}, {"s": _module(monkeypatch, **edit).State(1)})
            assert edited.value.reason == "local_changed"


def test_a_class_rebound_by_monkeypatch_is_another_class(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _module(monkeypatch)
    proof = dp.prove("type(L['s'])", lib.State, {}, {"s": lib.State(1)})
    monkeypatch.setattr(lib.State, "scale", lambda self, k: self.a - k)
    with pytest.raises(dp.Refused):
        dp.check_proofs(_stored(proof), {}, {"s": lib.State(1)})


def test_a_class_defined_in_a_function_is_never_proven(monkeypatch: pytest.MonkeyPatch) -> None:
    local_class = _module(monkeypatch).make_local_class()
    with pytest.raises(dp.Refused) as refused:
        dp.prove("type(L['s'])", local_class, {}, {"s": local_class()})
    assert refused.value.reason == "unsupported_guard"


def test_a_property_getter_reached_from_a_local_class(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _module(monkeypatch)
    name = "dict(type(L['s']).__dict__)['double'].fget"
    proof = dp.prove(name, lib.State.double.fget, {}, {"s": lib.State(1)})
    dp.check_proofs(_stored(proof), {}, {"s": _module(monkeypatch).State(1)})
    with pytest.raises(dp.Refused):
        dp.check_proofs(_stored(proof), {}, {"s": _module(monkeypatch, getter=9).State(1)})


def test_the_function_behind_a_decorator_is_found_again_and_put_in_the_loaded_locals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _module(monkeypatch)
    inner = lib.wrapped.__wrapped__
    proof = dp.prove("L['func']", inner, {}, {"func": inner})
    assert proof["is"][:3] == ["function", "megacache_unit_lib", "wrapped"]
    again = _module(monkeypatch)
    loaded: dict[str, Any] = {"func": object()}  # what torch's pickle gives for a function it cannot name
    dp.check_proofs(_stored(proof), {}, loaded)
    assert loaded["func"] is again.wrapped.__wrapped__  # the guard is rebuilt on the function the frame will see
    copy = types.FunctionType(inner.__code__.replace(), inner.__globals__, inner.__name__)  # torch 2.15 pickles it
    copy.__module__, copy.__qualname__ = inner.__module__, inner.__qualname__  # by value: a copy, described the same
    assert copy is not inner and dp.describe(copy) == dp.describe(inner)
    loaded = {"func": copy}
    dp.check_proofs(_stored(proof), {}, loaded)
    assert loaded["func"] is again.wrapped.__wrapped__  # not the copy, on which an identity guard never holds
    _module(monkeypatch, wrapped=8)
    with pytest.raises(dp.Refused) as edited:
        dp.check_proofs(_stored(proof), {}, {"func": object()})
    assert edited.value.reason == "local_changed"


def test_a_decorators_wrapper_is_described_with_what_its_cells_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _module(monkeypatch)
    proof = dp.prove("L['f']", lib.wrapped, {}, {"f": lib.wrapped})
    dp.check_proofs(_stored(proof), {}, {"f": _module(monkeypatch).wrapped})
    with pytest.raises(dp.Refused):
        dp.check_proofs(_stored(proof), {}, {"f": _module(monkeypatch, wrapped=5).wrapped})


def test_a_global_named_after_an_address_is_bound_again_by_what_it_held() -> None:
    name = f"_{id(math)}_c3"
    proof = dp.prove(f"G['{name}'].sqrt", math.sqrt, {name: math})
    assert proof["bind"] == ["module", "math"]
    scope: dict[str, Any] = {}
    bound: list[tuple[str, Any]] = []

    def bind(key: str, value: Any) -> None:
        bound.append((key, value))
        scope[key] = value

    dp.check_proofs(_stored(proof), scope, {}, bind)
    assert bound == [(name, math)]
    with pytest.raises(dp.Refused):  # without a way to bind it: refused, never a NameError in the installed code
        dp.check_proofs(_stored(proof), {}, {}, None)
    with pytest.raises(dp.Refused):  # the name holds another object in this process
        dp.check_proofs(_stored(proof), {name: os}, {}, bind)


def test_a_global_the_trace_installed_for_its_output_code_is_bound_again_or_the_frame_is_not_stored() -> None:
    """A trace installs globals its output code reads (a tensor subclass's class, to wrap what the graph returns, as
    ``__subclass_<name>_<id>_c<n>``) that torch's install of the entry does not make again: each is stored with what
    it held and bound again where the variant is taken (without, the variant failed there with a NameError); one that
    cannot be found by name keeps the frame out of the store. The entry's own backends, resume functions, imports
    and builtins dict are torch's to make again."""
    from pytest_megacache.dynamo.proof_globals import prove_installed, recreated_globals

    subclass, made = f"__subclass_OrderedDict_{id(collections.OrderedDict)}_c7", "__warnings_warn_wrapper_0"
    entry = types.SimpleNamespace(backend_ids=["__compiled_fn_1"], function_names=[],
                                  import_sources={"__import_math": "math"})
    resume = types.SimpleNamespace(backend_ids=[], function_names=["__resume_at_4_2"], import_sources={})
    package = types.SimpleNamespace(_current_entry=entry, _codes={"f": entry, "resume": resume})
    graph = types.SimpleNamespace(package=package,
                                  installed_globals={subclass, "__compiled_fn_1", "__resume_at_4_2", "__import_math",
                                                     "__builtins_dict___0"})
    recreated = recreated_globals(graph, "__builtins_dict___0")
    assert recreated == {"__compiled_fn_1", "__resume_at_4_2", "__import_math", "__builtins_dict___0"}
    scope: dict[str, Any] = {subclass: collections.OrderedDict, "__compiled_fn_1": print}
    [proof] = prove_installed(graph.installed_globals, recreated, [], scope)
    assert proof["path"] == [("global", subclass)] and proof["is"] == proof["bind"]
    assert proof["is"][:3] == ["class", "collections", "OrderedDict"]  # and its definition's digest
    assert prove_installed(graph.installed_globals, recreated, [proof], scope) == []  # bound by a guard's proof
    later: dict[str, Any] = {}
    dp.check_proofs(_stored(proof), later, {}, later.__setitem__)
    assert later == {subclass: collections.OrderedDict}
    with pytest.raises(dp.Refused, match="a global of this process only"):
        prove_installed({made}, recreated, [], {made: lambda *a: None})
    with pytest.raises(dp.Refused):  # installed, and gone from the globals already
        prove_installed({subclass}, recreated, [], {})


def test_an_extension_function_is_described_as_a_modules_member() -> None:
    """A builtin with no module of its own (an extension's function, e.g. ``torch._C._get_tracing_state``), reached
    as an attribute of a module: its name, kind and documentation say which one it is."""
    owner = types.ModuleType("megacache_unit_ext")
    member = dp.describe_member(owner, "get_state", len)
    assert member is not None and member[:5] == ["member", "megacache_unit_ext", "get_state",
                                                 "builtin_function_or_method", "len"]
    assert dp.describe_member(owner, "get_state", abs) != member  # another builtin bound to that name
    assert dp.describe_member(types.SimpleNamespace(), "get_state", len) is None  # not a module's attribute
    assert dp.describe_member(owner, "get_state", lambda x: x) is None  # a Python function is described by code


def test_the_class_under_a_type_guard_is_proven_by_name_and_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _module(monkeypatch)
    proof = dp.prove_class("L['s']", lib.State)
    dp.check_proofs(_stored(proof), {}, {})
    monkeypatch.setattr(lib.State, "scale", lambda self, k: self.a - k)
    with pytest.raises(dp.Refused) as rebound:
        dp.check_proofs(_stored(proof), {}, {})
    assert rebound.value.reason == "class_changed"
    assert dp.prove_class("L['d']", type(vars(lib.State))) == {}  # mappingproxy: defined in C, nothing to prove
    # what Python fills in where a class's annotations are first read is no other definition
    plain = type("Plain", (), {"scale": lambda self, k: k})
    from pytest_megacache.dynamo.objects import class_digest

    before = class_digest(plain)
    assert plain.__annotations__ == {} and class_digest(plain) == before
    annotated = type("Plain", (), {"scale": plain.__dict__["scale"], "__annotations__": {"a": int}})
    assert class_digest(annotated) != before
    with pytest.raises(dp.Refused):
        dp.prove_class("L['s']", lib.make_local_class())


def test_a_factorys_function_reached_through_a_class_is_proven_by_code_and_cells(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _module(monkeypatch)
    made = lib.deco(lib.make_local_class)  # a wrapper made at run time: no name finds it again
    monkeypatch.setattr(lib.State, "made", made, raising=False)
    name = "dict(type(L['s']).__dict__)['made']"
    proof = dp.prove(name, made, {}, {"s": lib.State(1)})
    dp.check_proofs(_stored(proof), {}, {"s": lib.State(1)})
    with pytest.raises(dp.Refused):  # the root itself must be found by name: the loaded local cannot be
        dp.prove("L['f']", made, {}, {"f": made})


# --- the packages of one function merged ------------------------------------------------------------------------
@dataclasses.dataclass
class _Variant:
    guards_state: bytes
    dynamo_code: str


@dataclasses.dataclass
class _Code:
    python_code: Any
    python_module: str
    function_names: list[str]
    guarded_codes: list[_Variant]
    backend_ids: list[str]
    import_sources: dict[str, str]
    bypassed: bool


@dataclasses.dataclass
class _Entry:
    codes: list[_Code]


def test_merged_packages_keep_each_variant_and_resume_function_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wrapper's package holds the variants it loaded as well as its own: merged, each variant is there once,
    the codes of one code object are one (torch installs one entry per code object) with every name each package
    gave it (a resume function is named anew by each trace, and its variants call it by that name), bypassed only
    where every package bypassed it, and a package of other code is not merged."""
    from pytest_megacache.dynamo import merge as dynamo_merge

    monkeypatch.setattr(dynamo_merge, "stored_code", lambda entry: entry.python_code)
    code = (lambda x: x).__code__
    loaded = [_Variant(b"g1", "a"), _Variant(b"g2", "b")]
    first = _Entry([_Code(code, "m", [], list(loaded), ["be1"], {}, False),
                    _Code(None, "m", ["__resume_1"], [_Variant(b"r1", "c")], ["be1"], {}, False)])
    second = _Entry([_Code(code, "m", [], [*loaded, _Variant(b"g3", "d")], ["be1", "be2"], {"a": "b"}, False),
                     _Code(None, "m", ["__resume_2"], [_Variant(b"r1", "c"), _Variant(b"r2", "e")], [], {}, True)])
    merged = dynamo_merge._merged([first, second])
    main, resume = merged.codes
    assert [v.guards_state for v in main.guarded_codes] == [b"g1", b"g2", b"g3"]
    assert main.backend_ids == ["be1", "be2"] and main.import_sources == {"a": "b"} and not main.bypassed
    # bypassed by one package only (a frame of it could not be stored there): the other's variants are installed
    assert [v.guards_state for v in resume.guarded_codes] == [b"r1", b"r2"] and not resume.bypassed
    assert resume.function_names == ["__resume_1", "__resume_2"]
    both = dynamo_merge._merged([second, second])
    assert both.codes[1].bypassed  # bypassed by every package: torch installs nothing of it, as it would
    # a variant whose proofs failed in this process is not stored again from it
    kept = dynamo_merge._without(merged, {hashlib.sha256(b"g2").hexdigest(), hashlib.sha256(b"r1").hexdigest()})
    assert [[v.guards_state for v in code.guarded_codes] for code in kept.codes] == [[b"g1", b"g3"], [b"r2"]]
    assert dynamo_merge._without(merged, set()) is merged
    other = _Entry([_Code((lambda y: y + 1).__code__, "m", [], [], [], {}, False)])
    with pytest.raises(ValueError, match="other code"):
        dynamo_merge._merged([first, other])



def test_a_merged_entry_keeps_only_the_compiled_graphs_its_variants_call() -> None:
    """A variant left out (or the copies of one variant two packages held) leaves its compiled graph behind: kept, an
    entry grew by one graph at every run of a test whose frame is traced anew each time (five graphs, 400 KB, per run
    on a tensor-container suite), and was written again each time. The graphs a kept variant calls, from its own code
    or a code object among its constants, stay."""
    from types import SimpleNamespace

    from pytest_megacache.dynamo import merge as dynamo_merge

    nested = SimpleNamespace(co_names=("__compiled_fn_3",), co_consts=())
    main = _Code(None, "m", [], [_Variant(b"g1", SimpleNamespace(co_names=("__compiled_fn_1", "__resume_at_2"),
                                                                 co_consts=(None, nested)))],
                 ["__compiled_fn_1", "__compiled_fn_3", "__compiled_fn_left"], {}, False)
    resume = _Code(None, "m", ["__resume_at_2"], [_Variant(b"r1", SimpleNamespace(co_names=("__compiled_fn_2",)))],
                   ["__compiled_fn_2", "__compiled_fn_1"], {}, False)
    gone = _Code(None, "m", [], [], ["__compiled_fn_9"], {}, False)
    pruned = dynamo_merge._pruned(_Entry([main, resume, gone]))
    assert [code.backend_ids for code in pruned.codes] == [["__compiled_fn_1", "__compiled_fn_3"],
                                                           ["__compiled_fn_2", "__compiled_fn_1"], []]
    assert main.backend_ids[-1] == "__compiled_fn_left"  # a copy: what torch holds is not changed
    unknown = _Entry([_Code(None, "m", [], [_Variant(b"g1", "no code")], ["__compiled_fn_1"], {}, False)])
    assert dynamo_merge._pruned(unknown) is unknown


def test_a_merged_entry_keeps_only_the_resume_functions_a_kept_variant_calls() -> None:
    """A resume function is made anew, under a new name, wherever its function's frame is traced; where that frame
    is not stored (an optimizer's identity guard), the resume functions of its trace are called by no stored variant:
    kept, the entry took one more at every run and was uploaded again each time (a training step's, 70 KB a run).
    The resume functions a kept variant calls stay, and those they call in turn; so do codes that are not resume
    functions."""
    from types import SimpleNamespace

    from pytest_megacache.dynamo import merge as dynamo_merge

    def resume(name: str, calls: tuple[str, ...] = ()) -> _Code:
        return _Code(SimpleNamespace(co_name="torch_dynamo_resume_in_step_at_110"), "m", [name],
                     [_Variant(name.encode(), SimpleNamespace(co_names=calls, co_consts=()))], [], {}, False)

    main = _Code(SimpleNamespace(co_name="step"), "m", ["step"],
                 [_Variant(b"main", SimpleNamespace(co_names=("__resume_at_154_8",), co_consts=()))], [], {}, False)
    called, chained = resume("__resume_at_154_8", ("__resume_at_198_18",)), resume("__resume_at_198_18")
    orphan, other = resume("__resume_at_154_27"), _Code(SimpleNamespace(co_name="helper"), "m", ["helper"], [], [],
                                                        {}, False)
    pruned = dynamo_merge._pruned(_Entry([main, orphan, called, other, chained]))
    assert [code.function_names for code in pruned.codes] == [["step"], ["__resume_at_154_8"], ["helper"],
                                                             ["__resume_at_198_18"]]
    unstored = _Code(SimpleNamespace(co_name="step"), "m", ["step"], [], [], {}, False)  # its frame refused here
    assert [code.function_names for code in dynamo_merge._pruned(_Entry([unstored, orphan])).codes] == [["step"]]
    # a kept resume function keeps only the names a variant calls it by: each trace of a frame refused here named it
    # anew, and merged, the entry took one more name at every run
    renamed = _Code(called.python_code, "m", ["__resume_at_154_8", "__resume_at_154_31", "__resume_at_154_47"],
                    called.guarded_codes, [], {}, False)
    assert [code.function_names for code in dynamo_merge._pruned(_Entry([main, renamed])).codes] == [
        ["step"], ["__resume_at_154_8"]]


def test_what_a_package_recorded_is_kept_without_the_stored_variants_and_without_the_package() -> None:
    """Each wrapper of a function unpickles the stored entry anew (its package holds a copy of every stored variant):
    what the merge keeps of each package is the variants the stored entry lacks, and the package itself is not kept
    alive for it (a number of its own tells packages apart)."""
    import gc
    import weakref

    from pytest_megacache.dynamo import merge as dynamo_merge

    loaded = _Entry([_Code(None, "m", [], [_Variant(b"g1", "a"), _Variant(b"g2", "b")], [], {}, False)])
    latest = _Entry([_Code(None, "m", [], [_Variant(b"g1", "a"), _Variant(b"g2", "b"), _Variant(b"g3", "c")], [], {},
                           False)])
    assert [v.guards_state for v in dynamo_merge._new_only(latest, loaded).codes[0].guarded_codes] == [b"g3"]
    assert dynamo_merge._new_only(latest, None) is latest
    class Package:
        pass

    one, two = Package(), Package()
    assert dynamo_merge._serial(one) == dynamo_merge._serial(one) != dynamo_merge._serial(two)
    gone = weakref.ref(one)
    del one
    gc.collect()
    assert gone() is None

# --- stored variants offered where Dynamo is about to trace ----------------------------------------------------------
class _Guards:
    def __init__(self, holds: bool) -> None:
        self.holds = holds

    def check(self, f_locals: dict[str, Any]) -> bool:
        return self.holds and f_locals["x"] == 1


def _offer(context: str, outcome: Any) -> Any:
    from pytest_megacache.dynamo.offers import Offer

    return Offer(None, None, outcome, {}, [], context, None, str(id(outcome)))


def _build(offer: Any) -> Any:
    if isinstance(offer.stored, Exception):
        raise offer.stored
    return offer.stored


def test_an_offer_is_taken_only_under_its_context_with_its_proofs_and_guards() -> None:
    from pytest_megacache.dynamo.offers import take

    failing, other, unproven, holding = (_offer("A", _Guards(False)), _offer("B", _Guards(True)),
                                         _offer("A", dp.Refused("global_changed", "rebound")), _offer("A", _Guards(True)))
    found, refusal = take([failing, other, unproven, holding], "A", {"x": 1}, _build)
    assert found is not None and found[0] is holding and found[1] is holding.stored and refusal is None
    assert failing.prepared.manager is failing.stored and holding.prepared.manager is None  # kept unless handed to Dynamo
    # nothing holds: why, per frame: a failed proof first, another context only where no offer of this one exists
    assert take([other, unproven, failing], "A", {"x": 1}, _build) == (None, ("global_changed", "global_changed: rebound"))
    assert take([other], "A", {"x": 1}, _build)[1] == (
        "context_changed", "compiled under another backend, mode or configuration")
    for order in ([other, failing], [failing, other]):  # a new variant: traced as torch would, in either order
        assert take(order, "A", {"x": 1}, _build) == (None, None)
    assert take([holding], None, {"x": 1}, _build)[0] is None  # a compile of a backend that cannot be named
    assert take([_offer("A", RuntimeError("torch"))], "A", {"x": 1}, _build)[1] == ("torch_error", "RuntimeError: torch")


def test_offers_are_kept_per_code_once_per_variant_and_dropped_with_their_package() -> None:
    from pytest_megacache.dynamo.offers import Offer, Offers

    code, package, later = (lambda x: x).__code__, object(), object()
    offers = Offers()
    # a variant is the digest of its stored guards, which hold its context
    first = Offer(code, None, None, {}, [], "A", package, dp.guards_digest(b"A guards"))
    offers.add(first)
    again = Offer(code, None, None, {}, [], "A", later, dp.guards_digest(b"A guards"))  # installed by another wrapper
    offers.add(again)
    offers.add(Offer(code, None, None, {}, [], "B", package, dp.guards_digest(b"B guards")))
    assert len(offers) == 2 and offers.of(code)[-1] is again and offers.of((lambda y: y).__code__) == []
    offers.drop_package(package)
    assert offers.of(code) == [again]


def test_a_variant_installed_again_keeps_what_was_made_ready_for_it_until_its_guards_are_handed_over() -> None:
    """Every new wrapper of a function installs its entry again (a suite makes one per test): the variant's guard
    state, and guards built that failed on the frames so far, serve the new install's offer; guards that held went to
    Dynamo and are built again. Another module's globals or another code object is another variant."""
    from pytest_megacache.dynamo.offers import Offer, Offers, take

    code, scope, other_scope = (lambda x: x).__code__, {}, {}
    digest = dp.guards_digest(b"A guards")
    offers = Offers()
    first = Offer(code, None, None, scope, [], "A", object(), digest)
    offers.add(first)
    first.prepared.guards_state, first.prepared.manager = "state", _Guards(False)
    again = Offer(code, None, None, scope, [], "A", object(), digest)
    offers.add(again)
    assert (again.prepared.guards_state, again.prepared.manager) == ("state", first.prepared.manager)
    builds: list[Any] = []

    def build(offer: Any) -> Any:
        if offer.prepared.manager is not None:
            return offer.prepared.manager
        builds.append(offer)
        return _Guards(True)

    assert take([again], "A", {"x": 1}, build)[0] is None and builds == []  # the kept guards fail: nothing built
    again.prepared.manager = None  # as after guards handed to Dynamo
    third = Offer(code, None, None, scope, [], "A", object(), digest)
    offers.add(third)
    found, _ = take([third], "A", {"x": 1}, build)
    assert found is not None and builds == [third] and third.prepared.guards_state == "state" and first.prepared.manager is None
    for elsewhere in (Offer(code, None, None, other_scope, [], "A", object(), digest),
                      Offer((lambda y: y).__code__, None, None, scope, [], "A", object(), digest)):
        offers.add(elsewhere)
        assert elsewhere.prepared.guards_state is None and elsewhere.prepared.manager is None


def test_the_compile_context_names_the_backend_and_sorts_what_hashing_orders() -> None:
    from pytest_megacache.dynamo import context as dc

    assert dc.canonical({"b", "a"}) == dc.canonical({"a", "b"}) == "{'a','b'}"
    assert dc.canonical({"k": frozenset({2, 1}), "j": [1, (2,)]}) == "{'j':list[1,tuple[2]],'k':{1,2}}"

    class _TorchCompileInductorWrapper:  # torch.compile's own wrapper, as torch names it
        def __init__(self, config: dict[str, Any], dynamic: bool | None) -> None:
            self.config, self.dynamic, self.name = config, dynamic, "inductor"

    plain, autotuned = _TorchCompileInductorWrapper({}, None), _TorchCompileInductorWrapper({"max_autotune": True}, None)
    assert dc.describe_backend(plain) != dc.describe_backend(autotuned) and dc.describe_backend(plain) is not None
    assert dc.describe_backend(lambda gm, inputs: gm) is None  # a test's own backend cannot be named
    assert dc.describe_backend(object()) is None
    wrapped = types.SimpleNamespace(_torchdynamo_orig_backend=types.SimpleNamespace(_torchdynamo_orig_backend=plain))
    assert dc.innermost_backend(wrapped) is plain
    assert dc.compile_context(wrapped, False, False) != dc.compile_context(wrapped, True, False)
    assert dc.compile_context(lambda gm, inputs: gm, False, False) is None


def test_by_default_only_torchs_own_backends_have_a_compile_context() -> None:
    """Reuse on by default covers torch's own backends: a function of a suite's own that can be named (a module-level
    function recording what it is given) has a context only where reuse was asked for, since a frame taken from the
    store never calls it."""
    from pytest_megacache.dynamo import context as dc

    class _TorchCompileInductorWrapper:
        def __init__(self) -> None:
            self.config, self.dynamic, self.name = {}, None, "inductor"

    class _TorchCompileWrapper:
        def __init__(self, compiler_fn: Any) -> None:
            self.compiler_fn, self.compiler_name, self.kwargs = compiler_fn, "fn", {}

    suites_own = _function("def recording(gm, inputs):\n    return gm\n", name="recording", module="tests.backends")
    torchs = _function("def eager(gm, inputs):\n    return gm\n", name="eager", module="torch._dynamo.backends.debugging")
    for backend, own in ((_TorchCompileInductorWrapper(), True), (_TorchCompileWrapper(torchs), True), (torchs, True),
                         (_TorchCompileWrapper(suites_own), False), (suites_own, False)):
        described = dc.describe_backend(backend)
        assert described is not None and dc.torch_own(described) is own, (backend, described)
        assert dc.compile_context(backend, False, False) is not None  # asked for: any backend that can be named
        assert (dc.compile_context(backend, False, False, any_backend=False) is not None) is own
    assert dc.torch_own(["function", "torchvision.ops", "f", "digest"]) is False
    # explain's recorder, made anew for each explanation (a closure): torch's own, described as itself
    recorder = _function("def inner():\n    def dynamo_graph_accumulating_compiler(gm, inputs):\n        return gm\n"
                         "    return dynamo_graph_accumulating_compiler\n", name="inner",
                         module="torch._dynamo.eval_frame")()
    recorder.__qualname__ = "explain.<locals>.inner.<locals>.dynamo_graph_accumulating_compiler"
    assert dc.describe_backend(recorder) == ["explain"] and dc.explain_recorder(recorder)
    assert dc.compile_context(recorder, False, False, any_backend=False) is not None
    assert dc.compile_context(recorder, False, False) != dc.compile_context(torchs, False, False)
    recorder.__qualname__ = "explain.<locals>.inner.<locals>.another"
    assert dc.describe_backend(recorder) is None


def _fake_pgo() -> types.SimpleNamespace:
    """torch's ``_dynamo.pgo`` as far as the shape notes use it (its entry's fields and markers, its code ids and its
    process-wide code state)."""
    import collections
    import enum

    class AutoDynamic(enum.Enum):
        token = 0

    class AutoUnset(enum.Enum):
        token = 0

    @dataclasses.dataclass(frozen=True)
    class InferStride:
        dim: int

    @dataclasses.dataclass
    class FrameStateSizeEntry:
        scalar: Any = AutoUnset.token
        size: Any = AutoUnset.token
        stride: Any = AutoUnset.token

        def __ior__(self, other: Any) -> Any:
            if self.size is AutoUnset.token:
                self.size = other.size
            elif self.size != other.size:
                self.size = tuple(a if a == b else AutoDynamic.token for a, b in zip(self.size, other.size, strict=True))
            self.stride = other.stride
            return self

    @dataclasses.dataclass(frozen=True)
    class CodeId:
        filename: str
        firstlineno: int
        name: str
        file_hash: str
        closure_hash: int | None = None

        @staticmethod
        def make(code: Any, closure: Any = None) -> Any:
            return CodeId(code.co_filename, code.co_firstlineno, code.co_name, "content", hash(closure) if closure else None)

    @dataclasses.dataclass
    class CodeState:
        automatic_dynamic: Any = dataclasses.field(default_factory=lambda: collections.defaultdict(FrameStateSizeEntry))

    state: Any = collections.defaultdict(CodeState)
    return types.SimpleNamespace(auto_dynamic=AutoDynamic.token, auto_unset=AutoUnset.token, InferStride=InferStride,
                                 FrameStateSizeEntry=FrameStateSizeEntry, CodeId=CodeId, get_code_state=lambda: state)


def test_the_shapes_a_trace_noted_are_stored_as_plain_data_and_noted_again_where_they_held() -> None:
    """What a trace noted of its inputs' shapes (torch's automatic dynamic shapes) is stored with what the record
    held before, read back only in its own form, and noted again only where the record holds what it held where the
    variant was traced: there Dynamo would trace the same variant; elsewhere (a size seen since) it would trace another
    one, so the stored variant does not fit."""
    from pytest_megacache.dynamo import shapes as ds

    pgo = _fake_pgo()
    code = _function("def f(x):\n    return x\n").__code__
    entry = pgo.FrameStateSizeEntry(scalar=pgo.auto_dynamic, size=(4,), stride=(pgo.InferStride(0),))
    encoded = ds.encode_entry(entry, pgo)
    assert encoded == {"scalar": "auto_dynamic", "size": [4], "stride": [{"infer": 0}]}
    stored = [[ds.FRAME, "L['x']", encoded, None]]
    notes = dp.unpack_guards(dp.pack_guards([], "ctx", b"state", effects={"shapes": stored})).effects.shapes
    assert notes == ((ds.FRAME, "L['x']", encoded, None),)
    [(key, name, rebuilt)] = ds.notes_of(notes, code, None, pgo)
    assert key == pgo.CodeId.make(code) and name == "L['x']" and rebuilt == entry
    assert ds.fits(notes, code, None, pgo)  # nothing noted yet: as where it was traced
    ds.note_again(ds.notes_of(notes, code, None, pgo), pgo, types.SimpleNamespace(automatic_dynamic_shapes=True))
    assert pgo.get_code_state()[key].automatic_dynamic["L['x']"].size == (4,)
    assert not ds.fits(notes, code, None, pgo)  # noted since: Dynamo would mark what differs dynamic
    after = ((ds.FRAME, "L['x']", ds.encode_entry(pgo.FrameStateSizeEntry(size=(6,)), pgo),
              ds.encode_entry(pgo.get_code_state()[key].automatic_dynamic["L['x']"], pgo)),)
    assert ds.fits(after, code, None, pgo)  # the variant traced after that record: it fits now
    scalar = pgo.FrameStateSizeEntry(scalar=2.5, size=pgo.auto_dynamic, stride=pgo.auto_dynamic)  # a float input
    assert ds.notes_of(((ds.FRAME, "L['k']", ds.encode_entry(scalar, pgo), None),), code, None, pgo)[0][2] == scalar
    for malformed in ([["elsewhere", "x", {}, None]], [[ds.FRAME, "x", {}]], [[ds.FRAME, 3, {}, None]], {"x": 1},
                      [[["file", "1", "f", "h"], "x", {}, None]]):
        with pytest.raises(dp.Refused):
            ds.read_shapes(malformed)
    with pytest.raises(dp.Refused):  # a note of another form than this torch's entry
        ds.notes_of(((ds.FRAME, "x", {"scalar": 1}, None),), code, None, pgo)
    with pytest.raises(dp.Refused):
        ds.notes_of(((ds.FRAME, "x", {**encoded, "size": [[1]]}, None),), code, None, pgo)
    with pytest.raises(ValueError):
        ds.encode_entry(pgo.FrameStateSizeEntry(size=(object(),)), pgo)


def test_an_offer_that_holds_where_torch_would_trace_another_variant_is_not_taken() -> None:
    from pytest_megacache.dynamo.offers import take

    dynamic, static = _offer("A", _Guards(True)), _offer("A", _Guards(True))
    found, refusal = take([dynamic, static], "A", {"x": 1}, _build, fits=lambda offer: offer is static)
    assert found is not None and found[0] is static and refusal is None
    assert dynamic.prepared.manager is dynamic.stored  # built, kept for a later frame
    found, refusal = take([dynamic], "A", {"x": 1}, _build, fits=lambda offer: False)
    assert found is None and refusal is not None and refusal[0] == "shapes_seen"


class _Scaling:
    def __init__(self, k: Any) -> None:
        self.k = k

    def __call__(self, func: Any) -> Any:
        @functools.wraps(func)
        def wrapper(x: Any) -> Any:
            return func(x) * self.k

        return wrapper


def _base(x: Any) -> Any:
    return x + 1


def test_a_closure_holding_an_instance_is_described_by_its_class_and_plain_state() -> None:
    from pytest_megacache.dynamo.objects import describe

    two, again, four = _Scaling(2)(_base), _Scaling(2)(_base), _Scaling(4)(_base)
    assert describe(two) is not None and describe(two) == describe(again) and describe(two) != describe(four)
    assert describe(_Scaling(object())(_base)) is None  # state that is not plain values: no stable description
    assert describe(_Scaling([1])(_base)) is None


def test_what_torch_records_of_an_inlined_function_is_read_once_per_code_object() -> None:
    reads: list[Any] = []

    @dataclasses.dataclass
    class SourceInfo:  # torch's, as its package module defines it: one entry per inlined function's source
        inlined_sources: set[tuple[str, int]]

        def add_code(self, code: types.CodeType) -> None:
            reads.append(code)
            if code.co_name == "mismatched":
                raise AssertionError("Source mismatch")
            self.inlined_sources.add((code.co_name, code.co_firstlineno))

    package = types.SimpleNamespace(SourceInfo=SourceInfo)
    dynamo_repairs.inlined_sources_once(package)
    first, second = SourceInfo(set()), SourceInfo(set())
    first.add_code(_base.__code__)
    second.add_code(_base.__code__)
    second.add_code(_Scaling.__call__.__code__)
    assert reads == [_base.__code__, _Scaling.__call__.__code__]  # read once, recorded in each package
    assert first.inlined_sources == {("_base", _base.__code__.co_firstlineno)}
    assert len(second.inlined_sources) == 2

    def mismatched() -> None:
        pass

    for _ in range(2):  # torch's own failure, every time: nothing is kept of it
        with pytest.raises(AssertionError, match="mismatch"):
            first.add_code(mismatched.__code__)
    assert reads[-2:] == [mismatched.__code__] * 2


def test_the_module_texts_of_stored_entries_are_held_once() -> None:
    """Each stored entry torch reads unpickles its own copy of every inlined module's text: equal texts read by later
    entries are the copy read first; what differs (another module, another version of one) stays as read."""

    @dataclasses.dataclass(frozen=True)
    class InlinedSource:  # torch's
        module: str
        firstlineno: int
        content: str

    def entry(*sources: InlinedSource) -> Any:
        return types.SimpleNamespace(dynamo=types.SimpleNamespace(source_info=types.SimpleNamespace(
            inlined_sources=set(sources))))

    text = "def f():\n    return 1\n" * 1000
    entries = {"a": entry(InlinedSource("lib", 1, "".join(list(text))), InlinedSource("other", 1, "x = 1\n")),
               "b": entry(InlinedSource("lib", 7, "".join(list(text))), InlinedSource("lib2", 1, "".join(list(text)))),
               "c": entry(InlinedSource("lib", 1, text + "# changed\n"))}
    cache = types.SimpleNamespace(read=lambda path: entries[path])
    dynamo_repairs.inlined_sources_shared(cache)
    a, b, c = ({(s.module, s.firstlineno): s.content for s in cache.read(k).dynamo.source_info.inlined_sources}
               for k in "abc")
    assert a[("lib", 1)] is b[("lib", 7)] and a[("lib", 1)] == text
    assert b[("lib2", 1)] == text and b[("lib2", 1)] is not a[("lib", 1)]  # another module: kept apart
    assert c[("lib", 1)] == text + "# changed\n" and a[("other", 1)] == "x = 1\n"
    odd = types.SimpleNamespace(dynamo=types.SimpleNamespace(source_info=types.SimpleNamespace(inlined_sources=[1])))
    entries["d"] = odd
    assert cache.read("d") is odd and odd.dynamo.source_info.inlined_sources == [1]  # another layout: as read


def test_an_entry_is_written_without_the_module_texts_torch_never_reads() -> None:
    """What is written keeps each inlined function's module, lines and checksum (what torch checks where it loads the
    entry) and leaves the module's whole text out; torch's own objects are left as they are."""
    @dataclasses.dataclass(frozen=True)
    class InlinedSource:  # torch's, and its SourceInfo, PrecompileCacheEntry and _DynamoCacheEntry below
        module: str
        firstlineno: int
        lastlineno: int
        checksum: str
        content: str

    @dataclasses.dataclass
    class SourceInfo:
        inlined_sources: set[Any]

    text = "def f():\n    return 1\n"
    sources = {InlinedSource("lib", 1, 2, "sum-a", text), InlinedSource("lib", 5, 9, "sum-b", text)}

    @dataclasses.dataclass
    class Entry:
        dynamo: Any
        backends: dict[str, Any]

    @dataclasses.dataclass
    class Dynamo:
        source_info: Any
        codes: list[Any]

    dynamo = Dynamo(SourceInfo(set(sources)), [])
    entry = Entry(dynamo, {"b": 1})
    written = dynamo_repairs.module_texts_left_out(entry)
    assert {(s.module, s.firstlineno, s.lastlineno, s.checksum, s.content)
            for s in written.dynamo.source_info.inlined_sources} == {("lib", 1, 2, "sum-a", ""), ("lib", 5, 9, "sum-b", "")}
    assert written.backends == {"b": 1} and entry.dynamo.source_info.inlined_sources == sources  # torch's: untouched
    odd = types.SimpleNamespace(dynamo=types.SimpleNamespace(source_info=types.SimpleNamespace(inlined_sources=[1])))
    assert dynamo_repairs.module_texts_left_out(odd) is odd  # another layout: as torch made it


def test_a_source_pickled_with_its_derived_fields_is_built_again_from_them() -> None:
    import pickle

    @dataclasses.dataclass(frozen=True)
    class Defaults:  # torch 2.11's DefaultsSource, as its reduce pickles it: every field, the derived ones too
        base: str
        idx_key: int | str
        is_kw: bool = False
        field: str = dataclasses.field(init=False, repr=False, compare=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "field", "__kwdefaults__" if self.is_kw else "__defaults__")

        def __reduce__(self) -> Any:
            return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    globals()["_Defaults"] = Defaults  # picklable by name
    Defaults.__qualname__ = "_Defaults"
    try:
        stored = pickle.dumps(Defaults("fn", 1))
        with pytest.raises(TypeError, match="positional"):
            pickle.loads(stored)
        dynamo_repairs._constructor_takes_derived(Defaults)
        assert pickle.loads(stored) == Defaults("fn", 1) and pickle.loads(stored).field == "__defaults__"
        assert Defaults("fn", "k", True).field == "__kwdefaults__"  # the constructor's own calls as before
        with pytest.raises(TypeError, match="not the value derived"):
            Defaults("fn", 1, False, "__kwdefaults__")
        with pytest.raises(TypeError):
            Defaults("fn", 1, False, "__defaults__", "more")
    finally:
        del globals()["_Defaults"]


def test_a_variants_builtins_dict_is_put_in_place_when_offered_and_its_number_never_picked_again() -> None:
    import itertools

    builtins_dict: dict[str, Any] = {"len": len}
    counter = types.SimpleNamespace(_unique_id_counter=itertools.count(3))  # torch's per-process numbering
    stored = types.SimpleNamespace(output_graph=types.SimpleNamespace(
        name_of_builtins_dict_key_in_fglobals="__builtins_dict___41"))
    scope: dict[str, Any] = {"__builtins__": builtins_dict}
    loaded = dynamo_offers.guards_of(lambda data: stored, lambda s: s["__builtins__"], counter, b"pickle", scope)
    assert loaded is stored and scope["__builtins_dict___41"] is builtins_dict
    assert next(counter._unique_id_counter) == 42  # a frame traced next names its globals after it
    counter._unique_id_counter = itertools.count(100)
    dynamo_offers.guards_of(lambda data: stored, lambda s: s["__builtins__"], counter, b"pickle", scope)
    assert next(counter._unique_id_counter) == 100  # never moved back
    scope["__builtins_dict___41"] = {"len": None}
    with pytest.raises(dp.Refused, match="not the builtins dict"):
        dynamo_offers.guards_of(lambda data: stored, lambda s: s["__builtins__"], counter, b"pickle", scope)


def test_only_the_variants_calling_a_missing_backend_are_left_out_of_what_is_written() -> None:
    @dataclasses.dataclass
    class Code:  # torch's serialized code object: the names it loads, its constants
        co_names: tuple[str, ...]
        co_consts: tuple[Any, ...] = ()

    @dataclasses.dataclass
    class Variant:
        guards_state: bytes
        dynamo_code: Code

    @dataclasses.dataclass
    class CodeEntry:
        guarded_codes: list[Variant]
        backend_ids: list[str]
        bypassed: bool = False
        python_code: str = "the frame's code"

    @dataclasses.dataclass
    class Entry:
        codes: list[CodeEntry]

    nested = Code(("__compiled_fn_3",))
    complete, backendless, inner = (Variant(b"a", Code(("__compiled_fn_1", "torch"))),
                                    Variant(b"b", Code(("__compiled_fn_2",))), Variant(b"c", Code(("x",), (nested,))))
    main = CodeEntry([complete, backendless, inner], ["__compiled_fn_1", "__compiled_fn_2", "__compiled_fn_3"])
    alone = CodeEntry([backendless], ["__compiled_fn_2"], python_code="another frame's code")
    entry = Entry([main, alone])
    counted: list[int] = []
    named: list[str] = []

    def dropped(code: str, count: int) -> None:
        named.append(code)
        counted.append(count)

    kept = dynamo_repairs._without_backendless(entry, {"__compiled_fn_1": object()}, dropped)
    assert named == ["the frame's code", "another frame's code"]  # each frame whose variants are left out is named
    assert kept.codes[0].guarded_codes == [complete] and kept.codes[0].backend_ids == ["__compiled_fn_1"]
    assert counted == [2, 1]  # each variant left out is counted, those of a code torch then bypasses too
    # nothing left of it: bypassed, as torch would, and written without the variants (stable from run to run)
    assert kept.codes[1].bypassed and kept.codes[1].guarded_codes == [] and kept.codes[1].backend_ids == []
    assert alone.guarded_codes == [backendless] and not alone.bypassed
    assert main.guarded_codes == [complete, backendless, inner]  # what the process recorded is left as it was
    every = {f"__compiled_fn_{i}": 0 for i in (1, 2, 3)}
    assert dynamo_repairs._without_backendless(entry, every, dropped) is entry
    assert counted == [2, 1] and len(named) == 2  # nothing left out, nothing counted or named


def test_a_warning_shown_while_the_backend_compiles_the_graph_is_not_the_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    monkeypatch.setattr(warnings, "_showwarnmsg", warnings._showwarnmsg)  # type: ignore[attr-defined]
    trace = dynamo_effects.Trace({})
    state = types.SimpleNamespace(traces={"3/0": trace})

    class OutputGraph:  # torch's: Dynamo hands the traced graph to the backend (Inductor) here
        def call_user_compiler(self) -> str:
            warnings.warn("shown while Inductor generates code", UserWarning, stacklevel=1)
            return "compiled"

    dynamo_effects.watch_warnings(state, lambda: "3/0", OutputGraph)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert OutputGraph().call_user_compiler() == "compiled"
        assert trace.shown == []  # torch's caches skip it where the graph is loaded, traced or not
        warnings.warn("shown while Dynamo traces", UserWarning, stacklevel=1)
    assert trace.shown is not None and [w.message for w in trace.shown] == ["shown while Dynamo traces"]


def test_a_frame_its_own_test_passes_over_two_runs_running_stores_nothing_new() -> None:
    """A frame traced in place of a variant of its own test (a proof refused it, or its guards failed): what it
    traces is stored marked as such, beside the variant passed over; where the variant passed over was itself so
    marked (passed over two runs running: what it guards on is made anew every run), what is stored stays as it is
    and the trace is not written (the store would change at every run), never for another test's variant."""
    from pytest_megacache.dynamo.offers import NEW, REPLACES, UNSTABLE, Offer, superseded, take

    def offer(test: str, retraced: bool) -> Any:
        return Offer(None, None, b"", {}, [], "ctx", None, f"{test}-{retraced}", (test, retraced))

    first, again, other, untagged = offer("t1", False), offer("t1", True), offer("t2", True), offer("", True)
    assert superseded([first], "t1") == REPLACES  # the first time: kept beside (another run may take it again)
    assert superseded([first, again, other], "t1") == UNSTABLE
    assert superseded([other, untagged], "t1") == NEW  # another test's, or one stored outside a test
    assert superseded([again], "") == NEW  # a frame traced outside a test
    calls: list[str] = []

    def build(o: Any) -> Any:
        calls.append(o.digest)
        if o is other:
            raise dp.Refused("local_changed", "another object")
        if o is untagged:
            raise AttributeError("torch's load of its guards failed")
        return types.SimpleNamespace(check=lambda f_locals: False)  # guards that fail on these inputs

    passed_over: list[Any] = []
    assert take([first, again, other, offer("t1", False)], "other context", {}, build, passed_over) == (
        None, ("context_changed", "compiled under another backend, mode or configuration"))
    assert calls == [] and passed_over == []  # another compile's variants are not passed over: never tried
    assert take([first, again, other, untagged], "ctx", {}, build, passed_over)[0] is None
    assert passed_over == [first, again, other, untagged]  # guards that failed, a proof that refused, a failed load


def test_resume_functions_count_only_where_the_function_they_resume_has_a_variant() -> None:
    """A resume function is entered only from a stored variant of the function it resumes: where that one has none,
    an entry holding only its resume functions' variants is not worth writing (each run traced them again)."""
    from pytest_megacache.dynamo.merge import enterable_codes

    def code(name: str, variants: int) -> Any:
        return types.SimpleNamespace(python_code=types.SimpleNamespace(co_name=name), guarded_codes=[0] * variants)

    main, resume, called = code("func", 0), code("torch_dynamo_resume_in_func_at_12", 3), code("helper", 1)
    assert enterable_codes([main, resume]) == [main]
    assert enterable_codes([main, resume, called]) == [main, called]  # a function of its own: taken where called
    traced = code("func", 1)
    assert enterable_codes([traced, resume]) == [traced, resume] and enterable_codes([]) == []


def test_only_a_variant_refused_for_a_changed_class_is_left_out_of_what_the_process_stores() -> None:
    from pytest_megacache.dynamo.offers import note_stale

    stale: set[str] = set()
    for reason in ("global_changed", "local_changed"):  # another object in this process: it may hold in the next
        note_stale(stale, _offer("A", None), dp.Refused(reason, "another object"))
    assert stale == set()
    edited = _offer("A", None)
    note_stale(stale, edited, dp.Refused("class_changed", "an edited method"))  # read from the source: refused again
    assert stale == {edited.digest}

    from pytest_megacache.dynamo.merge import left_out

    # what is written leaves out the stale and the superseded variants, but none taken in this process (a class one
    # test rebinds and another does not: the variant traced under the rebound class is taken where it holds)
    state = types.SimpleNamespace(stale={"edited", "rebound"}, superseded={"passed over", "taken later"},
                                  taken={"rebound", "taken later", "other"})
    assert left_out(state) == {"edited", "passed over"}


@dataclasses.dataclass(frozen=True)
class SerializedCode:  # torch's serialized code object, as much of it as the repair reads (pickled by reference)
    co_name: str
    co_consts: tuple[Any, ...]


def test_output_code_that_makes_a_function_pickles_its_modules_globals_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo loads the globals of a function it makes as a constant of its output code: written as the module's
    name, read as the globals of the module of that name, which the loading process must have imported."""
    made = types.ModuleType("megacache_made_here")
    monkeypatch.setitem(sys.modules, made.__name__, made)
    code = SerializedCode("f", (None, made.__dict__, SerializedCode("g", (json.__dict__, 1))))
    with pytest.raises(TypeError, match="module"):  # torch's own form: the entry is never written
        pickle.dumps(code)
    dynamo_repairs.module_globals_by_name(types.SimpleNamespace(SerializedCode=SerializedCode))
    try:
        data = pickle.dumps(code)
        loaded = pickle.loads(data)
        assert loaded.co_name == "f" and loaded.co_consts[0] is None and loaded.co_consts[1] is made.__dict__
        assert loaded.co_consts[2] == SerializedCode("g", (json.__dict__, 1))
        assert loaded.co_consts[2].co_consts[0] is json.__dict__
        # a dict that is not an imported module's globals under its name is pickled as the dict it is
        lookalike = {"__name__": "json", "x": 1}
        assert pickle.loads(pickle.dumps(SerializedCode("h", (lookalike,)))).co_consts[0] == lookalike
        plain = pickle.dumps(SerializedCode("p", (1, "a")))  # nothing to name: torch's own pickle
        assert b"pytest_megacache.dynamo.repairs" not in plain and b"pytest_megacache.dynamo.repairs" in data
        monkeypatch.delitem(sys.modules, made.__name__)
        with pytest.raises(ImportError, match="megacache_made_here is not imported"):  # nothing imported to load it
            pickle.loads(data)
    finally:
        del SerializedCode.__reduce_ex__  # type: ignore[attr-defined]


def test_entries_refused_while_torch_writes_them_count_in_the_sessions_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch writes Dynamo's entries after the session's counters were read: a refusal then (an entry that does not
    pickle) is folded into the figures the report shows, once, with the first detail of its reason."""
    from pytest_megacache.report.stats import TorchStats

    state = dr._Reuse("/")
    monkeypatch.setattr(dr, "_STATE", state)
    monkeypatch.setattr(state, "count", lambda name: None)  # torch's counters: read from torch below
    code = _function("def forward(x):\n    return x\n", "forward", "/m.py").__code__
    state.frame = code
    state.refuse("context_changed", "only another compile's variants")
    state.frame = None
    stats = TorchStats(counters={"dynamo_refused_unpicklable": 1, "fxgraph_cache_hit": 3},
                       dynamo_refusals={"side_effect": "a warning"}, dynamo_refused_frames=dr.refused_frames())
    state.refuse("unpicklable", "TypeError: cannot pickle 'module' object")
    state.refuse("side_effect", "another warning")
    state.traced_for("no_backend", code)  # its variant of this compile left out as torch writes it
    stats.saved({"dynamo_refused_unpicklable": 0, "fxgraph_cache_hit": 3},
                {"dynamo_refused_unpicklable": 2, "fxgraph_cache_hit": 5})
    assert stats.counters == {"dynamo_refused_unpicklable": 3, "fxgraph_cache_hit": 3}  # only Dynamo reuse's own
    assert stats.dynamo_refusals == {"side_effect": "a warning", "context_changed": "only another compile's variants",
                                     "unpicklable": "TypeError: cannot pickle 'module' object"}
    assert stats.dynamo_refused_frames == {"forward (m.py:1)": "no_backend, context_changed"}


def test_each_frame_left_traced_is_named_with_its_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report names each frame a refusal left traced, by its function and where it is defined (relative to the
    rootdir, or below the installed packages), with each reason once; an xdist worker's are folded in."""
    from pytest_megacache.report.stats import TorchStats

    state = dr._Reuse("/ci/repo")
    monkeypatch.setattr(dr, "_STATE", state)
    monkeypatch.setattr(state, "count", lambda name: None)
    state.refuse("torch_error", "outside any frame: nobody named")
    state.frame = _function("def forward(x):\n    return x\n", "forward", "/ci/repo/src/model.py").__code__
    for reason in ("unsupported_backend", "torch_error", "unsupported_backend"):
        state.refuse(reason, "detail")
    state.frame = _function("def conv(x):\n    return x\n", "conv", "/opt/venv/lib/python3.11/site-packages/lib/c.py").__code__
    state.traced_for("none stored")
    conv = state.frame
    state.frame = None  # a session's end: no frame is being traced; the variant of conv written without its backend
    state.traced_for("no_backend", conv)
    state.refuse("no_backend", "detail")
    assert dr.refused_frames() == {"forward (src/model.py:1)": "unsupported_backend, torch_error",
                                   "conv (lib/c.py:1)": "no_backend, none stored"}
    # Dynamo gives up on a frame named already (a graph break in a loop): said first; another error, or a frame not
    # named, leaves the names as they are
    unsupported = type("Unsupported", (Exception,), {"__module__": "torch._dynamo.exc"})
    skip = type("SkipFrame", (unsupported,), {"__module__": "torch._dynamo.exc"})
    dynamo_offers.skipped(state, conv, RuntimeError("the backend failed"))
    dynamo_offers.skipped(state, _function("def other(x):\n    return x\n", "other", "/ci/repo/o.py").__code__, skip())
    assert dr.refused_frames()["conv (lib/c.py:1)"] == "no_backend, none stored" and len(dr.refused_frames()) == 2
    dynamo_offers.skipped(state, conv, skip())
    assert dr.refused_frames()["conv (lib/c.py:1)"] == "skipped by torch, no_backend, none stored"
    stats = TorchStats(dynamo_refused_frames={"forward (src/model.py:1)": "torch_error"})
    stats.add({"dynamo_refused_frames": {"step (train.py:3)": "side_effect"}})
    assert stats.dynamo_refused_frames == {"forward (src/model.py:1)": "torch_error", "step (train.py:3)": "side_effect"}


def test_torch_failing_to_record_a_frames_code_is_told_apart_from_the_frames_own_errors() -> None:
    """torch's ``code_context`` raising its ``PackageError`` on entering (nothing traced yet) becomes the plugin's own
    exception, on which the frame is compiled again outside the entry; an error of the frame inside the context, and
    one torch raises on entering that is not a ``PackageError``, pass as they are."""
    import contextlib

    from pytest_megacache.dynamo import offers as dynamo_offers

    class PackageError(Exception):
        pass

    class CompilePackage:
        @contextlib.contextmanager
        def code_context(self, code: Any) -> Any:
            if code == "unnamed":
                raise PackageError("Cannot resolve a fully qualified name")
            if code == "other":
                raise KeyError(code)
            yield

    torch = types.SimpleNamespace(_dynamo=types.SimpleNamespace(package=types.SimpleNamespace(
        CompilePackage=CompilePackage), exc=types.SimpleNamespace(PackageError=PackageError)))
    dynamo_offers._code_context_named(torch)
    package = CompilePackage()
    with pytest.raises(dynamo_offers._Unpackaged, match="fully qualified") as raised:
        with package.code_context("unnamed"):
            pass
    assert isinstance(raised.value.__cause__, PackageError)
    with pytest.raises(KeyError):
        with package.code_context("other"):
            pass
    with pytest.raises(ValueError, match="the frame's own"):
        with package.code_context("named"):
            raise ValueError("the frame's own")


def test_a_graph_torch_dispatches_between_specializations_is_told_apart() -> None:
    """torch records the backend before the dispatcher between a shape's specialized graphs, and installs it bare."""
    from pytest_megacache.dynamo.backends import wrapped_after_backend

    def output_graph(specializations: list[str]) -> Any:
        shape_env = types.SimpleNamespace(specializations=specializations)
        return types.SimpleNamespace(tracing_context=types.SimpleNamespace(fake_mode=types.SimpleNamespace(
            shape_env=shape_env)))

    assert not wrapped_after_backend(output_graph([]))
    assert wrapped_after_backend(output_graph(["x.size(0) == 8"]))
    assert not wrapped_after_backend(types.SimpleNamespace())  # no shape environment: nothing to dispatch between


def test_the_numbering_moves_past_every_installed_name_whatever_numbers_its_prefix_holds() -> None:
    """A resume function is named ``__resume_at_<offset>_<n>``: the counter must move past n, not the offset (a frame
    traced later picked an installed name, and torch asserted: ``assert name not in scope``)."""
    import itertools

    counter = types.SimpleNamespace(_unique_id_counter=itertools.count(3))
    module = types.ModuleType("installed")
    for name in ("__resume_at_1302_1685", "__compiled_fn_12_0a1b2c3d_1234_4abc_8def_0123456789ab",
                 "__builtins_dict___103", "__import_torch_dot_nn"):
        setattr(module, name, None)
    dynamo_repairs.numbering_past(counter, [module])
    assert next(counter._unique_id_counter) == 1686


def test_torchs_warnings_about_caching_precompiles_bookkeeping_are_kept_from_the_session() -> None:
    """torch's "Backend not found" and "Detected a package bypass" warnings (a session without the plugin never turns
    caching precompile on, so never logs them) reach no handler; their loggers' other records do, as before."""
    import logging

    from pytest_megacache.dynamo import effects

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name}: {record.getMessage()}")

    loggers = [logging.getLogger(name) for name, _start in effects.BOOKKEEPING]
    handler = Keep()
    filters_before = [list(logger.filters) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        effects.bookkeeping_quiet()
        effects.bookkeeping_quiet()  # once per process: a second call adds nothing
        assert [len(logger.filters) - len(before) for logger, before in zip(loggers, filters_before, strict=True)] == [1, 1]
        package, output_graph = loggers
        package.warning("Backend not found")
        output_graph.warning("Detected a package bypass: %s", "a guard that cannot be serialized")
        package.warning("Backend not found for %s", "another start")  # the same start: dropped too
        package.warning("Failed to load package")  # another record of the same logger
        output_graph.warning("Backend not found")  # the other logger's message, not this one's
        assert seen == ["torch._dynamo.package: Failed to load package", "torch._dynamo.output_graph: Backend not found"]
    finally:
        for logger, before in zip(loggers, filters_before, strict=True):
            logger.removeHandler(handler)
            logger.filters[:] = before


def test_a_variant_keeps_what_its_trace_took_outside_its_identity() -> None:
    """What a variant's trace took travels with it (what a later run taking it is spared), and is no part of the
    variant: the same variant traced in two runs is one by digest (offers, the merge's sets), and a forged figure is
    read as none."""
    proofs = [{"path": [["global", "math"]], "is": ["module", "math"]}]
    timed = dp.pack_guards(proofs, "ctx", b"state", "tag", seconds=1.23456)
    again = dp.pack_guards(proofs, "ctx", b"state", "tag", seconds=7.5)
    plain = dp.pack_guards(proofs, "ctx", b"state", "tag")
    assert dp.unpack_guards(timed).seconds == 1.235 and dp.unpack_guards(again).seconds == 7.5
    assert dp.unpack_guards(plain).seconds == 0.0
    assert dp.guards_digest(timed) == dp.guards_digest(again) == dp.guards_digest(plain)
    assert dp.guards_digest(dp.pack_guards(proofs, "ctx", b"other", "tag", seconds=1.0)) != dp.guards_digest(plain)
    assert dp.unpack_guards(timed)[:5] == dp.unpack_guards(plain)[:5]
    # a key of that name inside the record (a counter, say) is part of the variant; the figure after it is not
    counted = {"counters": {"stats": {"seconds": 2}}}
    assert dp.guards_digest(dp.pack_guards(proofs, "ctx", b"state", "tag", effects=counted, seconds=3.0)) == (
        dp.guards_digest(dp.pack_guards(proofs, "ctx", b"state", "tag", effects=counted))) != dp.guards_digest(plain)
    magic = len(b"megacache-guards-5\n")
    for bad in (b"-1", b"1e300", b'"1"', b"true"):
        header = plain[magic + 8:-len(b"state")].replace(b'"test":"tag"', b'"test":"tag","seconds":' + bad)
        forged = b"megacache-guards-5\n" + len(header).to_bytes(8, "big") + header + b"state"
        assert dp.unpack_guards(forged).seconds == 0.0 and dp.unpack_guards(forged).proofs == proofs, bad
    assert dp.pack_guards(proofs, "ctx", b"state", seconds=float("nan")) == dp.pack_guards(proofs, "ctx", b"state")
    # and the seconds of its trace that its backend's compile did not take: after them, no part of the variant either
    traced = dp.pack_guards(proofs, "ctx", b"state", "tag", seconds=2.0, traced=0.5)
    assert (dp.unpack_guards(traced).seconds, dp.unpack_guards(traced).traced) == (2.0, 0.5)
    assert dp.guards_digest(traced) == dp.guards_digest(plain) and dp.unpack_guards(timed).traced == 0.0
    for seconds, part in ((1.0, 1.5), (1.0, -0.1), (None, 0.5), (1.0, float("inf"))):  # more than the whole, or alone
        assert dp.unpack_guards(dp.pack_guards(proofs, "ctx", b"state", seconds=seconds, traced=part)).traced == 0.0
    for bad in (b"-1", b"9", b'"1"', b"true"):  # more than the seconds (2.0) is read as none too
        header = traced[magic + 8:-len(b"state")].replace(b'"traced":0.5', b'"traced":' + bad)
        forged = b"megacache-guards-5\n" + len(header).to_bytes(8, "big") + header + b"state"
        assert dp.unpack_guards(forged).traced == 0.0 and dp.unpack_guards(forged).seconds == 2.0, bad


def test_a_trace_times_itself_without_its_backends_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace's own seconds are its time less what torch's backends compiled meanwhile (Dynamo's record of its
    calls of them); none where that record was cleared in between (a reset)."""
    effects = dynamo_effects
    record: dict[str, list[float]] = {"OutputGraph.call_user_compiler": [5.0]}
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.SimpleNamespace(compilation_time_metrics=record))
    trace = effects.Trace({})
    assert trace.compiled == 5.0
    time.sleep(0.05)
    record["OutputGraph.call_user_compiler"].append(0.04)
    elapsed = time.perf_counter() - trace.started
    own = trace.traced_seconds(elapsed)
    assert own is not None and 0.0 <= own <= elapsed - 0.04
    record["OutputGraph.call_user_compiler"].append(100.0)  # more than the trace's whole time: none of it its own
    assert trace.traced_seconds(time.perf_counter() - trace.started) == 0.0
    record.clear()
    assert trace.traced_seconds(time.perf_counter() - trace.started) is None and effects.backend_seconds() == 0.0


def test_a_frame_traced_while_its_stored_entry_waits_for_a_module_is_told_apart() -> None:
    """A stored entry that inlined a module a library makes at run time waits until the module is there; a frame of
    any of its codes traced before then is traced so in every run, and what it traces is not written (it differs from
    what the entry holds only by addresses in torch's guard state: written, the entry grew at every run)."""
    state = dr._Reuse("/")
    code = _function("def forward(x):\n    return x\n", name="forward", module="lib.layers").__code__
    state.waiting[("lib.layers", code.co_firstlineno, "forward")] = "lib.generated_kernels_not_there"
    assert state.waiting_for(code, {"__name__": "lib.layers"})
    assert not state.waiting_for(code, {"__name__": "other.module"})  # another module's code of that name and line
    state.waiting[("lib.layers", code.co_firstlineno, "forward")] = "json"  # the module is there now
    assert not state.waiting_for(code, {"__name__": "lib.layers"})


class _Artifact:
    """A stored backend as torch loads it: deserialized by ``after_deserialization()``."""

    def __init__(self, fails: bool = False) -> None:
        self.deserialized, self.fails = 0, fails

    def after_deserialization(self) -> Any:
        self.deserialized += 1
        if self.fails:
            raise RuntimeError("kernels did not load")
        return lambda x: x + 1


def _disabled(fn: Any) -> Any:
    """torch._dynamo.disable's wrapper as far as the stand-ins see it: the callable it wraps, under its attribute."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    wrapper._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    return wrapper


def test_an_entrys_backends_are_deserialized_only_where_a_variant_calling_them_is_taken() -> None:
    """torch's install deserializes each backend of an entry it installs (``after_deserialization``), every time a
    wrapper installs it; postponed, each is deserialized once, where the variant that calls it is taken (or where
    it is first called), and the time it takes is reuse's own cost."""
    from pytest_megacache.dynamo import backends, ledger

    taken, other = _Artifact(), _Artifact()
    handed = backends.postponed({"__compiled_fn_1": taken, "__compiled_fn_2": other, "odd": 3})
    assert handed["odd"] == 3 and backends.postponed(handed)["__compiled_fn_1"] is handed["__compiled_fn_1"]
    # torch's install: what after_deserialization() gives is installed, under torch._dynamo.disable
    scope = {name: _disabled(art.after_deserialization()) for name, art in handed.items() if name != "odd"}
    assert taken.deserialized == other.deserialized == 0
    code = compile("__compiled_fn_1(x)", "<variant>", "eval")
    spans, loading = len(ledger.LEDGER.spans), ledger.LEDGER.loading
    backends.made_ready(code, scope)
    backends.made_ready(code, scope)
    assert (taken.deserialized, other.deserialized) == (1, 0)
    assert len(ledger.LEDGER.spans) == spans + 1  # outside an offer: a span of its own
    # the deserialization within it counted apart too (a run without reuse loads the graph in its cache hit)
    start, end = ledger.LEDGER.spans[-1]
    assert 0 < ledger.LEDGER.loading - loading <= end - start
    assert scope["__compiled_fn_1"](1) == 2 and scope["__compiled_fn_2"](1) == 2  # the other: where first called
    assert (taken.deserialized, other.deserialized) == (1, 1)
    with ledger.LEDGER.offering():  # inside an offer: the offer's time, no span
        backends.made_ready(code, {"__compiled_fn_1": _disabled(backends.Deferred(_Artifact()))})
    assert len(ledger.LEDGER.spans) == spans + 2
    broken = {"__compiled_fn_1": _disabled(backends.postponed({"b": _Artifact(fails=True)})["b"].after_deserialization())}
    with pytest.raises(RuntimeError, match="kernels did not load"):  # the offer refuses it: the frame is traced
        backends.made_ready(code, broken)


class _Explained:
    """A graph of explain's recorder as installed (``eager.Explained``): handed to a recorder where taken."""

    def __init__(self, name: str) -> None:
        self.name, self.recorders = name, []

    def handed(self, recorder: Any) -> None:
        self.recorders.append(recorder)


class _ExplainedArtifact(_Artifact):
    def __init__(self, graph: Any) -> None:
        super().__init__()
        self.graph = graph

    def after_deserialization(self) -> Any:
        self.deserialized += 1
        return self.graph


def test_the_graphs_of_explains_recorder_a_variant_calls_are_given_in_the_order_it_calls_them() -> None:
    """Where an explanation takes a stored variant, the graphs of explain's recorder that its code calls are what
    :func:`made_ready` gives (for the offer to hand to that explanation's recorder), in the order of the code's
    names, each time it is made ready; a graph run with subclass dispatch off gives the one it wraps."""
    from pytest_megacache.dynamo import backends

    first, second = _Explained("first"), _Explained("second")

    def dispatch_off(*args: Any) -> Any:
        return args

    dispatch_off.explained = second  # type: ignore[attr-defined]
    handed = backends.postponed({"__compiled_fn_1": _ExplainedArtifact(first), "__compiled_fn_3": _ExplainedArtifact(
        dispatch_off), "__compiled_fn_5": _Artifact()})
    scope = {name: _disabled(art.after_deserialization()) for name, art in handed.items()}
    code = compile("__compiled_fn_1(x); __compiled_fn_5(x); __compiled_fn_3(x)", "<variant>", "exec")
    assert backends.made_ready(code, scope) == [first, second]
    assert backends.made_ready(code, scope) == [first, second]  # a second explanation takes it too
    assert backends.made_ready(compile("__compiled_fn_5(x)", "<variant>", "eval"), scope) == []
    assert backends.calls_graphs(code) and not backends.calls_graphs(compile("x + 1", "<variant>", "eval"))


def test_reuses_own_time_is_counted_once_where_an_offer_installs_an_entry() -> None:
    from pytest_megacache.dynamo.ledger import Ledger

    ledger = Ledger()
    with ledger.offering():
        with ledger.spending():  # a deferred entry installed by an offer
            pass
    assert ledger.spans == [] and ledger.offered > 0
    with ledger.spending():
        with ledger.spending():
            pass
    assert len(ledger.spans) == 1 and ledger.cost() == pytest.approx(ledger.offered + ledger.spans[0][1] - ledger.spans[0][0])


class _Pair(NamedTuple):  # a named tuple of a module: its __new__ reads a scope of its own
    first: int
    second: int


def test_a_named_tuples_scope_is_bound_again_as_its_class_names_it() -> None:
    """Dynamo installs the scope a named tuple's ``__new__`` was made in (``___unnamed_scope_<id>_c<n>``) where it
    inlines its construction, and guards ``tuple.__new__`` in it: the scope is found again through its class (by
    module and qualname) and ``tuple.__new__`` by its class's module; a dict of any other kind is not found."""
    from pytest_megacache.dynamo import proof_globals

    scope = vars(_Pair)["__new__"].__func__.__globals__
    assert scope["__name__"] == "namedtuple__Pair"
    name = "___unnamed_scope_140382748668544_c1"
    proof = proof_globals.prove_global(f"G['{name}']['_tuple_new']", [("global", name), ("key", "_tuple_new")],
                                       tuple.__new__, {name: scope})
    assert proof["is"] == ["builtin", "builtin_function_or_method", "builtins", "tuple.__new__"]
    assert proof["bind"][:2] == ["scope", "class"] and dp.find(proof["bind"]) is scope
    later: dict[str, Any] = {}  # a later process: the global is bound again to the scope of the class found
    dp.check_proofs([proof], later, bind=later.__setitem__)
    assert later[name] is scope
    forged = {"__name__": "namedtuple__Pair", "_tuple_new": tuple.__new__, "__builtins__": {}}
    with pytest.raises(dp.Refused):
        proof_globals.prove_global(f"G['{name}']['_tuple_new']", [("global", name), ("key", "_tuple_new")],
                                   tuple.__new__, {name: forged})


def test_an_entrys_variants_that_need_a_module_not_there_are_held_back() -> None:
    """A stored entry whose variants inlined a module a library generates at run time: where that module is not
    there yet, the variants that need it (and one that did not record what it needs) are held back with the
    module's sources and imports; the others are installed at once, torch checking their sources."""
    from pytest_megacache.dynamo import installing

    @dataclasses.dataclass(frozen=True)
    class Source:
        module: str

    @dataclasses.dataclass
    class Info:
        inlined_sources: set[Source]

    @dataclasses.dataclass
    class Code:
        guarded_codes: list[Any]
        import_sources: dict[str, str]
        backend_ids: list[str] = dataclasses.field(default_factory=lambda: ["__compiled_fn_1"])
        function_names: list[str] = dataclasses.field(default_factory=list)
        python_module: str = "lib"
        python_code: Any = dataclasses.field(default_factory=lambda: types.SimpleNamespace(co_firstlineno=3, co_name="forward"))
        bypassed: bool = False

    @dataclasses.dataclass
    class Entry:
        codes: list[Code]
        source_info: Info

    def variant(modules: list[str] | None) -> Any:
        return types.SimpleNamespace(guards_state=dp.pack_guards([], "ctx", b"state", modules=modules))

    ours, theirs, unknown = variant(["math", "json"]), variant(["math", "not_generated_yet_xyz"]), variant(None)
    entry = Entry([Code([ours, theirs, unknown], {"gen": "not_generated_yet_xyz", "m": "math"})],
                  Info({Source("math"), Source("not_generated_yet_xyz")}))
    held, missing = installing.without_missing(entry)
    assert missing == "not_generated_yet_xyz"
    assert held.codes[0].guarded_codes == [ours] and held.codes[0].import_sources == {"m": "math"}
    assert held.source_info.inlined_sources == {Source("math")}
    assert entry.codes[0].guarded_codes == [ours, theirs, unknown]  # what was stored is kept whole (written)
    # torch adds what this process traces to the installed codes' lists in place: to the copy's, not the stored entry's
    installed = installing.with_own_lists(held)
    assert installed == held
    installed.codes[0].guarded_codes.append(unknown)
    installed.codes[0].backend_ids.append("__compiled_fn_2")
    installed.codes[0].function_names.append("__resume_at_4_2")
    installed.codes[0].import_sources["gen"] = "not_generated_yet_xyz"
    assert held.codes[0] == entry.codes[0].__class__([ours], {"m": "math"})
    assert (entry.codes[0].backend_ids, entry.codes[0].function_names) == (["__compiled_fn_1"], [])
    whole = Entry([Code([ours, unknown], {})], Info({Source("math")}))
    assert installing.without_missing(whole) == (whole, None)

    # installed so, only a code holding a variant held back waits for the module (what another one traces is new);
    # where nothing of the entry could be installed, every code holding variants does
    package = types.SimpleNamespace(_innermost_fn=types.SimpleNamespace(__code__=object()))
    waits = Code([theirs, ours], {}, python_code=types.SimpleNamespace(co_firstlineno=3, co_name="forward"))
    taken = Code([ours], {}, python_code=types.SimpleNamespace(co_firstlineno=9, co_name="resume"))
    stored = Entry([waits, taken], Info({Source("not_generated_yet_xyz")}))
    part, _ = installing.without_missing(stored)
    for installed, waiting in ((part, {("lib", 3, "forward")}), (None, {("lib", 3, "forward"), ("lib", 9, "resume")})):
        state = types.SimpleNamespace(deferred={}, waiting={})
        installing.defer(state, package, None, stored, missing, {}, installed)
        assert set(state.waiting) == waiting and set(state.waiting.values()) == {missing}, (installed, state.waiting)


def test_a_backward_is_compiled_only_where_reuse_paid_for_it_and_its_inputs_are_fixed() -> None:
    """Half the tracing spared, less reuse's cost and the backwards compiled so far; a compile only above 0, only for
    inputs of fixed shape, and a compile that fails is counted, never raised."""
    from pytest_megacache.dynamo import backwards
    from pytest_megacache.dynamo.ledger import LEDGER

    class Tensor:
        def __init__(self, shape: tuple[Any, ...], device: str = "cpu") -> None:
            self.shape, self.device = shape, types.SimpleNamespace(type=device)

        def stride(self) -> tuple[Any, ...]:
            return tuple(1 for _ in self.shape)

    class Sym:
        pass

    fake = types.SimpleNamespace(SymInt=Sym, SymFloat=float, SymBool=bool, Tensor=Tensor)
    assert backwards._eligible(fake, [Tensor((2, 3)), 4]) and not backwards._eligible(fake, None)
    # a graph with a tensor on a device not checked is left to its test's backward()
    assert backwards._eligible(fake, [Tensor((2, 3)), Tensor((3,), "cuda")])
    assert not backwards._eligible(fake, [Tensor((2, 3)), Tensor((3,), "xpu")])
    assert not backwards._eligible(fake, [Tensor((2, Sym()))]) and not backwards._eligible(fake, [Sym()])
    held = types.SimpleNamespace(meta={"val": Tensor((Sym(),))})
    assert not backwards._eligible(fake, [held])

    before = (LEDGER.spared_tracing, LEDGER.offered, list(LEDGER.spans), LEDGER.completing, LEDGER.loading)
    try:
        LEDGER.spared_tracing, LEDGER.offered, LEDGER.spans, LEDGER.completing = 4.0, 0.5, [], 0.5
        LEDGER.loading = 0.0
        assert backwards.budget() == 1.0
        # stored graphs deserialized are no cost of reuse's own here: a run without it loads them in its cache hits
        LEDGER.spans, LEDGER.loading = [(10.0, 10.75)], 0.5
        assert backwards.budget() == 0.75
        LEDGER.spans, LEDGER.loading = [], 0.0

        class Compiler:
            def __init__(self, fails: bool = False) -> None:
                self.lazy_backward_info = types.SimpleNamespace(placeholder_list=[Tensor((2,))])
                self.fails, self.asked = fails, []

            def get_or_compile(self, *, saved_tensors_use_once: bool) -> None:
                self.asked.append(saved_tensors_use_once)
                if self.fails:
                    raise RuntimeError("no lowering")

        counted: list[int] = []
        unseen = backwards._unseen
        backwards._unseen = lambda torch: contextlib.nullcontext()  # type: ignore[assignment]
        try:
            for paid, compiler in ((lambda: 0.0, Compiler()), (lambda: 1.0, Compiler()), (lambda: 1.0, Compiler(True))):
                backwards.compiled_where_paid(fake, compiler, lambda: counted.append(1), paid)
                assert compiler.asked == ([] if paid() <= 0 else [False])  # as a backward that keeps its graph
        finally:
            backwards._unseen = unseen  # type: ignore[assignment]
        assert counted == [1] and LEDGER.completing > 0.5
    finally:
        LEDGER.spared_tracing, LEDGER.offered, LEDGER.spans, LEDGER.completing, LEDGER.loading = before


class _Kernel:  # torch's CachingAutotuner, as much of it as pickling reads
    def __init__(self, name: str) -> None:
        self.name, self.launchers = name, []

    def __getstate__(self) -> dict[str, Any]:
        assert not self.launchers, "pickle should not be called with after make_launchers()"
        return dict(self.__dict__)


@dataclasses.dataclass(frozen=True)
class _StaticKernel:  # torch's StaticallyLaunchedAutotuner
    cache_key: str
    kernel_name: str
    kernel: _Kernel


def test_a_graph_loaded_from_inductors_cache_runs_copies_of_its_bundled_kernels() -> None:
    """The kernel cache gets copies of a bundle's kernels: launching them leaves the bundle picklable (torch's own way
    left a forward loaded from Inductor's cache unbundled, its AOTAutograd entry never saved)."""
    from pytest_megacache.dynamo.patches import PATCHES

    handed: list[Any] = []

    class Bundler:
        @classmethod
        def load_autotuners(cls, static_autotuners: Any) -> list[str]:
            handed.extend(static_autotuners or ())
            return [each.kernel_name for each in static_autotuners or ()]

    bundle = [_StaticKernel("k1", "triton_poi_0", _Kernel("a")), _StaticKernel("k2", "triton_red_1", _Kernel("b"))]
    Bundler.load_autotuners(bundle)
    handed[0].kernel.launchers.append("launched")  # torch's own way: the bundle's kernel runs
    with pytest.raises(AssertionError, match="make_launchers"):
        pickle.dumps(bundle)
    bundle[0].kernel.launchers.clear()
    handed.clear()
    dynamo_repairs.bundled_kernels_left_unlaunched(Bundler)
    try:
        assert Bundler.load_autotuners(bundle) == ["triton_poi_0", "triton_red_1"]
        assert [each.cache_key for each in handed] == ["k1", "k2"]
        assert all(ran.kernel is not kept.kernel and ran.kernel.name == kept.kernel.name
                   for ran, kept in zip(handed, bundle, strict=True))
        for ran in handed:
            ran.kernel.launchers.append("launched")
        assert [each.kernel.name for each in pickle.loads(pickle.dumps(bundle))] == ["a", "b"]
        assert Bundler.load_autotuners(None) == [] and Bundler.load_autotuners([]) == []
        # a kernel that does not copy is handed as it is, as torch does
        odd = [_StaticKernel("k3", "triton_poi_2", _Kernel("c"))]
        odd[0].kernel.launchers.append("launched")
        handed.clear()
        Bundler.load_autotuners(odd)
        assert handed[0] is odd[0]
    finally:
        assert PATCHES.remove(Bundler, "load_autotuners")
    assert "load_autotuners" in vars(Bundler) and Bundler.load_autotuners([]) == []
