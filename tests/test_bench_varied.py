"""The "varied" benchmark workload (benchmarks/varied.py): the generated module is valid, one test per function,
every kind present, no two functions alike (so no two share an FX graph key), and its tests pass when
torch.compile is the identity and fail when the "compiled" result is wrong. Eager only: no torch.compile here."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
N = 120


@pytest.fixture(scope="module")
def varied() -> ModuleType:
    return load_benchmark("varied.py")


def top_level(source: str) -> list[ast.stmt]:
    return ast.parse(source).body


def names_of_tests(source: str) -> list[str]:
    return [node.name for node in top_level(source) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def test_source_compiles_with_one_test_per_function_of_its_kind(varied: ModuleType) -> None:
    source = varied.varied_source(N, "cpu")
    compile(source, "test_varied.py", "exec")
    names = names_of_tests(source)
    assert len(names) == N
    kinds = varied.KINDS
    assert names == [f"test_{kinds[i % len(kinds)]}_{i}" for i in range(N)]
    assert "DEVICE = 'cpu'" in source
    assert "DEVICE = 'cuda'" in varied.varied_source(3, "cuda")


def test_every_kind_is_covered(varied: ModuleType) -> None:
    kinds = varied.KINDS
    assert len(kinds) >= 10
    assert len(set(kinds)) == len(kinds)
    covered = {re.fullmatch(r"test_(\w+)_\d+", name).group(1) for name in names_of_tests(varied.varied_source(N, "cpu"))}  # type: ignore[union-attr]
    assert covered == set(kinds)


def test_every_function_is_different(varied: ModuleType) -> None:
    """What each test compiles (its functions, classes and constants), with the index taken out of the names,
    differs from every other's: each function has its own constants, hence its own FX graph key."""
    source = varied.varied_source(N, "cpu")
    parts: dict[int, list[str]] = {}
    for node in top_level(source):
        names = [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
        for name in names:
            found = re.fullmatch(r"(?!test_)\w+_(\d+)", name)
            if found:
                i = int(found.group(1))
                parts.setdefault(i, []).append(re.sub(rf"_{i}\b", "_N", ast.unparse(node)))
    assert sorted(parts) == list(range(N))
    texts = ["\n".join(p) for p in parts.values()]
    assert len(set(texts)) == N
    floats = [{n.value for n in ast.walk(ast.parse(t)) if isinstance(n, ast.Constant) and isinstance(n.value, float)}
              for t in texts]
    assert all(floats), "every function bakes in float constants of its own"
    assert len({frozenset(f) for f in floats}) == N


def test_make_varied_project_writes_the_project(varied: ModuleType, tmp_path: Path) -> None:
    project, args, ini = varied.make_varied_project(tmp_path, 5, "cpu")
    assert project == tmp_path / "varied-5"
    assert args == ["test_varied.py"]
    assert ini == project / "pytest.ini"
    assert ini.read_text() == "[pytest]\nfilterwarnings =\n    ignore:Failed to initialize NumPy:UserWarning\n"
    assert (project / "test_varied.py").read_text() == varied.varied_source(5, "cpu")


def test_a_generator_bug_fails_before_anything_is_written(varied: ModuleType, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varied, "varied_source", lambda n, device: "def test_x(:\n    pass\n")
    with pytest.raises(SyntaxError):
        varied.make_varied_project(tmp_path, 5, "cpu")
    assert not (tmp_path / "varied-5").exists()


# Runs every test of the module twice in one torch process: with torch.compile the identity (all must pass), and
# with a torch.compile whose result sees its first tensor argument shifted by 0.5 (all must fail: each test
# really compares the compiled result with eager).
EAGER_RUNNER = textwrap.dedent(
    """
    import json, sys
    import torch

    def identity(fn=None, **kwargs):
        return fn

    def shifted(fn=None, **kwargs):
        def call(*args, **kw):
            args = list(args)
            for n, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    args[n] = a + 0.5
                    break
            return fn(*args, **kw)
        return call

    path = sys.argv[1]
    code = compile(open(path).read(), path, "exec")
    results = {}
    for mode, fake in (("identity", identity), ("shifted", shifted)):
        torch.compile = fake
        namespace = {"__name__": "test_varied"}
        exec(code, namespace)
        outcomes = results[mode] = {}
        for name, test in namespace.items():
            if name.startswith("test_"):
                try:
                    test()
                    outcomes[name] = "passed"
                except AssertionError:
                    outcomes[name] = "failed"
                except Exception as e:
                    outcomes[name] = f"error: {type(e).__name__}: {e}"
    print(json.dumps(results))
    """
)


def test_generated_tests_pass_eagerly_and_catch_a_wrong_result(varied: ModuleType, tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    n = 2 * len(varied.KINDS)
    project, args, _ = varied.make_varied_project(tmp_path, n, "cpu")
    proc = subprocess.run([sys.executable, "-c", EAGER_RUNNER, str(project / args[0])], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    names = names_of_tests(varied.varied_source(n, "cpu"))
    assert results["identity"] == dict.fromkeys(names, "passed")
    assert results["shifted"] == dict.fromkeys(names, "failed")


def test_the_short_workload_compiles_each_function_afresh_at_every_size(varied: ModuleType, tmp_path: Path) -> None:
    """The "short" workload: one test per function and size, Dynamo's caches reset before each, compiled static (so a
    function's stored entry holds a variant per size), and every function different from the others."""
    source = varied.short_source(6, "cuda")
    tree = ast.parse(source)
    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert [t.name for t in tests] == [f"test_f_{i}" for i in range(6)]
    for test in tests:
        [mark] = test.decorator_list
        assert ast.unparse(mark) == "pytest.mark.parametrize('n', SIZES)"
        assert "dynamic=False" in ast.unparse(test)
    assert "torch._dynamo.reset()" in source and "DEVICE = 'cuda'" in source and len(varied.SHORT_SIZES) >= 3
    bodies = [ast.unparse(n).replace(f"f_{n.name[2:]}", "f") for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name.startswith("f_")]
    assert len(bodies) == 6 and len(set(bodies)) == 6
    project, args = varied.make_short_project(tmp_path, 6, "cpu")
    assert args == ["test_short.py"] and (project / "test_short.py").read_text() == varied.short_source(6, "cpu")
