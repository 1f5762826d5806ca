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


_IN_A_PROCESS = """
import json, sys
from pathlib import Path
from pytest_megacache import fingerprint
torch = fingerprint.TorchInfo("2.13.0+cpu", "cf30153c", None, None, Path("/nowhere/torch"))
fp = fingerprint.compute(env=json.loads(sys.argv[1]), torch=torch)
print(json.dumps({"key": fp.key, "parts": fp.parts}, sort_keys=True))
"""


def in_a_process(env: dict[str, str], hash_seed: str) -> dict[str, object]:
    """The fingerprint of ``env`` as another interpreter computes it, under its own ``PYTHONHASHSEED`` (the order of
    its sets and its str hashes differ from this process's)."""
    full = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _IN_A_PROCESS, json.dumps(env)], env=full, capture_output=True,
                         text=True, timeout=120, check=True)
    doc = json.loads(out.stdout)
    assert isinstance(doc, dict)
    return doc


def test_key_is_the_same_in_every_process() -> None:
    """Sessions on two machines of one kind compute one key: no hash seed, set order or per-process salt in it."""
    env = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCHINDUCTOR_FREEZING": "1", "TRITON_F32_DEFAULT": "ieee",
           "TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TRITON_HOME": "/x"}
    here = compute(env)
    one, other = in_a_process(env, "1"), in_a_process(dict(reversed(env.items())), "2")
    assert one == other == {"key": here.key, "parts": json.loads(json.dumps(here.parts))}
    assert in_a_process({}, "3")["key"] == compute().key != here.key


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
    """A hidden value's digest is the same in every process (test_key_is_the_same_in_every_process) and whatever
    the order of the environment."""
    env = {"TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TORCHINDUCTOR_FREEZING": "1", "TRITON_HOME": "/x"}
    assert compute(env).parts == compute(dict(reversed(env.items()))).parts
    hidden = in_a_process(env, "4")["parts"]
    assert isinstance(hidden, dict) and hidden["env"] == compute(env).parts["env"]
    assert HIDDEN_RE.fullmatch(hidden["env"]["TORCHINDUCTOR_REDIS_URL"])


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
        assert envpolicy.keyed(name), name
        assert not re.search(r"URL|_HOST$|_PORT$|PASSW|SECRET|TOKEN|_KEY|CRED|_DIR$|_PATH$|REGEX|USERNAME|_USER$", name), name


@pytest.mark.parametrize(
    "var", ["TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS", "TORCH_COMPILE_JOB_ID",
            "HOME", "CI", "MEGACACHE_BUCKET"],
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


# What the NVIDIA driver (580.159.04) shows of an H100 SXM in /proc/driver/nvidia/gpus/0000:00:06.0/information, and
# the same host's `nvidia-smi --query-gpu=name --format=csv,noheader`; an A100 beside it on a second bus, for the order.
H100_INFORMATION = """Model: \t\t NVIDIA H100 80GB HBM3
IRQ:   \t\t 41
GPU UUID: \t GPU-e585a79c-a8e2-169e-b75f-b4332f119942
Video BIOS: \t 96.00.da.00.0c
Bus Type: \t PCIe
DMA Size: \t 52 bits
DMA Mask: \t 0xfffffffffffff
Bus Location: \t 0000:00:06.0
Device Minor: \t 0
GPU Firmware: \t 580.159.04
GPU Excluded:\t No
"""
A100_INFORMATION = H100_INFORMATION.replace("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB").replace(
    "0000:00:06.0", "0000:41:00.0").replace("Device Minor: \t 0", "Device Minor: \t 1")
SMI_OUTPUT = "NVIDIA H100 80GB HBM3\nNVIDIA A100-SXM4-80GB\n"
SMI_FAILED = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
              "NVIDIA driver is installed and running.\n\n")
CUDA_TORCH = TorchInfo("2.11.0+cu130", "abc", "13.0", None, Path("/nowhere"))


def proc_gpus(tmp_path: Path) -> Path:
    root = tmp_path / "proc-gpus"
    for bus, text in (("0000:41:00.0", A100_INFORMATION), ("0000:00:06.0", H100_INFORMATION)):
        (root / bus).mkdir(parents=True)
        (root / bus / "information").write_text(text)
    return root


