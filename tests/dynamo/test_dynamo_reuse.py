"""Dynamo reuse (``--megacache-precompile``), for real: a project whose code changes between a cold and a warm
session in every way that decides what Dynamo traced, on fresh cache directories each. Every test compares the
compiled function with eager on the code as it is at that moment, so a stale hit fails it; the warm session must
also really reuse what did not change (the positive case), or the safety tests could pass by reusing nothing.

The two sessions run once, in one chain (a class-scoped fixture), and the tests of the class read what they need.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import dynamo as dynamo_reuse

from ..conftest import removed_unless_failed
from ..helpers_torch import Run, TorchProject, holds_function, skip_without_torch

skip_without_torch()
pytestmark = pytest.mark.torch

# Two modules, each with `def f` on the same first line (torch keys its own entries by qualname and line only).
CALC_A = """
import torch


def f(x):
    return torch.sin(x) * 2 + 1
"""
CALC_B = """
import torch


def f(x):
    return torch.cos(x) * 3 - 1
"""

# The module the tests compile from, as a template: @NAME@ markers differ between the cold and the warm session.
EDITS = """
import functools
import typing
import warnings

import torch

SCALE = @SCALE@
STABLE_SCALE = 3.0


def unchanged(x):
    return torch.sin(x) + torch.cos(x)


def body_edited(x):
    return torch.sin(x) * @BODY@


def helper(x):
    return x + @HELPER@


def calls_helper(x):
    return helper(x) * 2


def uses_global(x):
    return x * SCALE


def uses_stable_global(x):  # the twin of uses_global: the global's value is the same in both sessions
    return x * STABLE_SCALE


def cut_short(x):  # the function whose stored entry the chain corrupts
    return torch.cos(x) * 7 + 3


def make_closure(k):
    def inner(x):
        return x + k

    return inner


def make_stable_closure(k):  # make_closure's twin, a code of its own (a second value makes the first one's k dynamic)
    def inner(x):
        return x * k

    return inner


def breaks(x):  # a graph break: a resume function, which each trace names anew
    y = torch.sin(x) * 2
    torch._dynamo.graph_break()
    return y + 1


def stage(x, k):  # what follows the graph break reads k: its resume function's variants differ by k
    y = torch.sin(x)
    torch._dynamo.graph_break()
    return y * k


def returns_inner(x):  # Dynamo's output code makes `inner` again, from this module's globals (a constant there)
    inner = make_closure(2.0)
    return inner(x), inner


class Pair(typing.NamedTuple):  # its __new__ reads a scope of its own, which Dynamo installs as a global
    first: torch.Tensor
    second: torch.Tensor


def makes_pair(x):
    pair = Pair(x + 1, x * 2)
    return pair.first * pair.second


def explained_then_compiled(x):  # explained (two graphs, a grad-mode block in the first), then compiled
    y = torch.tanh(x) * 2 + x
    with torch.no_grad():
        z = y * 3
    torch._dynamo.graph_break()
    return y + torch.cos(z)



def with_default(x, k=@DEFAULT@):
    return x * k


def with_stable_default(x, k=4.0):
    return x * k


def scaled_by_default(x, k=3.0):
    return x * k


def calls_with_default(x):  # inlines a function reading its default value (a guard on G[...].__defaults__[0])
    return scaled_by_default(x) + 1


def rebound_target(x):
    return x + 1


def other_target(x):
    return x - 1


def calls_rebound(x):
    return rebound_target(x) * 2


def later_target(x):
    return x * 4


def calls_later(x):
    return later_target(x) - 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            return torch.relu(y) * @METHOD@
        return torch.tanh(y)


class StableNet(torch.nn.Module):  # Net's twin: its forward the same in both sessions
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 3


@torch.compile
def decorated_at_import(x):
    return torch.sin(x) * 3 + 1


class StableState:
    def __init__(self, a):
        self.a = a

    @property
    def double(self):
        return self.a * 2

    def scale(self, k):
        return self.a * k


class MethodState(StableState):
    def scale(self, k):
        return self.a * k * @CLASS_METHOD@


class GetterState(StableState):
    @property
    def double(self):
        return self.a * @GETTER@


def uses_state(s):
    return s.double + s.scale(2)


# the same body, one function for each class below (a frame that cannot be stored for one class is stored for none)
def uses_method_state(s):
    return s.double + s.scale(2)


def uses_getter_state(s):
    return s.double + s.scale(2)


def uses_local_state(s):
    return s.double + s.scale(2)


def uses_patched_state(s):
    return s.double + s.scale(2)


class PatchedState(StableState):
    pass


def uses_read_annotations_state(s):
    return s.double + s.scale(2)


class ReadAnnotationsState(StableState):  # one session reads its annotations: Python fills in an empty dict there
    pass


def deco(func):
    @functools.wraps(func)
    def wrapper(*args):
        return func(*args) + 1

    return wrapper


@deco
def decorated_stable(x):
    return x * 5


@deco
def decorated_edited(x):
    return x * @DECORATED@


def calls_fn(fn, x):
    return fn(x) * 2


class Scaling:
    def __init__(self, k):
        self.k = k

    def __call__(self, func):
        @functools.wraps(func)
        def wrapper(x):
            return func(x) * self.k

        return wrapper


@Scaling(3)
def scaled_stable(x):
    return x + 1


@Scaling(@SCALING@)
def scaled_edited(x):
    return x + 1


def calls_stable(fn, x):  # one compiled caller per test: torch 2.11 stores one wrapper's package per function
    return fn(x) * 2


def calls_edited(fn, x):
    return fn(x) * 2


def type_of(x):
    if type(x) is torch.Tensor:
        return x + 1
    return x - 1


def uses_sin(x):
    return torch.sin(x) + 2


def two_wrappers(x):
    return torch.cos(x) * 3


def traced_before_another_wrapper(x):
    return torch.cos(x) * 7 - 2


def two_variants(x):
    return torch.cos(x) * 5 + 1


def another_compile(x):
    return torch.sin(x) * 4 - 1


def under_a_config(x):
    return torch.tanh(x) + 2


def under_the_same_config(x):
    return torch.tanh(x) * 2 - 1


class MyTensor(torch.Tensor):
    pass


def eager_backend(x):  # a block run with grad off: a call made for its effect in the graph
    y = torch.sin(x) * 6 - 2
    with torch.no_grad():
        z = y * 2
    return y, z


def forward_only(x):
    return torch.cos(x) * 3 + 1


def non_leaf_input(x):
    return torch.sin(x) * 4 - 1


class Plus(torch.Tensor):  # adds 1 to what torch.add gives: Dynamo inlines this into the graph
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.add:
            with torch._C.DisableTorchFunctionSubclass():
                out = out + 1
        return out


def adds(x):
    return torch.add(x, 1) * 2


@torch._dynamo.assume_constant_result
def warn_when_traced():
    warnings.warn("shown while traced", UserWarning)
    return 1


def warns_when_traced(x):
    return x + warn_when_traced()


def make_local_warning():
    class LocalWarning(UserWarning):  # a class made in a function: no name finds it in another process
        pass

    return LocalWarning


LocalWarning = make_local_warning()


@torch._dynamo.assume_constant_result
def warn_of_a_local_class():
    warnings.warn("of a class made in a function", LocalWarning)
    return 1


def warns_of_a_local_class(x):
    return x - warn_of_a_local_class()


def counted(x):  # a graph break: two frames (the function and its resume function), a graph each
    y = torch.sin(x) * 2
    torch._dynamo.graph_break()
    return y + torch.cos(x)


def counted_by_backend(x):
    return torch.sin(x) * 2 + 1


def recorded_by_backend(x):
    return torch.cos(x) * 3 - 1


def grows(x):  # called with sizes the cold session never saw, after its stored variant was taken
    return torch.sin(x) + 2


def seen_first(x):  # called warm with a size the cold session never saw, before the size it stored
    return torch.cos(x) + 2
"""

# A module that generates others from templates at run time; its compiled functions call into them.
GENERATOR = """
import importlib
import sys

import torch

generated = stable = later = None


def generate(folder, name, body):
    (folder / f"{name}.py").write_text(f"def kernel(x):\\n    return {body}\\n")
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    return importlib.import_module(name)


def setup(folder, factor):
    global generated
    generated = generate(folder, "gen_kernels", f"x * {factor}")


def setup_stable(folder):
    global stable
    stable = generate(folder, "gen_stable", "x * 5 - 2")


def setup_later(folder):
    global later
    later = generate(folder, "gen_later", "x * 7")


@torch.compile
def compiled_call(x):
    return generated.kernel(x) + 1


