"""The environment fingerprint: a readable key, sensitive to what changes compiled code and nothing else."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_megacache import envpolicy, fingerprint
from pytest_megacache.fingerprint import Fingerprint, TorchInfo, TorchUnavailable

REPO = Path(__file__).resolve().parents[1]
CPU_TORCH = TorchInfo(version="2.13.0+cpu", git_version="cf30153c", cuda=None, hip=None, path=Path("/nowhere/torch"))
PY = f"py{sys.version_info[0]}.{sys.version_info[1]}"

KEY_RE = re.compile(
    r"torch-(?P<torch>[^/]+)/cpu-(?P<isa>[a-z0-9.+_\-]+)-t(?P<threads>\d+)/"
    r"py(?P<py>\d+\.\d+)-(?P<platform>[a-z0-9]+-[a-z0-9.+_\-]+)/(?P<digest>[0-9a-f]{12})"
)


@pytest.fixture(autouse=True)
def _no_thread_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def compute(env: dict[str, str] | None = None, torch: TorchInfo = CPU_TORCH) -> Fingerprint:
    return fingerprint.compute(env=env or {}, torch=torch)


# --- the key -----------------------------------------------------------------------------------------


def test_key_has_readable_segments() -> None:
    fp = compute()
    match = KEY_RE.fullmatch(fp.key)
    assert match, fp.key
    assert match["torch"] == "2.13.0+cpu"
    assert match["py"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert match["platform"].startswith(sys.platform + "-")
    assert match["isa"] == fp.parts["cpu_isa"]
    threads = fp.parts["threads"]
    assert isinstance(threads, int) and threads >= 1
    assert int(match["threads"]) == threads
    assert match["digest"] == fp.digest
    assert fp.key.split("/")[2] == f"{PY}-{fp.parts['platform']}"


def test_key_is_deterministic() -> None:
    assert compute({"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}).key == compute({"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}).key


def test_digest_covers_every_part() -> None:
    fp = compute()
    changed = Fingerprint({**fp.parts, "torch_git": "other"})
    assert changed.digest != fp.digest
    assert changed.key.rsplit("/", 1)[0] == fp.key.rsplit("/", 1)[0]


@pytest.mark.parametrize(
    "var", ["TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_FREEZING", "TORCH_COMPILE_CPROFILE", "TRITON_F32_DEFAULT",
            "TORCHDYNAMO_DYNAMIC_SHAPES"],
)
def test_compile_settings_change_the_digest(var: str) -> None:
    base = compute()
    changed = compute({var: "1"})
    assert changed.digest != base.digest
    assert changed.parts["env"] == {var: "1"}
    assert compute({var: "0"}).digest not in (base.digest, changed.digest)


def test_the_precompiled_header_is_left_to_torch_and_keyed() -> None:
    """The plugin leaves Inductor's precompiled header as the user has it (torch's default: on), sets nothing,
    and a user who turns it off gets another key (the kernels' compile command differs)."""
    assert "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS" not in compute({}).parts["env"]  # type: ignore[operator]
    assert compute({}).key != compute({"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}).key


# --- environment values: shown only when known harmless ------------------------------------------------

REDIS_URL = "redis://ci:Sup3rS3cretPassw0rd@redis.example:6379/0"
HIDDEN_RE = re.compile(r"hidden:[0-9a-f]{16}")


@pytest.mark.parametrize(
    ("var", "value"),
    [("TORCHINDUCTOR_MAX_AUTOTUNE", "1"), ("TORCHINDUCTOR_FREEZING", "0"),
     ("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN,TRITON,CPP"), ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1"),
     ("TORCH_COMPILE_DYNAMIC_VALUES", "1111,2222"), ("TRITON_F32_DEFAULT", "tf32x3"),
     ("TORCHINDUCTOR_CPP_MARCH", "x86-64-v3"), ("TORCHDYNAMO_REPRO_AFTER", "aot")],
)
def test_allowlisted_settings_show_their_value(var: str, value: str) -> None:
    assert compute({var: value}).parts["env"] == {var: value}


@pytest.mark.parametrize(
    ("var", "value"),
    [("TORCHINDUCTOR_REDIS_URL", REDIS_URL),  # torch's remote cache endpoint
     ("TORCHINDUCTOR_REDIS_PASSWORD", "hunter2hunter2"),  # unknown name: hidden even if the value looks plain
     ("TORCH_COMPILE_CACHE_KEY_TAG", "team-secret-tag"),  # free text
     ("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "ATEN,https://u:pw@host"),  # allowlisted, odd value
     ("TORCHINDUCTOR_MAX_AUTOTUNE", "1" * 65),  # allowlisted, too long to be a flag
     ("TRITON_LIBDEVICE_PATH", "/opt/secret-project/libdevice.bc")],  # a path
)
def test_other_values_are_hidden_behind_a_digest(var: str, value: str) -> None:
    fp = compute({var: value})
    env = fp.parts["env"]
    assert isinstance(env, dict)
    assert set(env) == {var}  # the name is still there
    assert HIDDEN_RE.fullmatch(env[var]), env
    everything = json.dumps(fp.parts) + fp.key + fp.digest
    for piece in (value, *re.split(r"[:/@,]+", value)):
        if len(piece) >= 4:
            assert piece not in everything


def test_a_secret_never_reaches_parts_or_key() -> None:
    fp = compute({"TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    blob = json.dumps({"key": fp.key, **fp.parts}, sort_keys=True)
    assert "Sup3rS3cretPassw0rd" not in blob and "redis.example" not in blob
    assert "TORCHINDUCTOR_REDIS_URL" in blob and '"TORCHINDUCTOR_MAX_AUTOTUNE": "1"' in blob


def test_a_hidden_value_still_changes_the_key() -> None:
    one = compute({"TORCHINDUCTOR_REDIS_URL": REDIS_URL})
    other = compute({"TORCHINDUCTOR_REDIS_URL": REDIS_URL.replace("Passw0rd", "Passw1rd")})
    unset = compute()
    assert len({one.key, other.key, unset.key}) == 3
    assert one.key.rsplit("/", 1)[0] == other.key.rsplit("/", 1)[0]  # only the trailing digest differs


def test_hidden_values_are_stable() -> None:
    env = {"TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TORCHINDUCTOR_FREEZING": "1", "TRITON_HOME": "/x"}
    assert compute(env).key == compute(dict(env)).key
    assert compute(env).parts == compute(dict(reversed(env.items()))).parts


def test_hidden_digests_are_domain_separated() -> None:
    """The same value under two names gives two digests: a digest says nothing about another variable."""
    env = compute({"TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TORCHINDUCTOR_REDIS_HOST_URL": REDIS_URL}).parts["env"]
    assert isinstance(env, dict)
    assert env["TORCHINDUCTOR_REDIS_URL"] != env["TORCHINDUCTOR_REDIS_HOST_URL"]
    assert hashlib.sha256(REDIS_URL.encode()).hexdigest()[:16] not in json.dumps(env)


def test_stored_differences_name_the_variable_without_its_value() -> None:
    """What the 'nothing was restored' diagnosis can say about env: the differing names, digests for hidden
    values, and never a raw value an older version stored."""
    here = compute({"TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}).parts["env"]
    old_style = {"TORCHINDUCTOR_REDIS_URL": "redis://ci:0ldPassw0rd@redis.example:6379/0",
                 "TORCHINDUCTOR_FREEZING": "1"}
    assert isinstance(here, dict)
    lines = envpolicy.env_differences(old_style, here)
    text = "\n".join(lines)
    assert [line.split()[0] for line in lines] == [
        "TORCHINDUCTOR_FREEZING", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_REDIS_URL"]
    assert "TORCHINDUCTOR_FREEZING '1' here unset" in lines
    assert "TORCHINDUCTOR_MAX_AUTOTUNE unset here '1'" in lines
    assert "0ldPassw0rd" not in text and "Sup3rS3cretPassw0rd" not in text and "redis.example" not in text
    assert HIDDEN_RE.search(lines[-1])


def test_only_harmless_values_are_allowlisted() -> None:
    """Every allowlisted name is a compiler setting (keyed), and none of them names an endpoint or a secret."""
    for name in envpolicy.SHOWN_VALUES:
        assert name.startswith(fingerprint.ENV_PREFIXES) and name not in fingerprint.ENV_IGNORED, name
        assert not re.search(r"URL|_HOST$|_PORT$|PASSW|SECRET|TOKEN|_KEY|CRED|_DIR$|_PATH$|REGEX|USERNAME|_USER$", name), name


@pytest.mark.parametrize(
    "var", ["TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS", "TORCH_COMPILE_JOB_ID",
            "HOME", "PATH", "CI", "MEGACACHE_BUCKET"],
)
def test_paths_and_unrelated_variables_do_not_change_the_key(var: str) -> None:
    base = compute({"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert compute({"TORCHINDUCTOR_MAX_AUTOTUNE": "1", var: "/some/where/else"}).key == base.key


def test_omp_num_threads_sets_the_thread_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    three = compute()
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    five = compute()
    assert "-t3/" in three.key
    assert "-t5/" in five.key
    assert three.digest != five.digest


@pytest.mark.parametrize("omp", ["0", "abc", "", "-2"])
def test_bad_omp_num_threads_is_ignored(monkeypatch: pytest.MonkeyPatch, omp: str) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert fingerprint.thread_count(6) == 6


def test_thread_count_falls_back_to_the_affinity_mask() -> None:
    assert fingerprint.thread_count(None) >= 1
    assert fingerprint.thread_count(4) == 4


def test_cuda_torch_keys_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint, "gpu_names", lambda: ["NVIDIA H100 80GB HBM3"])
    cuda_torch = TorchInfo("2.11.0+cu130", "abc", "13.0", None, Path("/nowhere"))
    fp = compute(torch=cuda_torch)
    assert fp.key.startswith("torch-2.11.0+cu130/cuda13.0-nvidia-h100-80gb-hbm3/")
    assert fp.parts["gpus"] == ["NVIDIA H100 80GB HBM3"]
    hidden = compute({"CUDA_VISIBLE_DEVICES": ""}, torch=cuda_torch)
    assert hidden.key.split("/")[1].startswith("cpu-")


def test_cpu_torch_never_probes_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> list[str]:
        raise AssertionError("gpu_names called for a CPU-only torch")

    monkeypatch.setattr(fingerprint, "gpu_names", boom)
    assert compute().parts["gpus"] == []


@pytest.mark.parametrize(
    ("flags", "isa"),
    [({"avx2", "avx512f", "avx512_bf16"}, "avx512bf16"), ({"avx2", "amx_tile"}, "amx"), ({"avx2", "avx512f"}, "avx512"),
     ({"sse4_2", "avx2"}, "avx2"), ({"asimd"}, "neon"), ({"sve", "asimd"}, "sve")],
)
def test_cpu_isa(flags: set[str], isa: str) -> None:
    assert fingerprint.cpu_isa(flags) == isa


def test_cpu_isa_without_known_flags_uses_the_machine() -> None:
    isa = fingerprint.cpu_isa(set())
    assert isa and re.fullmatch(r"[a-z0-9.+_\-]+", isa)


# --- torch_info --------------------------------------------------------------------------------------


def fake_torch(root: Path, version_py: str | None) -> Path:
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the fake torch must never be imported')\n")
    if version_py is not None:
        (pkg / "version.py").write_text(textwrap.dedent(version_py))
    return pkg


def use_fake_torch(monkeypatch: pytest.MonkeyPatch, pkg: Path) -> None:
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "torch" else real(name, *a))


def test_torch_info_reads_version_py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = fake_torch(tmp_path, """
        from typing import Optional
        __version__ = '2.9.1+cu128'
        debug = False
        cuda: Optional[str] = '12.8'
        git_version = 'abc123'
        hip: Optional[str] = None
    """)
    use_fake_torch(monkeypatch, pkg)
    assert fingerprint.torch_info() == TorchInfo("2.9.1+cu128", "abc123", "12.8", None, pkg)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "1.13.1"])
def test_torch_info_refuses_old_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    use_fake_torch(monkeypatch, fake_torch(tmp_path, f"__version__ = {version!r}\n"))
    with pytest.raises(TorchUnavailable, match=rf"torch {re.escape(version)} is older than 2\.7"):
        fingerprint.torch_info()


def test_torch_info_accepts_two_digit_minor_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_torch(monkeypatch, fake_torch(tmp_path, "__version__ = '2.10.0'\n"))
    assert fingerprint.torch_info().version == "2.10.0"


@pytest.mark.parametrize(
    ("version_py", "message"),
    [(None, "cannot read torch's version.py"), ("__version__ = (", "cannot read torch's version.py"),
     ("cuda = None\n", "has no __version__"), ("__version__ = 'nightly'\n", "torch nightly is older")],
)
def test_torch_info_refuses_unreadable_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                version_py: str | None, message: str) -> None:
    use_fake_torch(monkeypatch, fake_torch(tmp_path, version_py))
    with pytest.raises(TorchUnavailable, match=message):
        fingerprint.torch_info()


def test_torch_info_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(TorchUnavailable, match="not installed"):
        fingerprint.torch_info()


def run_python(code: str, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_old_fake_torch_on_sys_path_is_refused_in_a_fresh_process(tmp_path: Path) -> None:
    fake_torch(tmp_path / "site", "__version__ = '2.6.0'\n")
    proc = run_python("""
        import sys
        from pytest_megacache.fingerprint import TorchUnavailable, torch_info
        try:
            torch_info()
        except TorchUnavailable as exc:
            print("refused:", exc)
        assert "torch" not in sys.modules
    """, [tmp_path / "site", REPO])
    assert proc.returncode == 0, proc.stderr
    assert "refused: torch 2.6.0 is older than 2.7" in proc.stdout


def test_torch_info_reads_the_installed_torch_without_importing_it() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    proc = run_python("""
        import json, sys
        from pytest_megacache.fingerprint import compute, torch_info
        info = torch_info()
        key = compute().key
        print(json.dumps({"version": info.version, "key": key, "imported": "torch" in sys.modules}))
    """, [REPO])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported"] is False
    assert result["version"] == importlib.metadata.version("torch")
    assert result["key"].startswith(f"torch-{result['version']}/")