def fake_nvidia_smi(tmp_path: Path, stdout: str, rc: int = 0) -> Path:
    """A directory with an ``nvidia-smi`` that prints ``stdout`` when asked what the fingerprint asks."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "smi-output").write_text(stdout)
    script = bin_dir / "nvidia-smi"
    expected = " ".join(fingerprint.SMI_ARGS)
    script.write_text(f'#!/bin/sh\nPATH=/usr/bin:/bin\n'
                      f'[ "$*" = "{expected}" ] || {{ echo "unexpected arguments: $*"; exit 2; }}\n'
                      f'cat "{tmp_path / "smi-output"}"\nexit {rc}\n')
    script.chmod(0o755)
    return bin_dir


def test_both_gpu_sources_give_the_same_names_in_bus_order(tmp_path: Path) -> None:
    assert fingerprint.gpu_names_from_proc(proc_gpus(tmp_path)) == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
    assert fingerprint.gpu_names_from_smi(SMI_OUTPUT) == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
    assert fingerprint.gpu_names_from_proc(tmp_path / "no-driver") == []


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_the_key_names_the_gpu_alike_whichever_source_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's proc files where they are (a container may lack them), else nvidia-smi: one GPU part either way."""
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, SMI_OUTPUT)))
    monkeypatch.setattr(fingerprint, "PROC_GPUS", tmp_path / "no-driver")
    from_smi = compute(torch=CUDA_TORCH)
    monkeypatch.setattr(fingerprint, "PROC_GPUS", proc_gpus(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    from_proc = compute(torch=CUDA_TORCH)
    assert from_smi.key == from_proc.key
    assert from_proc.key.startswith("torch-2.11.0+cu130/cuda13.0-nvidia-h100-80gb-hbm3/"), from_proc.key
    assert from_smi.parts["gpus"] == from_proc.parts["gpus"] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
def test_a_failing_nvidia_smi_names_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver: nvidia-smi says so on stdout and exits non-zero; its words are no GPU's name."""
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path, SMI_FAILED, rc=9)))
    monkeypatch.setattr(fingerprint, "PROC_GPUS", tmp_path / "no-driver")
    assert fingerprint.gpu_names() == []
    assert compute(torch=CUDA_TORCH).key.split("/")[1].startswith("cpu-")


# --- the vector ISA torch picks ------------------------------------------------------------------------

# The flags line of /proc/cpuinfo on each machine (one logical CPU), as the kernel prints it.
SAPPHIRE_RAPIDS = set("""fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse
 sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good nopl xtopology nonstop_tsc
 cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca
 sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb
 cat_l3 cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow flexpriority ept
 vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma
 clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc
 cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 wbnoinvd dtherm ida arat pln pts hfi vnmi avx512vbmi
 umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid
 bus_lock_detect cldemote movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt amx_bf16
 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities""".split())
ZEN4 = set("""fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx
 mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good amd_lbr_v2 nopl nonstop_tsc cpuid extd_apicid aperfmperf rapl pni
 pclmulqdq monitor ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm
 extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext perfctr_core perfctr_nb bpext
 perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate ssbd mba perfmon_v2 ibrs ibpb stibp ibrs_enhanced vmmcall fsgsbase bmi1
 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni
 avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local avx512_bf16 clzero
 irperf xsaveerptr rdpru wbnoinvd amd_ppin cppc arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid
 decodeassists pausefilter pfthreshold avic v_vmsave_vmload vgif x2avic v_spec_ctrl vnmi avx512vbmi umip pku ospke
 avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq la57 rdpid overflow_recov succor smca fsrm
 flush_l1d""".split())
GRAVITON3 = set("""fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop
 sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh
 rng""".split())
GRAVITON4 = set("""fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop
 sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes svepmull svebitperm
 svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh rng bti""".split())
HASWELL = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c"}