@torch.compile
def compiled_stable(x):
    return stable.kernel(x) + 1


@torch.compile
def compiled_before_and_after(x):  # called before its module is generated, then after
    if later is None:
        return x - 1
    return later.kernel(x) - 1


def setup_graded(folder):
    global graded
    graded = generate(folder, "gen_graded", "x * 3 + 4")


graded = None


@torch.compile
def broken_then_graded(x, w):  # after the break, a graph whose backward no test runs; without w, a generated module
    if w is None:
        return graded.kernel(x) + 1
    y = x * 2
    torch._dynamo.graph_break()
    return torch.cos(y * w) + 1


def setup_scaled(folder):
    global scaled
    scaled = generate(folder, "gen_scaled", "x * 6 - 1")


scaled = None
resumed_sine = True


@torch.compile
def scaled_then_resumed(x, w):  # without w, a generated module; with it, a break, then a global only the resume reads
    if w is None:
        return scaled.kernel(x) + 1
    y = x * w
    torch._dynamo.graph_break()
    return torch.sin(y) if resumed_sine else torch.cos(y)
"""

TESTS = """
import collections
import inspect
import os
import warnings

import pytest
import torch
import torch._inductor.config  # first, as a suite that sets Inductor's options: Dynamo is imported half way through it
import torch._dynamo.testing

import calc_a
import calc_b
import edits
import generator

VARIANT = int(os.environ["REUSE_VARIANT"])
X = torch.linspace(-2.0, 2.0, 8)


def same(compiled, eager, *args):
    torch.testing.assert_close(compiled(*args), eager(*args))


def test_unchanged():
    same(torch.compile(edits.unchanged), edits.unchanged, X)


def test_decorated_at_import():
    torch.testing.assert_close(edits.decorated_at_import(X), torch.sin(X) * 3 + 1)


def test_same_name_same_line_in_two_modules():
    same(torch.compile(calc_a.f), calc_a.f, X)
    same(torch.compile(calc_b.f), calc_b.f, X)


def test_body_edited():
    same(torch.compile(edits.body_edited), edits.body_edited, X)


def test_inlined_helper_edited():
    same(torch.compile(edits.calls_helper), edits.calls_helper, X)


def test_module_global_edited():
    same(torch.compile(edits.uses_global), edits.uses_global, X)


def test_module_global_unchanged():
    same(torch.compile(edits.uses_stable_global), edits.uses_stable_global, X)


def test_an_entry_cut_short():
    same(torch.compile(edits.cut_short), edits.cut_short, X)


def test_closure_variable_changed():
    inner = edits.make_closure(float(VARIANT) * 10)
    same(torch.compile(inner), inner, X)


def test_closure_variable_unchanged():
    inner = edits.make_stable_closure(7.0)
    same(torch.compile(inner), inner, X)


def test_default_argument_changed():
    same(torch.compile(edits.with_default), edits.with_default, X)


def test_default_argument_unchanged():
    same(torch.compile(edits.with_stable_default), edits.with_stable_default, X)


def test_inlined_default_argument_unchanged():
    same(torch.compile(edits.calls_with_default), edits.calls_with_default, X)


def test_module_method_edited_and_mode():
    torch.manual_seed(0)
    net = edits.Net()
    net.train(VARIANT == 1)  # trained mode cold, eval mode warm
    same(torch.compile(net), net, X.reshape(2, 4))


def test_module_method_unchanged():
    torch.manual_seed(0)
    net = edits.StableNet().requires_grad_(False)  # with grad, a forward whose backward never runs stores no graph
    same(torch.compile(net), net, X.reshape(2, 4))


def test_global_function_rebound(monkeypatch):
    first = torch.compile(edits.calls_rebound)
    same(first, edits.calls_rebound, X)
    monkeypatch.setattr(edits, "rebound_target", edits.other_target)
    same(torch.compile(edits.calls_rebound), edits.calls_rebound, X)
    same(first, edits.calls_rebound, X)  # the first wrapper too: its guards see the rebinding


def test_global_function_rebound_after_a_call(monkeypatch):
    compiled = torch.compile(edits.calls_later)
    same(compiled, edits.calls_later, X)  # warm: the stored variant for later_target, installed, no tracing
    monkeypatch.setattr(edits, "later_target", edits.other_target)
    same(compiled, edits.calls_later, X)  # its rebuilt guard sees the rebinding: traced again


def test_class_of_a_local_unchanged():
    same(torch.compile(edits.uses_state), edits.uses_state, edits.StableState(X))


def test_class_method_edited():
    same(torch.compile(edits.uses_method_state), edits.uses_method_state, edits.MethodState(X))


def test_property_getter_edited():
    same(torch.compile(edits.uses_getter_state), edits.uses_getter_state, edits.GetterState(X))


def test_class_method_rebound_by_monkeypatch(monkeypatch):
    if VARIANT == 2:  # the file is the same: torch's source checksums see no change, the class's digest does
        monkeypatch.setattr(edits.PatchedState, "scale", lambda self, k: self.a - k)
    same(torch.compile(edits.uses_patched_state), edits.uses_patched_state, edits.PatchedState(X))


def test_a_class_whose_annotations_one_session_read():
    if VARIANT == 1:  # the class's definition is the same; its namespace gains the empty dict in this session alone
        assert edits.ReadAnnotationsState.__annotations__ == {}
    same(torch.compile(edits.uses_read_annotations_state), edits.uses_read_annotations_state,
         edits.ReadAnnotationsState(X))


def test_class_in_local_scope():
    class Local(edits.StableState):
        def scale(self, k):
            return self.a * (k + VARIANT)

    same(torch.compile(edits.uses_local_state), edits.uses_local_state, Local(X))


def test_decorated_function_unchanged():
    same(torch.compile(edits.decorated_stable), edits.decorated_stable, X)


def test_a_graph_break_traced_by_two_wrappers():  # each wrapper's variant calls its own resume function's name
    same(torch.compile(edits.breaks), edits.breaks, X)
    same(torch.compile(edits.breaks), edits.breaks, X.double())


def test_a_resume_function_compiled_again_under_another_wrapper():
    same(torch.compile(edits.stage), edits.stage, X, 2)
    # the first wrapper's variant of stage holds; its resume function is compiled for k = 3 under the second wrapper
    same(torch.compile(edits.stage), edits.stage, X, 3)


def test_a_named_tuple_made_in_the_frame():
    same(torch.compile(edits.makes_pair), edits.makes_pair, X)


def test_explained_then_compiled():
    explanation = torch._dynamo.explain(edits.explained_then_compiled)(X)
    assert (explanation.graph_count, explanation.graph_break_count, explanation.op_count) == (2, 1, 8), explanation
    assert [len(ops) for ops in explanation.ops_per_graph] == [6, 2]
    assert explanation.graphs[0].code.count("torch._C._set_grad_enabled(") == 2, explanation.graphs[0].code
    [reason] = explanation.break_reasons
    assert reason.graph_break and "graph_break" in reason.user_stack[-1].line, reason
    assert reason.user_stack[-1].filename == edits.__file__, reason.user_stack
    assert len(explanation.out_guards) > 0 and all(guard.name is not None for guard in explanation.out_guards)
    same(torch.compile(edits.explained_then_compiled), edits.explained_then_compiled, X)


def test_a_function_made_in_the_frame():
    y, inner = torch.compile(edits.returns_inner)(X)
    eager_y, eager_inner = edits.returns_inner(X)
    torch.testing.assert_close(y, eager_y)
    torch.testing.assert_close(inner(X), eager_inner(X))


def test_decorated_function_edited():
    same(torch.compile(edits.decorated_edited), edits.decorated_edited, X)


def test_function_passed_as_argument():
    same(torch.compile(edits.calls_fn), edits.calls_fn, edits.decorated_stable, X)


def test_decorator_instance_unchanged():
    same(torch.compile(edits.calls_stable), edits.calls_stable, edits.scaled_stable, X)


def test_decorator_instance_state_changed():  # the instance in the wrapper's closure holds another value warm
    same(torch.compile(edits.calls_edited), edits.calls_edited, edits.scaled_edited, X)


def test_type_of_a_tensor_unchanged():
    same(torch.compile(edits.type_of), edits.type_of, X)


def test_tensor_subclass_where_the_class_was():
    x = X.clone() if VARIANT == 1 else X.as_subclass(edits.MyTensor)
    same(torch.compile(edits.type_of), edits.type_of, x)


def test_eager_backend():
    x = X.clone().requires_grad_()
    y, z = torch.compile(edits.eager_backend, backend="eager")(x)
    same(lambda x: (y, z), edits.eager_backend, x)
    assert y.requires_grad and not z.requires_grad  # the block ran with grad off, as in eager


