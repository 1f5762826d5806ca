"""The "varied" benchmark workload: a generated pytest module with many small compiled functions of varied kinds.

The ``synthetic`` workload of run.py is pointwise chains only; a real third-party test suite compiles many small
graphs of many kinds (reductions, norms, matmuls, modules, training steps, view ops, graph breaks, dynamic shapes,
in-place and ``out=`` ops, broadcasting, scans). Function ``i`` gets kind ``KINDS[i % len(KINDS)]`` and bakes its own
constants (and slightly varied small shapes) into its graph, so no two functions share an FX graph key. Each test
seeds torch, builds its inputs on ``DEVICE``, compiles afresh with ``torch.compile`` and compares with eager.

Standard library only: run.py (or anyone) imports this to write the project; torch is only in the generated module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

PYTEST_INI = "[pytest]\nfilterwarnings =\n    ignore:Failed to initialize NumPy:UserWarning\n"
TEST_FILE = "test_varied.py"

# Unary ops the pointwise kind chains (as run.py's synthetic workload does).
_UNARY = ("torch.sin", "torch.cos", "torch.tanh", "torch.sigmoid", "torch.erf", "torch.relu")


class _Case:
    """Function ``i``: its index within its kind (``j``, to vary ops and shapes) and its own float constants."""

    def __init__(self, i: int, kinds: int) -> None:
        self.i = i
        self.j = i // kinds
        self.k1 = repr(1 + (i + 1) / 1000)
        self.k2 = repr(0.25 + i / 997)
        self.k3 = repr(0.5 + i / 991)


# Each kind writes (the definitions for function i, the body of its test after torch.manual_seed(i)).
_Gen = Callable[[_Case], tuple[list[str], list[str]]]
_ASSERT = "torch.testing.assert_close({}, {}, atol=TOL, rtol=TOL)"


def _check(got: str, want: str, indent: int = 4) -> str:
    return " " * indent + _ASSERT.format(got, want)


def _one_input(c: _Case, lines: list[str], shape: str) -> tuple[list[str], list[str]]:
    """``def f_i(x):`` with these body lines, and a test on ``torch.randn(shape)``."""
    defs = [f"def f_{c.i}(x):", *(f"    {line}" for line in lines)]
    body = [f"    x = torch.randn({shape}, device=DEVICE)", _check(f"torch.compile(f_{c.i})(x)", f"f_{c.i}(x)")]
    return defs, body


def _pointwise(c: _Case) -> tuple[list[str], list[str]]:
    a, b = _UNARY[c.j % len(_UNARY)], _UNARY[(c.j + 2) % len(_UNARY)]
    return _one_input(c, [f"y = {a}(x * {c.k1}) + torch.cos(x) * {c.k2}",
                          f"return {b}(y - {c.k3}) * torch.tanh(y)"], f"{64 + 8 * (c.j % 4)}")


def _reduction(c: _Case) -> tuple[list[str], list[str]]:
    dim = c.j % 2
    return _one_input(c, [f"y = x * {c.k1}",
                          f"return y.sum(dim={dim}) * {c.k2} + y.mean(dim={dim}) - y.amax(dim={dim}) * {c.k3}"],
                      f"{6 + c.j % 3}, {16 + 4 * (c.j % 3)}")


def _softmax_norm(c: _Case) -> tuple[list[str], list[str]]:
    cols = 16 + 8 * (c.j % 3)
    eps = repr(1e-5 + c.i * 1e-8)
    defs = [f"def f_{c.i}(x, w, b):",
            f"    y = torch.softmax(x * {c.k1}, dim=-1)",
            f"    return torch.nn.functional.layer_norm(y + torch.sigmoid(x) * {c.k2}, ({cols},), w, b, eps={eps})"]
    body = [f"    x = torch.randn({4 + c.j % 4}, {cols}, device=DEVICE)",
            f"    w = torch.randn({cols}, device=DEVICE)",
            f"    b = torch.randn({cols}, device=DEVICE)",
            _check(f"torch.compile(f_{c.i})(x, w, b)", f"f_{c.i}(x, w, b)")]
    return defs, body


def _matmul(c: _Case) -> tuple[list[str], list[str]]:
    n_in, n_out = 16 + 4 * (c.j % 3), 8 + 4 * (c.j % 2)
    defs = [f"def f_{c.i}(x, w, b):",
            f"    return torch.relu(torch.matmul(x * {c.k1}, w) + b) * {c.k2}"]
    body = [f"    x = torch.randn({4 + c.j % 3}, {n_in}, device=DEVICE)",
            f"    w = torch.randn({n_in}, {n_out}, device=DEVICE)",
            f"    b = torch.randn({n_out}, device=DEVICE)",
            "    with torch.no_grad():",
            _check(f"torch.compile(f_{c.i})(x, w, b)", f"f_{c.i}(x, w, b)", 8)]
    return defs, body


def _mlp(c: _Case) -> tuple[list[str], list[str]]:
    n_in, hidden, n_out = 12 + 4 * (c.j % 2), 24 + 8 * (c.j % 3), 6
    defs = [f"class Mlp_{c.i}(torch.nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            f"        self.fc1 = torch.nn.Linear({n_in}, {hidden})",
            f"        self.fc2 = torch.nn.Linear({hidden}, {n_out})",
            "",
            "    def forward(self, x):",
            f"        return self.fc2(torch.nn.functional.gelu(self.fc1(x)) * {c.k1}) + {c.k2}"]
    body = [f"    model = Mlp_{c.i}().to(DEVICE).eval()",
            f"    x = torch.randn({3 + c.j % 4}, {n_in}, device=DEVICE)",
            "    with torch.no_grad():",
            _check("torch.compile(model)(x)", "model(x)", 8)]
    return defs, body


def _train_step(c: _Case) -> tuple[list[str], list[str]]:
    n_in, hidden, n_out = 8 + 2 * (c.j % 3), 16, 4
    defs = [f"class Net_{c.i}(torch.nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            f"        self.fc1 = torch.nn.Linear({n_in}, {hidden})",
            f"        self.fc2 = torch.nn.Linear({hidden}, {n_out})",
            "",
            "    def forward(self, x):",
            f"        return self.fc2(torch.tanh(self.fc1(x)) * {c.k1})",
            "",
            "",
            f"def f_{c.i}(model, x, t):",
            f"    return torch.nn.functional.mse_loss(model(x), t) * {c.k2}"]
    body = [f"    model = Net_{c.i}().to(DEVICE)",
            "    ref = copy.deepcopy(model)",
            f"    x = torch.randn({4 + c.j % 3}, {n_in}, device=DEVICE)",
            f"    t = torch.randn({4 + c.j % 3}, {n_out}, device=DEVICE)",
            f"    loss = torch.compile(f_{c.i})(model, x, t)",
            "    loss.backward()",
            f"    ref_loss = f_{c.i}(ref, x, t)",
            "    ref_loss.backward()",
            "    torch.testing.assert_close(loss, ref_loss, atol=TRAIN_TOL, rtol=TRAIN_TOL)",
            "    for (name, p), q in zip(model.named_parameters(), ref.parameters()):",
            "        assert p.grad is not None, name",
            "        torch.testing.assert_close(p.grad, q.grad, atol=TRAIN_TOL, rtol=TRAIN_TOL)"]
    return defs, body


def _views(c: _Case) -> tuple[list[str], list[str]]:
    rows, cols = 4 + 2 * (c.j % 2), 6 + 2 * (c.j % 3)
    return _one_input(c, [f"y = (x * {c.k1}).reshape({cols}, {rows}).permute(1, 0)",
                          f"z = torch.cat([y, y[:, :2] + {c.k2}], dim=1)",
                          f"w = z[1:, ::2].unsqueeze(0).expand(2, -1, -1).transpose(1, 2).flatten(1) * {c.k3}",
                          "return w, z[[0, -1]], x.view(-1)[::3]"], f"{rows}, {cols}")


def _graph_break(c: _Case) -> tuple[list[str], list[str]]:
    defs = [f"USE_SIN_{c.i} = {c.j % 2 == 0}",
            "",
            "",
            f"def f_{c.i}(x):",
            f"    y = x * {c.k1}",
            f"    if USE_SIN_{c.i}:  # a Python branch on a constant: Dynamo traces one side only",
            f"        y = torch.sin(y) + {c.k2}",
            "    else:",
            f"        y = torch.cos(y) - {c.k2}",
            "    torch._dynamo.graph_break()  # two graphs: before and after",
            f"    return torch.tanh(y) * {c.k3}"]
    body = [f"    x = torch.randn({32 + 8 * (c.j % 3)}, device=DEVICE)",
            _check(f"torch.compile(f_{c.i})(x)", f"f_{c.i}(x)")]
    return defs, body


def _dynamic_mark(c: _Case) -> tuple[list[str], list[str]]:
    rows, cols = 5 + c.j % 3, 8 + 4 * (c.j % 2)
    defs = [f"def f_{c.i}(x):",
            f"    y = torch.tanh(x * {c.k1}) + {c.k2}",
            f"    return y / x.shape[0] + y.sum(dim=0) * {c.k3}"]
    body = [f"    compiled = torch.compile(f_{c.i})",
            f"    for rows in ({rows}, {rows + 3}):  # one graph, dynamic in dim 0",
            f"        x = torch.randn(rows, {cols}, device=DEVICE)",
            "        torch._dynamo.mark_dynamic(x, 0)",
            _check("compiled(x)", f"f_{c.i}(x)", 8)]
    return defs, body


def _dynamic_auto(c: _Case) -> tuple[list[str], list[str]]:
    n = 24 + 4 * (c.j % 3)
    defs = [f"def f_{c.i}(x):",
            f"    y = torch.sigmoid(x * {c.k1}) - {c.k2}",
            f"    return y * y.mean() + x.shape[0] * {c.k3}"]
    body = [f"    compiled = torch.compile(f_{c.i})",
            f"    for n in ({n}, {n + 5}):  # a static graph, then a recompile with dim 0 dynamic",
            "        x = torch.randn(n, device=DEVICE)",
            _check("compiled(x)", f"f_{c.i}(x)", 8)]
    return defs, body


def _inplace_out(c: _Case) -> tuple[list[str], list[str]]:
    defs = [f"def f_{c.i}(x, out):",
            "    y = x.clone()",
            f"    y.mul_({c.k1}).add_({c.k2})",
            f"    y.clamp_(min=-{c.k3})",
            "    torch.sigmoid(y, out=out)",
            f"    out.mul_({c.k3})",
            "    return y"]
    body = [f"    x = torch.randn({48 + 8 * (c.j % 3)}, device=DEVICE)",
            "    before = x.clone()",
            "    out, ref_out = torch.empty_like(x), torch.empty_like(x)",
            _check(f"torch.compile(f_{c.i})(x, out)", f"f_{c.i}(x, ref_out)"),
            _check("out", "ref_out"),
            "    assert torch.equal(x, before)"]
    return defs, body


def _broadcast(c: _Case) -> tuple[list[str], list[str]]:
    rows, cols = 4 + c.j % 3, 8 + 4 * (c.j % 2)
    b_shape = f"1, {cols}" if c.j % 2 == 0 else f"{rows}, 1"
    defs = [f"def f_{c.i}(x, b):",
            f"    return torch.maximum(x * {c.k1}, b) + b * {c.k2} - x / (b.abs() + 1.0) + {c.k3}"]
    body = [f"    x = torch.randn({rows}, {cols}, device=DEVICE)",
            f"    b = torch.randn({b_shape}, device=DEVICE)",
            _check(f"torch.compile(f_{c.i})(x, b)", f"f_{c.i}(x, b)")]
    return defs, body


def _cumsum_where(c: _Case) -> tuple[list[str], list[str]]:
    dim = c.j % 2
    bound = repr(2 + c.i / 1009)
    return _one_input(c, [f"s = torch.cumsum(x * {c.k1}, dim={dim})",
                          f"return torch.where(s > {c.k2}, s, s * {c.k3}).clamp(min=-{bound}, max={bound})"],
                      f"{5 + c.j % 3}, {12 + 4 * (c.j % 2)}")


_GENERATORS: dict[str, _Gen] = {
    "pointwise": _pointwise,
    "reduction": _reduction,
    "softmax_norm": _softmax_norm,
    "matmul": _matmul,
    "mlp": _mlp,
    "train_step": _train_step,
    "views": _views,
    "graph_break": _graph_break,
    "dynamic_mark": _dynamic_mark,
    "dynamic_auto": _dynamic_auto,
    "inplace_out": _inplace_out,
    "broadcast": _broadcast,
    "cumsum_where": _cumsum_where,
}
KINDS: tuple[str, ...] = tuple(_GENERATORS)


def varied_source(n: int, device: str) -> str:
    """The test module: function ``i`` of kind ``KINDS[i % len(KINDS)]``, its test ``test_<kind>_<i>``."""
    out = ["import copy", "", "import torch", "", f"DEVICE = {device!r}", "TOL = 1e-4", "TRAIN_TOL = 1e-4", ""]
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        defs, body = _GENERATORS[kind](_Case(i, len(KINDS)))
        out += ["", *defs, "", "", f"def test_{kind}_{i}():", f"    torch.manual_seed({i})", *body, ""]
    return "\n".join(out) + "\n"


def make_varied_project(base: Path, n: int, device: str) -> tuple[Path, list[str], Path]:
    """Writes ``base/varied-<n>`` (pytest.ini and test_varied.py); returns (project, pytest args, ini file)."""
    source = varied_source(n, device)
    compile(source, TEST_FILE, "exec")  # a generator bug fails here, loudly, before anything is written
    project = base / f"varied-{n}"
    project.mkdir(parents=True, exist_ok=True)
    (project / "pytest.ini").write_text(PYTEST_INI)
    (project / TEST_FILE).write_text(source)
    return project, [TEST_FILE], project / "pytest.ini"


SHORT_FILE = "test_short.py"
SHORT_SIZES = (16, 24, 40, 56)  # each function's tests: one size each, compiled static (one variant per size)


def short_source(functions: int, device: str) -> str:
    """The "short" workload's module: many small functions, each tested at every size of :data:`SHORT_SIZES`, each
    test short and compiling its function afresh after ``torch._dynamo.reset()`` (as a suite that isolates its tests
    does); ``dynamic=False``, so each size is a variant of its own, and a function's stored entry holds one per size."""
    out = ["import pytest", "import torch", "", f"DEVICE = {device!r}", f"SIZES = {SHORT_SIZES!r}", "TOL = 1e-4", "",
           "", "@pytest.fixture(autouse=True)", "def fresh_compile_state():", "    torch._dynamo.reset()", "    yield", ""]
    for i in range(functions):
        c = _Case(i, 3)
        a, b = _UNARY[i % len(_UNARY)], _UNARY[(i + 3) % len(_UNARY)]
        body = ([f"y = {a}(x * {c.k1}) + x * {c.k2}", f"return {b}(y) - {c.k3}"],
                [f"y = x * {c.k1} - {c.k2}", f"return y.sum(dim=1, keepdim=True) * {c.k3} + y.amax(dim=1, keepdim=True)"],
                [f"return torch.softmax(x * {c.k1}, dim=-1) * {c.k2} + {c.k3}"])[i % 3]
        out += ["", f"def f_{i}(x):", *(f"    {line}" for line in body), "", "",
                "@pytest.mark.parametrize('n', SIZES)", f"def test_f_{i}(n):", f"    torch.manual_seed({i})",
                "    x = torch.randn(n, 8, device=DEVICE)",
                f"    torch.testing.assert_close(torch.compile(f_{i}, dynamic=False)(x), f_{i}(x), atol=TOL, rtol=TOL)",
                ""]
    return "\n".join(out) + "\n"


def make_short_project(base: Path, functions: int, device: str) -> tuple[Path, list[str]]:
    """Writes ``base/short-<functions>`` (pytest.ini and test_short.py); returns (project, pytest args)."""
    source = short_source(functions, device)
    compile(source, SHORT_FILE, "exec")
    project = base / f"short-{functions}"
    project.mkdir(parents=True, exist_ok=True)
    (project / "pytest.ini").write_text(PYTEST_INI)
    (project / SHORT_FILE).write_text(source)
    return project, [SHORT_FILE]