@pytest.mark.parametrize(
    ("flags", "machine", "sve", "isa"),
    [(SAPPHIRE_RAPIDS, "x86_64", None, "amx"), (ZEN4, "x86_64", None, "avx512vnni"),
     (HASWELL, "x86_64", None, "avx2"), (HASWELL - {"avx2"}, "x86_64", None, "novec"),
     (ZEN4 - {"avx512_vnni"}, "x86_64", None, "avx512"), (ZEN4 - {"avx512bw"}, "x86_64", None, "avx2"),
     (GRAVITON3, "aarch64", 256, "sve256"), (GRAVITON4, "aarch64", 128, "sve128"),
     (GRAVITON3 - {"bf16"}, "aarch64", 256, "neon"), ({"fp", "asimd"}, "aarch64", None, "neon"),
     (set(), "ppc64le", None, "vsx"), ({"vxe"}, "s390x", None, "zvector"), (set(), "riscv64", None, "novec")],
)
def test_picked_isa_follows_torch(flags: set[str], machine: str, sve: int | None, isa: str) -> None:
    assert fingerprint.picked_isa(flags, machine, system="linux", sve=sve) == isa


@pytest.mark.parametrize(
    ("flags", "capability", "isa"),
    [(ZEN4, "avx2", "avx2"), (ZEN4, "default", "novec"), (ZEN4, "avx512", "avx512vnni"), (ZEN4, "bogus", "avx512vnni"),
     (SAPPHIRE_RAPIDS, "avx512", "amx"),  # torch prefers AMX for avx512 (its VecAMX's name contains "avx512")
     (HASWELL, "avx512", "avx2"),  # not valid here: torch warns and keeps the first valid one
     (HASWELL, "default", "novec"), (HASWELL - {"avx2"}, "default", "novec")],
)
def test_aten_cpu_capability_picks_as_torch_does(flags: set[str], capability: str, isa: str) -> None:
    assert fingerprint.picked_isa(flags, "x86_64", capability, system="linux") == isa


def _machine_key(monkeypatch: pytest.MonkeyPatch, flags: set[str], machine: str, sve: int | None,
                 env: dict[str, str] | None = None) -> Fingerprint:
    monkeypatch.setattr(fingerprint, "_cpu_flags", lambda: (flags, 8))
    monkeypatch.setattr(fingerprint.platform, "machine", lambda: machine)
    monkeypatch.setattr(fingerprint, "sve_bits", lambda _machine=None: sve)
    return compute(env)