def test_a_non_leaf_input_shows_no_warning():  # torch's serializer of the guards reads its .grad, which warns
    x = X.clone().requires_grad_() * 2
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        same(torch.compile(edits.non_leaf_input, backend="eager"), edits.non_leaf_input, x)
    assert not [w for w in shown if ".grad attribute" in str(w.message)], [str(w.message) for w in shown]


def test_a_forward_whose_backward_never_runs(monkeypatch):  # torch stores no compiled graph until its backward is
    # compiled: warm, reuse pays for compiling it (the budget set here: this chain's traces are too short to)
    if VARIANT == 2:
        from pytest_megacache.dynamo import backwards

        monkeypatch.setattr(backwards, "budget", lambda: 60.0)
    x = X.clone().requires_grad_()
    assert torch._dynamo.explain(edits.forward_only)(x).graph_count == 1  # its explanation's variant is stored
    same(torch.compile(edits.forward_only), edits.forward_only, x)


def detached(x):
    return x.detach()


def test_a_graph_inductor_returns_uncompiled():  # torch asserts where it bundles its AOTAutograd entry
    x = X.clone().requires_grad_()
    assert torch.equal(torch.compile(detached)(x), x.detach())


@pytest.mark.skipif(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 12),
                    reason="torch 2.11 runs such a graph with the subclass's dispatch on: twice, without the plugin too")
def test_subclass_dispatch_inlined():  # torch runs this graph with subclass dispatch off
    x = X.as_subclass(edits.Plus)
    compiled = torch.compile(edits.adds, backend="eager")
    torch.testing.assert_close(compiled(x).as_subclass(torch.Tensor), edits.adds(x).as_subclass(torch.Tensor))


def test_module_attribute_rebound(monkeypatch):
    if VARIANT == 2:
        monkeypatch.setattr(torch, "sin", torch.cos)  # before the first call: the stored entry must be refused
    same(torch.compile(edits.uses_sin), edits.uses_sin, X)


def test_one_function_in_two_wrappers():
    same(torch.compile(edits.two_wrappers), edits.two_wrappers, X)
    same(torch.compile(edits.two_wrappers), edits.two_wrappers, X.double())  # the second wrapper's own variant


def test_a_variant_traced_before_another_wrapper_installs_the_entry():
    first = torch.compile(edits.traced_before_another_wrapper)
    same(first, edits.traced_before_another_wrapper, X)
    if VARIANT == 2:  # a variant the stored entry lacks, traced into the entry the first wrapper installed
        same(first, edits.traced_before_another_wrapper, X.double())
    second = torch.compile(edits.traced_before_another_wrapper)  # installs the stored entry again
    same(second, edits.traced_before_another_wrapper, X)
    if VARIANT == 2:  # and one more, traced into the second wrapper's
        same(second, edits.traced_before_another_wrapper, X.bfloat16())


def test_one_variant_of_two_corrupted():  # stored with two variants, the first one's guards cut warm
    compiled = torch.compile(edits.two_variants)
    same(compiled, edits.two_variants, X)
    same(compiled, edits.two_variants, X.double())


def test_another_compile_than_stored():
    # fullgraph warm only: in one process torch keeps the frames of wrappers of other backends, modes or fullgraph
    # apart, and traces again after a reset; a stored variant is no more taken across them
    same(torch.compile(edits.another_compile, fullgraph=VARIANT == 2), edits.another_compile, X)


def test_a_configuration_patched_around_the_call():
    compiled = torch.compile(edits.under_a_config)
    with torch._inductor.config.patch(split_reductions=VARIANT == 1):  # Inductor's default cold, not warm
        same(compiled, edits.under_a_config, X)


def test_a_configuration_patched_the_same_around_the_call():
    compiled = torch.compile(edits.under_the_same_config)
    with torch._inductor.config.patch(split_reductions=False):  # not Inductor's default, in both sessions
        same(compiled, edits.under_the_same_config, X)


def test_a_warning_shown_while_traced():  # where the frame is taken from the store too, from where it was shown
    with pytest.warns(UserWarning, match="shown while traced") as shown:
        torch.testing.assert_close(torch.compile(edits.warns_when_traced)(X), X + 1)
    [warning] = [w for w in shown if "shown while traced" in str(w.message)]
    lines, first = inspect.getsourcelines(edits.warn_when_traced)
    at = first + next(i for i, line in enumerate(lines) if "warnings.warn" in line)
    assert (warning.category, os.path.basename(warning.filename), warning.lineno) == (UserWarning, "edits.py", at)


def test_a_warning_of_a_class_made_in_a_function():
    with pytest.warns(edits.LocalWarning, match="of a class made in a function"):
        torch.testing.assert_close(torch.compile(edits.warns_of_a_local_class)(X), X - 1)


def test_torch_counters_after_a_first_compiled_call():
    from torch._dynamo.utils import counters

    groups = ("frames", "stats", "graph_break", "resumes")
    before = {group: collections.Counter(counters[group]) for group in groups}
    same(torch.compile(edits.counted), edits.counted, X)
    added = {group: dict(collections.Counter(counters[group]) - before[group]) for group in groups}
    # what torch 2.13 counts without the plugin: two frames (the function, its resume function), a graph each
    assert added["frames"] == {"total": 2, "ok": 2}, added
    assert added["stats"] == {"unique_graphs": 2, "calls_captured": 4}, added
    assert sum(added["graph_break"].values()) == 1 and list(added["resumes"].values()) == [1], added


def test_a_compile_counter_backend():  # torch's own counting backend: a backend object, never stored
    counter = torch._dynamo.testing.CompileCounter()
    same(torch.compile(edits.counted_by_backend, backend=counter), edits.counted_by_backend, X)
    assert (counter.frame_count, counter.op_count) == (1, 3)


GIVEN = []


def recording(gm, example_inputs):  # a backend of the suite's own: a named function that records what it is given
    GIVEN.append(len(list(gm.graph.nodes)))
    return gm.forward


def test_a_backend_of_the_suites_own():  # reuse on by default never stores its frames: taken, it would not be called
    GIVEN.clear()
    same(torch.compile(edits.recorded_by_backend, backend=recording), edits.recorded_by_backend, X)
    assert len(GIVEN) == 1


def test_new_sizes_after_a_variant_taken_from_the_store():
    from torch._dynamo.utils import counters

    compiled = torch.compile(edits.grows)
    same(compiled, edits.grows, torch.ones(4))  # cold: traced; warm: taken from the store
    if VARIANT == 2:
        # sizes the cold session never saw: as where the first call was traced, torch marks the size dynamic at the
        # second one (one graph for both), instead of a static graph then a dynamic one
        before = counters["stats"]["unique_graphs"]
        same(compiled, edits.grows, torch.ones(6))
        same(compiled, edits.grows, torch.ones(9))
        assert counters["stats"]["unique_graphs"] - before == 1


def test_generated_module(tmp_path):
    generator.setup(tmp_path, 2 + VARIANT)
    same(generator.compiled_call, lambda x: generator.generated.kernel(x) + 1, X)


def test_a_stored_size_after_a_size_never_stored():
    from torch._dynamo.utils import counters

    compiled = torch.compile(edits.seen_first)
    before = counters["stats"]["unique_graphs"]
    if VARIANT == 2:
        # torch has noted size 6 when size 4 comes: it traces a dynamic graph, which size 9 then takes; the static
        # variant stored for size 4 (traced where nothing was noted) is not what torch would compile here
        same(compiled, edits.seen_first, torch.ones(6))
    same(compiled, edits.seen_first, torch.ones(4))
    if VARIANT == 2:
        same(compiled, edits.seen_first, torch.ones(9))
        assert counters["stats"]["unique_graphs"] - before == 2


def test_generated_module_unchanged(tmp_path):
    generator.setup_stable(tmp_path)
    same(generator.compiled_stable, lambda x: generator.stable.kernel(x) + 1, X)


def test_a_resume_function_whose_backward_never_runs(tmp_path, monkeypatch):  # its entry waits for a module too
    if VARIANT == 2:  # the budget set here, as for the forward whose backward never runs
        from pytest_megacache.dynamo import backwards

        monkeypatch.setattr(backwards, "budget", lambda: 60.0)
    w = X.clone().requires_grad_()
    same(generator.broken_then_graded, lambda x, w: torch.cos(x * 2 * w) + 1, X, w)
    generator.setup_graded(tmp_path)
    same(generator.broken_then_graded, lambda x, w: x * 3 + 4 + 1, X, None)