def test_four_server_cpus_get_four_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sapphire Rapids (AMX) and Zen4 both have avx512_bf16; Graviton3 (SVE 256) and Graviton4 (SVE2, 128 bits) both
    have sve: torch builds different code for each, so each has its own key, with the ISA in its readable segment."""
    keys = {name: _machine_key(monkeypatch, flags, machine, sve) for name, flags, machine, sve in [
        ("spr", SAPPHIRE_RAPIDS, "x86_64", None), ("zen4", ZEN4, "x86_64", None),
        ("graviton3", GRAVITON3, "aarch64", 256), ("graviton4", GRAVITON4, "aarch64", 128)]}
    assert len({fp.key for fp in keys.values()}) == 4
    assert [fp.key.split("/")[1] for fp in keys.values()] == ["cpu-amx-t8", "cpu-avx512vnni-t8", "cpu-sve256-t8",
                                                              "cpu-sve128-t8"]
    # the same ISA on another SVE length or without a flag that changes torch's build flags: another key still
    assert _machine_key(monkeypatch, GRAVITON3, "aarch64", 128).key != keys["graviton3"].key
    assert _machine_key(monkeypatch, ZEN4 - {"avx512_bf16"}, "x86_64", None).key != keys["zen4"].key
    # flags torch never reads do not split the key
    assert _machine_key(monkeypatch, ZEN4 - {"clzero", "rdpru"}, "x86_64", None).key == keys["zen4"].key


def test_aten_cpu_capability_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _machine_key(monkeypatch, ZEN4, "x86_64", None)
    avx2 = _machine_key(monkeypatch, ZEN4, "x86_64", None, {"ATEN_CPU_CAPABILITY": "avx2"})
    scalar = _machine_key(monkeypatch, ZEN4, "x86_64", None, {"ATEN_CPU_CAPABILITY": "default"})
    assert len({base.key, avx2.key, scalar.key}) == 3
    assert avx2.key.split("/")[1] == "cpu-avx2-t8" and scalar.key.split("/")[1] == "cpu-novec-t8"
    assert avx2.parts["env"] == {"ATEN_CPU_CAPABILITY": "avx2"}  # a harmless enum name: shown


def test_this_machine_keys_aten_cpu_capability() -> None:
    """On the machine the suite runs on, with its real /proc/cpuinfo."""
    real = fingerprint.compute(env={}, torch=CPU_TORCH)
    avx2 = fingerprint.compute(env={"ATEN_CPU_CAPABILITY": "avx2"}, torch=CPU_TORCH)
    assert real.key != avx2.key or real.parts["cpu_isa"] == "avx2"
    assert real.key != fingerprint.compute(env={"ATEN_CPU_CAPABILITY": "default"}, torch=CPU_TORCH).key or \
        real.parts["cpu_isa"] == "novec"


def test_the_compiler_is_keyed_by_what_it_resolves_to(tmp_path: Path) -> None:
    bin_a, bin_b = tmp_path / "a", tmp_path / "b"
    for folder, target in ((bin_a, "g++-12"), (bin_b, "g++-13")):
        folder.mkdir()
        real = folder / target
        real.write_text("#!/bin/sh\n")
        real.chmod(0o755)
        (folder / "g++").symlink_to(real)
    a = compute({"PATH": str(bin_a)})
    assert a.parts["cxx"] == "g++-12"
    assert compute({"PATH": str(bin_b)}).key != a.key
    assert compute({"PATH": str(bin_b), "CXX": str(bin_a / "g++")}).parts["cxx"] == "g++-12"
    assert compute({"PATH": str(tmp_path / "none")}).parts["cxx"] == "missing"
    odd = tmp_path / "tok en@secret"
    odd.mkdir()
    (odd / "c++ with spaces").write_text("#!/bin/sh\n")
    (odd / "c++ with spaces").chmod(0o755)
    hidden = compute({"CXX": str(odd / "c++ with spaces")}).parts["cxx"]
    assert isinstance(hidden, str) and re.fullmatch(r"hidden:[0-9a-f]{16}", hidden)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, ["A100", "H100"]), ("1", ["H100"]), ("1,0", ["H100", "A100"]), ("0,7", ["A100"])],
)
def test_cuda_visible_devices_picks_the_gpus(visible: str | None, expected: list[str]) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert fingerprint.visible_gpus(["A100", "H100"], env) == expected


def test_cuda_visible_devices_by_uuid_on_a_mixed_host_is_keyed() -> None:
    mixed = fingerprint.visible_gpus(["A100", "H100"], {"CUDA_VISIBLE_DEVICES": "GPU-1234"})
    assert mixed[:2] == ["A100", "H100"] and re.fullmatch(r"hidden:[0-9a-f]{16}", mixed[2])
    assert fingerprint.visible_gpus(["H100", "H100"], {"CUDA_VISIBLE_DEVICES": "GPU-1234"}) == ["H100", "H100"]


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


def test_rocm_torch_keys_on_the_gpu_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for node, version in (("0", "0"), ("1", "90402"), ("2", "90010"), ("10", "110000")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 4\n")
    assert fingerprint.amd_gpu_archs(tmp_path) == ["gfx942", "gfx90a", "gfx1100"]
    monkeypatch.setattr(fingerprint, "amd_gpu_archs", lambda: ["gfx942", "gfx90a"])
    rocm_torch = TorchInfo("2.11.0+rocm6.4", "abc", None, "6.4", Path("/nowhere"))
    assert compute(torch=rocm_torch).key.startswith("torch-2.11.0+rocm6.4/rocm6.4-gfx942/")
    assert compute({"HIP_VISIBLE_DEVICES": "1"}, torch=rocm_torch).key.startswith("torch-2.11.0+rocm6.4/rocm6.4-gfx90a/")
    assert compute({"HIP_VISIBLE_DEVICES": ""}, torch=rocm_torch).key.split("/")[1].startswith("cpu-")