def test_a_resume_function_traced_again_while_its_entry_waits_for_a_module(tmp_path, monkeypatch):
    monkeypatch.setattr(generator, "resumed_sine", VARIANT == 1)
    same(generator.scaled_then_resumed, lambda x, w: torch.sin(x * w) if VARIANT == 1 else torch.cos(x * w), X, X)
    generator.setup_scaled(tmp_path)
    same(generator.scaled_then_resumed, lambda x, w: x * 6 - 1 + 1, X, None)


def test_generated_module_called_before_it_exists(tmp_path):
    same(generator.compiled_before_and_after, lambda x: x - 1, X)
    generator.setup_later(tmp_path)
    same(generator.compiled_before_and_after, lambda x: generator.later.kernel(x) - 1, X)


def test_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    optims = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, reference)]

    def step(m, opt, x):
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(step)
    x = X.reshape(2, 4)
    for _ in range(2):
        torch.testing.assert_close(compiled(model, optims[0], x), step(reference, optims[1], x))
"""

VARIANTS = {
    1: {"SCALE": "2.0", "BODY": "2", "HELPER": "1", "DEFAULT": "3", "METHOD": "2", "CLASS_METHOD": "1",
        "GETTER": "2", "DECORATED": "2", "SCALING": "2"},
    2: {"SCALE": "5.0", "BODY": "7", "HELPER": "4", "DEFAULT": "6", "METHOD": "9", "CLASS_METHOD": "3",
        "GETTER": "4", "DECORATED": "6", "SCALING": "4"},
}


def _fill(template: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        template = template.replace(f"@{name}@", value)
    assert not re.search(r"@[A-Z_]+@", template), template
    return template


@dataclass
class ReuseChain:
    project: TorchProject
    runs: dict[str, Run] = field(default_factory=dict)

    def write(self, variant: int) -> None:
        self.project.write("calc_a.py", CALC_A)
        self.project.write("calc_b.py", CALC_B)
        self.project.write("edits.py", _fill(EDITS, VARIANTS[variant]))
        self.project.write("generator.py", GENERATOR)

    corrupted: tuple[str, bytes] | None = None  # the stored entry cut short before the warm session: key, bytes
    variant_corrupted: bool = False  # one stored variant's guards overwritten (the entry itself loads)
    after_cold: list[dict[str, bytes]] = field(default_factory=list)  # the stored Dynamo entries after the cold session

    def run(self, name: str, variant: int, *args: str) -> Run:
        self.write(variant)
        self.runs[name] = run = self.project.run(*args, env={"REUSE_VARIANT": str(variant)})  # reuse on by default
        return run

    def stored_precompile(self) -> list[dict[str, bytes]]:
        """Each stored object's Dynamo entries (key: bytes)."""
        return [{e.name: e.data for e in entries if e.kind == "torch/precompile"}
                for _path, _header, entries in _objects(self.project.path / "store")]

    def corrupt(self, marker: bytes) -> None:
        """Cut the last byte (pickle's STOP) off the stored Dynamo entry whose bytes hold ``marker``, inside an object
        that stays valid (encoded again, unsigned): torch's loader fails on it after unpickling its compiled graphs."""
        name, cut = self._rewrite(marker, lambda data: data[:-1])
        self.corrupted = (name, cut)

    def corrupt_first_variant(self, marker: bytes) -> None:
        """Overwrite the start of torch's guard state in the first stored variant of the entry holding ``marker`` (the
        same length: the entry's own pickle stays valid): that variant cannot be loaded, the others can."""

        def overwrite(data: bytes) -> bytes:
            start = data.index(b"megacache-guards-")
            size_at = data.index(b"\n", start) + 1  # the plugin's header: magic line, its length (8 bytes), JSON
            state = size_at + 8 + int.from_bytes(data[size_at:size_at + 8], "big")
            return data[:state + 2] + b"\xff" * 16 + data[state + 18:]

        self._rewrite(marker, overwrite)
        self.variant_corrupted = True

    def _rewrite(self, marker: bytes, change: Any) -> tuple[str, bytes]:
        from pytest_megacache import bundle as bundlemod

        for path, header, entries in _objects(self.project.path / "store"):
            hits = [e for e in entries if e.kind == "torch/precompile" and marker in e.data]
            if hits:
                [entry] = hits
                data = change(entry.data)
                rest = [e for e in entries if e.ident != entry.ident]
                path.write_bytes(bundlemod.encode(bundlemod.Entries([*rest, entry.with_data(data)]), header.fingerprint,
                                                  header.extra))
                return entry.name, data
        raise AssertionError(f"no stored Dynamo entry holds {marker!r}")


def _starts(data: bytes, marker: bytes) -> list[int]:
    """Where ``marker`` starts in ``data`` (a stored entry keeps each variant's guards whole in torch's pickle)."""
    out, at = [], data.find(marker)
    while at >= 0:
        out.append(at)
        at = data.find(marker, at + 1)
    return out


def _objects(store: Path) -> list[tuple[Path, Any, Any]]:
    from pytest_megacache import bundle as bundlemod

    out = []
    for path in sorted(store.rglob("*.mcb")):
        header, entries = bundlemod.decode(path.read_bytes())
        out.append((path, header, entries))
    return out


@pytest.fixture(scope="class")
def reuse_chain(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> ReuseChain:
    path: Path = removed_unless_failed(request, tmp_path_factory.mktemp("dynamo-reuse"))
    project = TorchProject(path=path, env={"MEGACACHE_DIR": str(path / "store")}, tests=TESTS, dynamo_reuse=True)
    chain = ReuseChain(project)
    chain.run("cold", 1)
    chain.after_cold = chain.stored_precompile()
    chain.corrupt(b"\x8c\x09cut_short\x94")  # the stored entry of edits.cut_short (its pickled name)
    chain.corrupt_first_variant(b"\x8c\x0ctwo_variants\x94")
    chain.run("warm", 2, "-W", "error::pytest.PytestUnraisableExceptionWarning")
    return chain


def _copies(runs: list[dict[str, bytes]], name: bytes) -> set[bytes]:
    """The stored Dynamo entries of the function ``name``."""
    return {data for entries in runs for data in entries.values() if holds_function(data, name)}


def _counters(run: Run) -> dict[str, int]:
    assert run.report is not None, run.result.outlines[-30:]
    return {k: int(v) for k, v in run.report["torch"]["counters"].items()}


def _graphs(run: Run, test: str) -> int:
    """The graphs counted while ``test`` ran, in torch's own counters (the project's conftest)."""
    [made] = [n for nodeid, n in run.counters["graphs_per_test"].items() if nodeid.endswith(f"::{test}")]
    return int(made)


def _traces(run: Run, test: str) -> int:
    """The frames Dynamo traced while ``test`` ran, as torch's own compile timings recorded them (the project's
    conftest): a frame taken from the store is not traced."""
    [traced] = [n for nodeid, n in run.counters["traces_per_test"].items() if nodeid.endswith(f"::{test}")]
    return int(traced)


def _compiles(run: Run, test: str) -> int:
    assert run.report is not None
    records = [t for nodeid, t in run.report["torch"]["per_test"].items() if nodeid.endswith(f"::{test}")]
    return sum(int(record["compiles"]) for record in records)  # a test that compiled nothing has no record


class TestDynamoReuse:
    """Assertions on the chain's cold and warm sessions (a class: under pytest-xdist its tests share a worker)."""

    def test_every_test_passes_cold_and_warm_against_eager(self, reuse_chain: ReuseChain) -> None:
        skipped = 1 if tuple(map(int, importlib.metadata.version("torch").split(".")[:2])) < (2, 12) else 0  # on 2.11
        for name in ("cold", "warm"):
            run = reuse_chain.runs[name]
            outcomes = run.result.parseoutcomes()
            ran = (outcomes.get("passed", 0), outcomes.get("skipped", 0), outcomes.get("failed", 0))
            failed = [line for line in run.result.outlines if line.startswith(("FAILED", "ERROR"))]
            assert ran == (60 - skipped, skipped, 0), (name, failed, run.result.outlines[-80:])
            assert run.megacache_warnings() == [], (name, run.megacache_warnings())

    def test_the_cold_session_stores_entries(self, reuse_chain: ReuseChain) -> None:
        cold = reuse_chain.runs["cold"]
        c = _counters(cold)
        assert c["dynamo_stored"] >= 10 and c["dynamo_reused"] == 0, c
        assert cold.report is not None and cold.report["upload"]["new_entries"].get("torch/precompile", 0) >= 10

    def test_unchanged_code_is_reused_warm_without_tracing(self, reuse_chain: ReuseChain) -> None:
        """The positive case: what did not change is taken from the store, and Dynamo does not trace it. Where the
        packages of one function's wrappers are not merged (torch keeps the last one), the first wrapper's variant of
        a function wrapped twice is not stored."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        c = _counters(warm)
        assert c["dynamo_reused"] >= 5 and c["dynamo_frames_reused"] >= 5, c
        assert warm.report is not None and warm.report["torch"]["layers"]["precompile"]["used"] >= 5, warm.report["torch"]
        merged = dynamo_reuse.release_checked(importlib.metadata.version("torch"), dynamo_reuse.MERGED_RELEASES)
        for test in ("test_unchanged", "test_same_name_same_line_in_two_modules", "test_decorated_at_import",
                     "test_class_of_a_local_unchanged", "test_decorated_function_unchanged",
                     "test_function_passed_as_argument", "test_decorator_instance_unchanged",
                     "test_type_of_a_tensor_unchanged", "test_inlined_default_argument_unchanged",
                     "test_a_function_made_in_the_frame", "test_a_named_tuple_made_in_the_frame", "test_explained_then_compiled",
                     "test_eager_backend", "test_a_non_leaf_input_shows_no_warning", "test_module_global_unchanged",
                     "test_closure_variable_unchanged", "test_default_argument_unchanged", "test_module_method_unchanged",
                     "test_a_configuration_patched_the_same_around_the_call", "test_a_warning_shown_while_traced",
                     "test_torch_counters_after_a_first_compiled_call", "test_a_class_whose_annotations_one_session_read",
                     *(("test_one_function_in_two_wrappers", "test_a_graph_break_traced_by_two_wrappers") if merged else ())):
            assert _compiles(cold, test) > 0 and _compiles(warm, test) == 0, test
            # torch's own record witnesses it, not the plugin's report: Dynamo traced no frame while the test ran warm
            assert _traces(cold, test) > 0 and _traces(warm, test) == 0, (test, _traces(cold, test), _traces(warm, test))
            # and what a test can read of torch's counters is what the trace left: the graphs it counted
            assert _graphs(warm, test) == _graphs(cold, test) > 0, (test, _graphs(cold, test), _graphs(warm, test))
        assert sum(warm.counters["traces_per_test"].values()) < sum(cold.counters["traces_per_test"].values())

    def test_an_entry_taken_as_it_was_stored_is_not_stored_again(self, reuse_chain: ReuseChain) -> None:
        """torch writes every entry it installed again at the session's end, pickled into other bytes: uploaded as
        new, the same variants went to the store in every warm run (on a tensor-container suite 104 of its 106
        entries each time, and a merge of the scope with them). The entry of a function reused as it was stored stays
        the one copy the cold session stored (two functions whose two variants each were taken from the store). One
        that gained a variant in the warm session (traced under another compile, or for a rebound module attribute)
        is stored with both: torch adds the variants a process traces to the entry it installed, and that is no
        reason to leave it out."""

        after_warm = reuse_chain.stored_precompile()
        for name in (b"calls_rebound", b"calls_later"):
            cold = _copies(reuse_chain.after_cold, name)
            assert len(cold) == 1 and _copies(after_warm, name) == cold, name
        for name in (b"another_compile", b"uses_sin"):
            [cold], [warm] = _copies(reuse_chain.after_cold, name), _copies(after_warm, name)
            # each stored variant's guards start with the plugin's header
            assert (cold.count(b"megacache-guards-"), warm.count(b"megacache-guards-")) == (1, 2), name

    def test_a_variant_refused_in_its_own_test_is_marked_in_what_that_test_traced(
            self, reuse_chain: ReuseChain) -> None:
        """Each stored variant keeps the tag of its test; one traced in place of a variant that a proof refused in
        that same test is marked so (the test rebinds a module attribute warm): the next run that refuses it there
        again writes it no more (``dynamo.offers.superseded``). The first refused one stays, for a run where it holds
        again."""
        [cold] = _copies(reuse_chain.after_cold, b"uses_sin")
        [warm] = _copies(reuse_chain.stored_precompile(), b"uses_sin")
        assert (cold.count(b"megacache-guards-"), warm.count(b"megacache-guards-")) == (1, 2)
        [tag] = re.findall(rb'"test":"([0-9a-f]{16})"', cold)
        assert b'"retraced":true' not in cold and warm.count(b'"retraced":true') == 1
        assert re.findall(rb'"test":"([0-9a-f]{16})"', warm) == [tag, tag]

    def test_changed_code_is_traced_again(self, reuse_chain: ReuseChain) -> None:
        """An edited body or method is another entry (a miss); an edited inlined helper or default argument is
        refused (torch's source checksums); a changed global or closure value fails a guard of the installed entry:
        each is traced as usual."""
        warm = reuse_chain.runs["warm"]
        c = _counters(warm)
        assert c["dynamo_refused_code_changed"] >= 2 and c["dynamo_refused_context_changed"] >= 2, c
        for test in ("test_body_edited", "test_inlined_helper_edited", "test_module_method_edited_and_mode",
                     "test_module_global_edited", "test_default_argument_changed", "test_closure_variable_changed",
                     "test_class_method_edited", "test_property_getter_edited", "test_class_in_local_scope",
                     "test_class_method_rebound_by_monkeypatch", "test_a_warning_of_a_class_made_in_a_function",
                     "test_a_compile_counter_backend",
                     "test_decorated_function_edited", "test_tensor_subclass_where_the_class_was",
                     "test_module_attribute_rebound", "test_another_compile_than_stored",
                     "test_decorator_instance_state_changed",
                     "test_a_configuration_patched_around_the_call"):
            assert _compiles(warm, test) > 0, test

    def test_what_is_reached_from_a_local_is_checked_at_load(self, reuse_chain: ReuseChain) -> None:
        """A class whose method was rebound (its source file unchanged, so torch's source checksums pass): the class
        that the stored entry's locals reach now is not the one traced, and the entry is refused."""
        c = _counters(reuse_chain.runs["warm"])
        assert c["dynamo_refused_class_changed"] + c["dynamo_refused_local_changed"] >= 1, c

    def test_a_frame_whose_trace_showed_a_warning_that_cannot_be_shown_again_is_never_stored(
            self, reuse_chain: ReuseChain) -> None:
        """A warning of a class no name finds in another process: taken from the store, the frame could not show the
        warning a test expects (one whose class is found again is shown again: the positive case)."""
        for name in ("cold", "warm"):
            run = reuse_chain.runs[name]
            assert _counters(run)["dynamo_refused_side_effect"] >= 1, name
            assert run.report is not None
            assert "cannot be shown again" in run.report["torch"]["dynamo_refusals"]["side_effect"], run.report["torch"]

    def test_a_graph_run_with_subclass_dispatch_off_is_installed_so(self, reuse_chain: ReuseChain) -> None:
        """Where Dynamo inlined a tensor subclass's ``__torch_function__``, torch runs the compiled graph with subclass
        dispatch off, but records and installs the bare graph: taken from the store so, the subclass handled each
        operation a second time (another result than eager). It is stored as torch ran it, and reused (the test
        compares it with eager)."""
        if tuple(map(int, importlib.metadata.version("torch").split(".")[:2])) < (2, 12):
            pytest.skip("torch 2.11 runs it with subclass dispatch on (the case is skipped in the sessions)")
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        assert (_compiles(cold, "test_subclass_dispatch_inlined"), _compiles(warm, "test_subclass_dispatch_inlined")) \
            == (1, 0)

    def test_a_variant_torch_fails_to_load_costs_that_variant_only(self, reuse_chain: ReuseChain) -> None:
        """One of an entry's two stored variants has guards torch cannot unpickle: that call is traced (and compared
        with eager), the other variant is still taken from the store."""
        assert reuse_chain.variant_corrupted
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        assert (_compiles(cold, "test_one_variant_of_two_corrupted"),
                _compiles(warm, "test_one_variant_of_two_corrupted")) == (2, 1)
        assert _counters(warm)["dynamo_refused_torch_error"] >= 1

    def test_reuse_is_installed_whole_where_dynamo_is_first_imported_inside_inductors_modules(
            self, reuse_chain: ReuseChain) -> None:
        """The sessions' test module imports Inductor's config before anything imports Dynamo, as a suite that sets
        Inductor's options does: Dynamo is first imported half way through Inductor's modules, where some of the
        modules reuse wraps cannot be imported yet. Reuse is turned on once that import is over, whole: a graph
        Inductor returns uncompiled, whose AOTAutograd entry torch cannot bundle, gets no entry (torch's assertion
        is a refusal) and its test passes, cold and warm. Installed half way, reuse lacked that repair and the
        assertion failed the test."""
        for name in ("cold", "warm"):
            run = reuse_chain.runs[name]
            assert run.report is not None and run.report["settings"]["dynamo_reuse"]["on"] is True, name
            frames = run.report["torch"]["dynamo_refused_frames"]
            assert [why for frame, why in frames.items() if frame.startswith("detached ")] \
                == ["no_backend, none stored, torch_error"], (name, frames)

    def test_a_frame_torch_stored_no_graph_for_is_counted_and_traced_then_its_backward_compiled(
            self, reuse_chain: ReuseChain) -> None:
        """A forward whose inputs require grad, in a test that never calls backward: torch stores its AOTAutograd
        entry only once the backward is compiled, so cold the frame has no stored graph; its variant is left out of
        what is written, counted with the reason (cold reuse spared nothing, so it pays for no backward). Warm, with
        time spared to pay for it, its backward is compiled where torch makes its lazy compiler: the graph is stored
        and the entry written again with its variant, beside its explanation's."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_a_forward_whose_backward_never_runs"
        assert (_compiles(cold, test), _compiles(warm, test)) == (2, 1)
        assert _counters(cold)["dynamo_refused_no_backend"] >= 1 and _counters(cold)["dynamo_backwards_compiled"] == 0
        assert cold.report is not None
        assert "no compiled graph" in cold.report["torch"]["dynamo_refusals"]["no_backend"], cold.report["torch"]
        assert _counters(warm)["dynamo_backwards_compiled"] >= 1, _counters(warm)
        assert warm.report is not None and warm.report["torch"]["dynamo_backwards"] > 0, warm.report["torch"]
        reasons = [why for frame, why in warm.report["torch"]["dynamo_refused_frames"].items()
                   if frame.startswith("forward_only ")]
        assert reasons == ["context_changed"], warm.report["torch"]["dynamo_refused_frames"]
        [cold_copy] = _copies(reuse_chain.after_cold, b"forward_only")
        [warm_copy] = _copies(reuse_chain.stored_precompile(), b"forward_only")
        variants = [len(_starts(data, b"megacache-guards-")) for data in (cold_copy, warm_copy)]
        assert variants[1] == variants[0] + 1, variants

    def test_by_default_a_backend_of_the_suites_own_is_called_in_every_run(self, reuse_chain: ReuseChain) -> None:
        """On by default, reuse covers torch's own backends only: a named function of the suite's own may count or
        record what it is given (the test asserts it was called), and a frame taken from the store never calls it. Its
        frames are traced in every run, refused as an unsupported backend; the sessions' settings say so."""
        test = "test_a_backend_of_the_suites_own"
        for name, run in reuse_chain.runs.items():
            assert _traces(run, test) == 1 and _counters(run)["dynamo_refused_unsupported_backend"] >= 1, name
            assert run.report is not None
            grounds = run.report["settings"]["dynamo_reuse"]
            assert grounds["on"] is True and grounds["backends"] == "torch's own", grounds
            assert grounds["why"].startswith("on by default"), grounds

    def test_a_frame_taken_from_the_store_leaves_torchs_record_of_its_shapes_as_its_trace_did(
            self, reuse_chain: ReuseChain) -> None:
        """torch notes the sizes each traced frame's inputs had, and marks a size dynamic where a later trace of the
        same code sees another one (automatic dynamic shapes). A frame taken from the store notes what its trace
        noted: the warm test's new sizes make one dynamic graph (the test asserts torch's graph count), as where the
        first call was traced, instead of a static graph and then a dynamic one; and that graph is what is traced."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_new_sizes_after_a_variant_taken_from_the_store"
        assert (_traces(cold, test), _traces(warm, test)) == (1, 1)
        assert (_graphs(cold, test), _graphs(warm, test)) == (1, 2)  # warm: the variant taken, then the dynamic graph
        # Where torch's record holds another size than where the stored variant was traced, the variant is not taken:
        # torch traces the static graph of the new size, then a dynamic one for the stored size (as without the
        # plugin), which the third size takes; taken, the static variant made the third size's trace a third graph.
        test = "test_a_stored_size_after_a_size_never_stored"
        assert (_traces(cold, test), _traces(warm, test)) == (1, 2), (_traces(cold, test), _traces(warm, test))
        assert (_graphs(cold, test), _graphs(warm, test)) == (1, 2)
        assert _counters(warm)["dynamo_refused_shapes_seen"] >= 1

    def test_a_rebound_global_is_refused(self, reuse_chain: ReuseChain) -> None:
        c = _counters(reuse_chain.runs["warm"])
        assert c["dynamo_refused_global_changed"] >= 1, c

    def test_an_installed_entry_still_guards_the_identity_of_a_global(self, reuse_chain: ReuseChain) -> None:
        """Cold traced two variants (before and after the rebinding); warm takes the one the binding of the moment
        proves, and after the test rebinds the global the other one, without tracing either: the guard on the
        global's identity is rebuilt on the object it names when the variant is taken, and the test compares each
        call with eager (the stale variant would have failed it)."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_global_function_rebound_after_a_call"
        assert (_compiles(cold, test), _compiles(warm, test)) == (2, 0)

    def test_a_frame_explained_is_taken_from_the_store_by_the_explanation(self, reuse_chain: ReuseChain) -> None:
        """``torch._dynamo.explain`` traces with a recorder of its own (graphs, operations, graph breaks, guards): its
        frames are stored, and where an explanation takes one, the stored graph is handed to that explanation's
        recorder and the stored guards to its record of guards. The test checks the explanation (its graphs'
        grad-mode calls, the break's reason and place) warm as cold, and the same code compiled after it."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_explained_then_compiled"
        assert _compiles(cold, test) >= 2 and _compiles(warm, test) == 0, (_compiles(cold, test), _compiles(warm, test))
        assert _traces(warm, test) == 0, _traces(warm, test)
        assert not any(frame.startswith("explained_then_compiled ")
                       for frame in (warm.report or {})["torch"]["dynamo_refused_frames"])

    def test_a_module_generated_at_run_time_is_installed_once_it_exists(self, reuse_chain: ReuseChain) -> None:
        """The functions are wrapped at import, before the module they call into is generated: the variants that
        need it are installed where they are about to be traced once the module is there, the others at once. One
        module is generated as it was cold (its function reused), one from another template (torch's source check
        refuses it: traced), and one function runs before its module exists too (the variant that needs no module
        taken at once, the one after the module appeared taken then)."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        assert _compiles(cold, "test_generated_module_unchanged") > 0
        assert _compiles(warm, "test_generated_module_unchanged") == 0
        assert _compiles(warm, "test_generated_module") > 0
        # called before its module exists (the variant that needs none taken), then after (the held-back one taken)
        test = "test_generated_module_called_before_it_exists"
        assert (_compiles(cold, test), _compiles(warm, test)) == (2, 0)
        assert _counters(warm)["dynamo_refused_missing_module"] == 0
        # nothing new traced: the entry is not written again
        name = b"compiled_before_and_after"
        stored = _copies(reuse_chain.after_cold, name)
        assert len(stored) == 1 and _copies(reuse_chain.stored_precompile(), name) == stored

    def test_a_resume_function_stored_without_variants_is_stored_once_its_frames_can_be(
            self, reuse_chain: ReuseChain) -> None:
        """After a graph break, a graph whose backward no test runs: cold, the resume function's only variant has no
        stored graph, and its code is stored bypassed beside the function's variants, one of which needs a module
        generated later. Warm, the function's frame is taken; the resume function's frame is traced with the
        backward compiled, and its variant is stored (neither a bypass loaded from the store nor the wait for the
        module keeps it out); the variant that needs the module is taken once the module is there."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_a_resume_function_whose_backward_never_runs"
        assert (_compiles(cold, test), _compiles(warm, test)) == (3, 1), (_compiles(cold, test), _compiles(warm, test))
        assert _counters(warm)["dynamo_backwards_compiled"] >= 1, _counters(warm)
        [cold_copy] = _copies(reuse_chain.after_cold, b"broken_then_graded")
        [warm_copy] = _copies(reuse_chain.stored_precompile(), b"broken_then_graded")
        variants = [len(_starts(data, b"megacache-guards-")) for data in (cold_copy, warm_copy)]
        assert variants[1] == variants[0] + 1, variants

    def test_a_new_variant_of_a_code_whose_variants_were_all_installed_is_stored_while_its_entry_waits(
            self, reuse_chain: ReuseChain) -> None:
        """A function with a graph break, one of whose variants needs a module generated later in the test: warm, its
        entry is installed without that variant, which waits for the module. The resume function's stored variant is
        installed, and its frame (a global only it reads changed) is traced: what it traces is a variant no stored
        one is, and is stored beside them (only the codes holding a variant that waits keep their new traces out).
        Once the module is there, the whole entry is installed as it was stored, and its held variant taken."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_a_resume_function_traced_again_while_its_entry_waits_for_a_module"
        assert (_compiles(cold, test), _compiles(warm, test)) == (3, 1), (_compiles(cold, test), _compiles(warm, test))
        # the whole entry installed once the module is there, though a graph was compiled into its codes before
        assert warm.report is not None
        [record] = [t for nodeid, t in warm.report["torch"]["per_test"].items() if nodeid.endswith(f"::{test}")]
        assert record["counters"]["dynamo_frames_reused"] == 2, record
        assert not any(name.startswith("dynamo_refused") for name in record["counters"]), record
        [cold_copy] = _copies(reuse_chain.after_cold, b"scaled_then_resumed")
        [warm_copy] = _copies(reuse_chain.stored_precompile(), b"scaled_then_resumed")
        variants = [len(_starts(data, b"megacache-guards-")) for data in (cold_copy, warm_copy)]
        assert variants == [3, 4], variants

    def test_a_variant_traced_before_another_wrapper_installs_the_entry_is_stored(self, reuse_chain: ReuseChain) -> None:
        """torch adds what a process traces to the entry a wrapper installed, in place. Where that entry was the one
        loaded from the store, and another wrapper of the function then loaded and installed it again, what the first
        one traced was taken for what the store held and left out of what was written: the variant was traced in every
        run. The loaded entry stays what the store held, and the warm entry holds both new variants beside it."""
        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        test = "test_a_variant_traced_before_another_wrapper_installs_the_entry"
        assert _compiles(cold, test) >= 1 and _compiles(warm, test) == 2, (_compiles(cold, test), _compiles(warm, test))
        [cold_copy] = _copies(reuse_chain.after_cold, b"traced_before_another_wrapper")
        [warm_copy] = _copies(reuse_chain.stored_precompile(), b"traced_before_another_wrapper")
        variants = [len(_starts(data, b"megacache-guards-")) for data in (cold_copy, warm_copy)]
        assert variants == [1, 3], variants

    def test_the_seconds_saved_count_the_dynamo_entries_taken(self, reuse_chain: ReuseChain) -> None:
        """Each stored variant carries what its trace and compile took (written at the session's end, outside any
        test, a Dynamo entry has no test to take a share of), and the part its trace alone took: a warm session
        counts saved what the variants it takes took cold less what reuse itself cost, and for the frames it traces
        again the backend's part of their graphs' hits less what those tests still spent in the backend. So the
        figure stays near what the warm run really spent less, and never claims reuse's own time as saved."""
        from pytest_megacache.dynamo import proofs as dp

        cold, warm = reuse_chain.runs["cold"], reuse_chain.runs["warm"]
        assert cold.report is not None and warm.report is not None
        objects = _objects(reuse_chain.project.path / "store")
        assert not [artifact for _path, header, _entries in objects
                    for artifact in (header.extra.get("cold_seconds") or {}) if artifact.startswith("precompile:")]
        variants = [dp.unpack_guards(entry.data[at:]) for _path, _header, entries in objects for entry in entries
                    if entry.kind == "torch/precompile" for at in _starts(entry.data, b"megacache-guards-")]
        assert len(variants) >= 10 and sum(v.seconds > 0 for v in variants) >= 10, [v.seconds for v in variants]
        # each with the part of its trace that its backend's compile did not take: less than the whole where Inductor
        # compiled it
        assert sum(0 < v.traced < v.seconds for v in variants) >= 10, [(v.traced, v.seconds) for v in variants]
        # against torch's own records of its frames' compiles (the project's conftest), not the plugin's: what the warm
        # run compiled less than the cold one, less what reuse itself cost it (offering, loading, installing: not
        # compiling), within what two runs' timings of one machine allow (a variant's seconds are timed inside torch's
        # timing of its frame, in the cold run; the hits' backend time is the warm tests' own)
        cold_seconds = cold.counters["compile_seconds"]
        torch_report = warm.report["torch"]
        saved, taken, cost = torch_report["seconds_saved"], torch_report["dynamo_spared"], torch_report["dynamo_cost"]
        spared = cold_seconds - warm.counters["compile_seconds"] - cost
        assert spared > 0 and taken > 0 and 0 < cost < taken, (taken, cost)
        assert 0 < torch_report["dynamo_tracing_spared"] < taken, torch_report  # the traces alone: part of it
        assert 0.8 * spared <= saved <= 1.15 * spared + 0.1, (saved, taken, cost, spared, cold_seconds)
        # taking the stored variants is a phase of its own, not the tests' time (cold: only looking for none)
        [cold_times], [warm_times] = ([p for p in run.report["processes"] if p["process"] == "main"] for run in (cold, warm))
        assert warm_times["reused"] > cold_times["reused"] > 0, (cold_times, warm_times)

    def test_the_report_says_what_was_reused_and_refused(self, reuse_chain: ReuseChain) -> None:
        """The report counts it, and torch prints nothing of its own about it: its warnings about caching
        precompile's bookkeeping (a frame not stored, a variant whose graph was not) never show in a session
        without the plugin."""
        warm = reuse_chain.runs["warm"]
        [line] = [line for line in warm.result.outlines if "Dynamo reuse" in line]
        assert "frames reused" in line and "code changed" in line and "global changed" in line, line
        assert _counters(reuse_chain.runs["cold"])["dynamo_refused_no_backend"] >= 1  # torch warns of it when it stores
        for name, run in reuse_chain.runs.items():
            printed = [line for line in run.result.outlines + run.result.errlines
                       if "Backend not found" in line or "Detected a package bypass" in line]
            assert printed == [], (name, printed)

    def test_an_entry_torch_fails_to_load_is_refused_contained_and_replaced(self, reuse_chain: ReuseChain) -> None:
        """An entry cut short inside a valid object: torch's loader fails on it and the frame is traced. It counts as
        refused, torch's logged traceback and the unraisable exceptions of its half-loaded graphs stay out of the
        session (which runs under -W error for them), and the fresh trace replaces it in the store at once."""
        warm = reuse_chain.runs["warm"]
        assert _counters(warm).get("dynamo_refused_load_failed") == 1, _counters(warm)
        assert _compiles(warm, "test_an_entry_cut_short") > 0
        assert not [line for line in warm.result.outlines + warm.result.errlines
                    if "Failed to load package" in line or "Unraisable" in line], warm.result.outlines[-40:]
        [line] = [line for line in warm.result.outlines if "Dynamo reuse" in line]
        assert "load failed 1" in line, line
        assert reuse_chain.corrupted is not None
        key, cut = reuse_chain.corrupted
        copies = [entries[key] for entries in reuse_chain.stored_precompile() if key in entries]
        assert copies and cut not in copies, "the entry torch failed to load is still stored"


RECORDED_ONCE = """
from torch._dynamo.precompile_context import EagerCacheArtifact, PrecompileContext

from pytest_megacache.dynamo.backends import backends_recorded_once, backends_recorded_where_written

RECORD = vars(PrecompileContext)["record_artifact"]

KEY, OTHER = "__compiled_fn_1_a", "__compiled_fn_2_b"
loads = []


class Base:  # torch's DynamoStore, as far as loading an entry goes: each entry holds one backend
    def load_cache_entry(self, key):
        loads.append(key)
        if key == "gone":
            raise FileNotFoundError(key)  # its file removed since it was installed
        PrecompileContext.record_artifact(EagerCacheArtifact(key=OTHER if key == "other" else KEY, content=[key]))
        return key


class Store(Base):  # torch's DiskDynamoCache: its load reaches the loading through super()
    def load(self, key):
        return super().load_cache_entry(key)


class Entry:  # a dynamo cache entry, as far as its backends go
    def __init__(self, *backend_ids, unchanged=False):
        self.backend_ids, self.unchanged = set(backend_ids), unchanged


class Package:  # torch's package module, as far as making up an entry for writing goes
    class PrecompileCacheEntry:
        @staticmethod
        def from_cache_entry(entry, backends):
            return {k: backends[k].content for k in entry.backend_ids}


store = Store()
stored = backends_recorded_once(store)
backends_recorded_where_written(Package, stored, lambda entry: entry.unchanged)
recorded = PrecompileContext._backend_artifacts_by_key
assert store.load("first") == "first" and store.load("again") == "again" and store.load("other") == "other"
assert KEY not in recorded and OTHER not in recorded  # loaded: not copied
make = Package.PrecompileCacheEntry.from_cache_entry
assert make(Entry(KEY, OTHER, unchanged=True), recorded) is None and loads == ["first", "again", "other"]
# written: the stored entry that holds each backend it calls is read again, and its backends recorded
assert make(Entry(KEY), recorded) == {KEY: ["again"]} and loads[3:] == ["again"]
assert make(Entry(KEY), recorded) == {KEY: ["again"]} and loads[4:] == []  # recorded now: not read again
PrecompileContext.record_artifact(EagerCacheArtifact(key=OTHER, content=["compiled"]))  # a compile's: recorded
assert make(Entry(OTHER), recorded) == {OTHER: ["compiled"]} and loads[4:] == []
# a stored entry that cannot be read again: the entry calling its backend is not written (the stored one stays)
stored.held_by["__compiled_fn_3_c"] = "gone"
assert make(Entry(OTHER, "__compiled_fn_3_c"), recorded) is None and loads[4:] == ["gone"]

# Reuse installed and removed in one process: every function of torch it replaced is torch's own again.
import torch._dynamo.config
import torch._dynamo.convert_frame
import torch._dynamo.package

from pytest_megacache import dynamo
from pytest_megacache.dynamo.patches import PATCHES

assert dynamo.uninstall() == 3 and vars(PrecompileContext)["record_artifact"] is RECORD  # the ones above
ours = (torch._dynamo.convert_frame, "_compile"), (torch._dynamo.package.CompilePackage, "install")
before = [vars(owner)[name] for owner, name in ours]
for _ in range(2):  # and again after removal
    assert dynamo.install(".") is None and torch._dynamo.config.caching_precompile
    assert [vars(owner)[name] for owner, name in ours] != before
    count = len(PATCHES)
    first = {}  # what each replaced attribute held before the first patch of it
    for p in PATCHES:
        first.setdefault((id(p.owner), p.name), (p.owner, p.name, None if p.inherited else p.original))
    assert len(first) >= 20
    assert dynamo.uninstall() == count and len(PATCHES) == 0
    assert [(owner, name) for owner, name, original in first.values()
            if (vars(owner).get(name) is not original if original is not None else name in vars(owner))] == []
    assert [vars(owner)[name] for owner, name in ours] == before and not torch._dynamo.config.caching_precompile

# Whole or not at all: a module reuse wraps that does not import (half initialized), or a wrapper that fails half way,
# leaves torch's own pieces and caching precompile off, and says why.
import importlib

from pytest_megacache.dynamo import repairs

import_module = importlib.import_module


def half_initialized(name, *args):
    if name == "torch._inductor.triton_bundler":
        raise ImportError("cannot import name 'X' from partially initialized module (a circular import)")
    return import_module(name, *args)


importlib.import_module = half_initialized
why = dynamo.install(".")
importlib.import_module = import_module
assert why is not None and "did not import" in why and len(PATCHES) == 0, why
assert not torch._dynamo.config.caching_precompile
sources_unpickle = repairs.sources_unpickle
repairs.sources_unpickle = lambda torch: 1 / 0  # after a dozen patches are in place
why = dynamo.install(".")
repairs.sources_unpickle = sources_unpickle
assert why is not None and "ZeroDivisionError" in why and len(PATCHES) == 0, why
assert [vars(owner)[name] for owner, name in ours] == before and not torch._dynamo.config.caching_precompile
assert dynamo.install(".") is None and dynamo.uninstall() > 20

# The plugin's other patches (pytest_megacache.patches), put in place as a session does and removed: torch's own
# callback lists (with a callback registered meanwhile), config values and vector-ISA subprocess again.
import subprocess

import torch._functorch.config
import torch._inductor.config
import torch._inductor.cpu_vec_isa

from pytest_megacache import isaprobe, patches
from pytest_megacache.torch_adapter import TorchAdapter

handler, inductor, functorch = torch._dynamo.callback.callback_handler, torch._inductor.config, torch._functorch.config
lists, threads = [handler.start_callbacks, handler.end_callbacks], inductor.compile_threads
adapter = TorchAdapter(lambda: None)
adapter.ensure_registered()
assert TorchAdapter.single_compile_thread({}) and TorchAdapter.enable_eager_backward() is None
assert isaprobe.install(torch._inductor.cpu_vec_isa) is None
assert inductor.compile_threads == 1 and functorch.force_non_lazy_backward_lowering
assert handler.start_callbacks is not lists[0] and handler.end_callbacks is not lists[1]
assert torch._inductor.cpu_vec_isa.subprocess is not subprocess
handler.start_callbacks.append(print)  # the user's, registered while ours are in place
adapter.uninstall()
assert patches.PATCHES.remove_all() == 5 and len(patches.PATCHES) == 0
assert handler.start_callbacks is lists[0] and handler.end_callbacks is lists[1] and lists[0] == [print]
assert inductor.compile_threads == threads and functorch.force_non_lazy_backward_lowering is False
assert torch._inductor.cpu_vec_isa.subprocess is subprocess

# A stored guard state whose module's own __setstate__ reads what torch left out of it (a placeholder where no guard
# reads) loads again, each module's state put in place as torch.nn.Module does; torch's error where that fails too.
import pickle

from torch._dynamo.guards import _Missing

from pytest_megacache.dynamo.repairs import guards_state_loaded


class Rebuilds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.table = {"k": 1}

    def __setstate__(self, state):
        self.table = dict(state["table"].items())
        super().__setstate__(state)


module = Rebuilds()
module.table = _Missing("left out")  # as torch pickles what no guard reads
data = pickle.dumps(module)
try:
    pickle.loads(data)
    raise AssertionError("the module's own __setstate__ ran past the placeholder")
except AttributeError:
    pass
loaded = guards_state_loaded(pickle.loads, data)
assert type(loaded) is Rebuilds and isinstance(loaded.table, _Missing) and torch.equal(loaded.lin.weight, module.lin.weight)
try:
    guards_state_loaded(pickle.loads, b"not a pickle")
    raise AssertionError("loaded")
except pickle.UnpicklingError:
    pass

# With reuse in place, torch's pickler of guard states stores such a module to be set as torch.nn.Module sets it:
# it loads in one pass of pickle's own loader, its __dict__ the traced one's; torch's own pickler's does not.
import collections
import io

from torch._dynamo.guards import GuardsStatePickler


def guard_state(module):
    buffer = io.BytesIO()
    GuardsStatePickler({id(module): module}, {}, {}, buffer).dump(module)
    return buffer.getvalue()


module = Rebuilds()
module.table = collections.UserDict(k=1)  # no guard reads it: torch stores a placeholder
plain, setstate = torch.nn.Linear(2, 2), torch.nn.Module.__setstate__
assert dynamo.install(".") is None
stored = guard_state(module)
torch.nn.Module.__setstate__ = lambda self, state: setstate(self, state)  # wrapped in place, as Dynamo does
try:
    assert b"module_state_set" in guard_state(module) and b"module_state_set" not in guard_state(plain)
finally:
    torch.nn.Module.__setstate__ = setstate
assert dynamo.uninstall() > 0
loaded = pickle.loads(stored)
assert type(loaded) is Rebuilds and isinstance(loaded.table, _Missing) and isinstance(loaded.lin, _Missing)
assert set(vars(loaded)) == set(vars(module)) - {"_compiled_call_impl"}
try:
    pickle.loads(guard_state(module))
    raise AssertionError("the module's own __setstate__ ran past the placeholder")
except AttributeError:
    pass
print("checked")
"""


def test_a_loaded_entrys_backends_are_recorded_only_where_it_is_written(tmp_path: Path) -> None:
    """torch deep-copies each backend of an entry it loads into its precompile context, for writing the entry again;
    a suite that wraps a function anew in each test loads its entry each time. A loaded backend is not copied: where
    an entry calling it is made up for writing, the stored entry holding it is read again (once), and an entry as it
    was installed is not made up at all; a backend a compile records is recorded as torch records it. Then reuse
    is installed and removed twice: each time every function of torch it replaced is torch's own again, and an install
    that cannot import or wrap one of torch's pieces leaves none replaced and says why; and the
    plugin's other patches (compile callbacks, config flags, the vector-ISA check) too. A guard state whose module's
    ``__setstate__`` fails on what torch left out loads again. (In a process of its own: torch's state.)"""
    import os
    import subprocess
    import sys

    script = tmp_path / "recorded_once.py"
    script.write_text(RECORDED_ONCE)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "checked", done.stderr[-2000:]
