"""``pytest-megacache doctor``: the real command (in-process through ``cli.main``, and as a subprocess where the
environment must be the process's own) against a real S3 endpoint (moto's server, behind the fault proxy where a
test must see or break the traffic) and real directory stores."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_megacache import bundle, cli
from pytest_megacache.bundle import Entries, Entry
from pytest_megacache.cli import doctor
from pytest_megacache.errors import StoreError
from pytest_megacache.fingerprint import Fingerprint, TorchUnavailable, compute
from pytest_megacache.report import human_bytes
from pytest_megacache.stores import LocalDirStore, S3Store, Store

from ..conftest import S3Server, free_port
from ..faultproxy import FaultProxy

PREFIX = "pytest-megacache"
SCOPES = ["--megacache-scope", "main", "--megacache-default-scope", "main"]
ROOT = Path(__file__).resolve().parents[2]
NAMES = ("torch", "triton", "fingerprint", "settings", "credentials", "bucket", "directory", "list", "write",
         "signing key", "restore", "store")
LINE = re.compile(rf"(ok|warn|FAIL) +({'|'.join(NAMES)}) +(\S.*)")
VERDICT = re.compile(r"a session would (not )?work.* \((\d+\.\d) s\)")
SIGNING_KEY = "k" * 16 + "-doctor-signing-key"


@pytest.fixture
def this() -> Fingerprint:
    try:
        return compute()
    except TorchUnavailable as exc:
        pytest.skip(f"needs torch for this environment's fingerprint: {exc}")


@pytest.fixture
def aws(s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The S3 server through boto3's own variables, and no AWS file of this machine's read."""
    empty = tmp_path / "aws-empty"
    empty.write_text("")
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_env


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.url) as p:
        yield p


def blob(key: str, n: int = 0, extra: dict[str, object] | None = None, signing_key: bytes | None = None) -> bytes:
    entries = Entries([Entry("file/inductor", f"cd/k{n}.h", b"#pragma once\n" * (n + 4))])
    return bundle.encode(entries, key, extra=extra, signing_key=signing_key)


def seed(store: Store, scope: str, key: str, n: int = 0, **kwargs: Any) -> int:
    data = blob(key, n, **kwargs)
    store.put(f"{PREFIX}/{scope}/{key}", f"20250101T00000{n}-1-{n:012x}.mcb", data)
    return len(data)


def other_fingerprint(this: Fingerprint) -> Fingerprint:
    """This environment with another torch and one more compiler setting: another key."""
    env = dict(this.parts["env"]) if isinstance(this.parts["env"], dict) else {}
    return Fingerprint({**this.parts, "torch": "2.12.0+cpu", "env": {**env, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}})


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """The doctor's exit status, its lines by check name (status, finding), and its whole output."""
    start = time.monotonic()
    rc = cli.main(["doctor", *argv])
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert err == "" and "Traceback" not in out
    *lines, verdict = out.splitlines()
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), out
    checks = {m[2]: (m[1], m[3]) for m in parsed if m}
    assert len(checks) == len(lines)  # one line per check
    match = VERDICT.fullmatch(verdict)
    assert match, verdict
    assert (match[1] is None) == (rc == 0) == all(status != "FAIL" for status, _ in checks.values())
    assert float(match[2]) <= took + 0.1
    return rc, checks, out


def statuses(checks: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {name: status for name, (status, _) in checks.items()}


def s3_args(url: str, bucket: str) -> list[str]:
    return ["--bucket", bucket, "--endpoint-url", url, *SCOPES]


# --- S3 ----------------------------------------------------------------------------------------------


def test_healthy_s3_store(capsys: pytest.CaptureFixture[str], aws: S3Server, proxy: FaultProxy,
                          this: Fingerprint) -> None:
    bucket = aws.new_bucket()
    size = seed(S3Store(bucket, aws.client()), "main", this.key)
    before = aws.keys(bucket)
    rc, checks, _out = run(capsys, *s3_args(proxy.url, bucket))
    assert rc == 0
    assert list(checks) == ["torch", "triton", "fingerprint", "settings", "credentials", "bucket", "list", "write",
                            "signing key", "restore"]
    assert set(statuses(checks).values()) == {"ok"}
    assert checks["fingerprint"][1] == this.key
    assert checks["credentials"][1].startswith("found, from env ")
    assert checks["bucket"][1] == f"s3://{bucket} at {proxy.url} exists (region us-east-1)"
    assert checks["list"][1] == "allowed: 1 object of this fingerprint in main"
    assert re.fullmatch(rf"1 object, {re.escape(human_bytes(size))} for this fingerprint \(main: 1\); newest \d+s, "
                        r"oldest \d+s", checks["restore"][1])
    # The write probe really went to the store, beside the fingerprint folders, and is gone again.
    probes = [(method, path) for method, path, _ in proxy.requests if "doctor-probe-" in path]
    assert [m for m, _ in probes] == ["PUT", "DELETE"]
    assert probes[0][1] == probes[1][1] and probes[0][1].startswith(f"/{bucket}/{PREFIX}/main/doctor-probe-")
    assert aws.keys(bucket) == before


def test_healthy_s3_store_json(capsys: pytest.CaptureFixture[str], aws: S3Server, this: Fingerprint) -> None:
    bucket = aws.new_bucket()
    size = seed(S3Store(bucket, aws.client()), "main", this.key)
    rc = cli.main(["doctor", "--json", *s3_args(aws.url, bucket)])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 0 and err == "" and doc["ok"] is True
    checks = {c["check"]: c for c in doc["checks"]}
    assert {c["status"] for c in doc["checks"]} == {"ok"}
    assert checks["fingerprint"]["details"]["key"] == this.key
    assert checks["credentials"]["details"] == {"method": "env"}
    restore = checks["restore"]["details"]
    assert (restore["objects"], restore["bytes"], restore["scopes"]) == (1, size, {"main": 1})
    assert 0 <= restore["newest_age_s"] < 60


def test_missing_bucket(capsys: pytest.CaptureFixture[str], aws: S3Server) -> None:
    rc, checks, _out = run(capsys, *s3_args(aws.url, "mc-no-such-bucket-here"))
    assert rc == 1
    assert checks["credentials"][0] == "ok"
    # The endpoint came from AWS_ENDPOINT_URL_S3 too: a *_URL variable's value is never shown, its name is.
    assert checks["bucket"] == ("FAIL", "s3://mc-no-such-bucket-here at <AWS_ENDPOINT_URL_S3> does not exist (404)")
    assert {name: checks[name] for name in ("list", "write")} == {
        "list": ("FAIL", "not checked: the bucket check failed"), "write": ("FAIL", "not checked: the bucket check failed")}
    assert checks["restore"] == ("FAIL", "not checked: the store could not be listed")


def test_missing_credentials(capsys: pytest.CaptureFixture[str], aws: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = aws.new_bucket()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    rc, checks, _out = run(capsys, *s3_args(aws.url, bucket))
    assert rc == 1
    assert checks["credentials"][0] == "FAIL" and checks["credentials"][1].startswith("none found: boto3 looked in")
    assert [checks[n] for n in ("bucket", "list", "write")] == [("FAIL", "not checked: no credentials")] * 3
    assert checks["signing key"][0] == "ok"  # independent of the store


def _subprocess(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MEGACACHE_", "AWS_", "GITHUB_"))}
    return subprocess.run([sys.executable, "-m", "pytest_megacache", "doctor", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**base, **env})


def test_missing_profile_through_the_entry_point(s3_server: S3Server, tmp_path: Path) -> None:
    # No AWS variable but these: empty AWS files, a profile none of them has (instance metadata stays on).
    empty = tmp_path / "empty"
    empty.write_text("")
    env = {"AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty), "AWS_PROFILE": "ci-nowhere"}
    proc = _subprocess(*s3_args(s3_server.url, "some-bucket"), "--megacache-timeout", "20", env=env)
    assert proc.returncode == 1 and proc.stderr == "" and "Traceback" not in proc.stdout
    [line] = [line for line in proc.stdout.splitlines() if " credentials " in line]
    assert line.startswith("FAIL") and "ProfileNotFound" in line and "ci-nowhere" in line
    assert proc.stdout.splitlines()[-1].startswith("a session would not work")


def test_empty_store_names_the_nearest_fingerprint(capsys: pytest.CaptureFixture[str], aws: S3Server,
                                                   this: Fingerprint) -> None:
    bucket = aws.new_bucket()
    other = other_fingerprint(this)
    seed(S3Store(bucket, aws.client()), "main", other.key,
         extra={"producer": {"scope": "main", "fingerprint_parts": other.parts}})
    rc, checks, _out = run(capsys, *s3_args(aws.url, bucket))
    assert rc == 0  # a cold first run still works: a warning
    status, finding = checks["restore"]
    assert status == "warn"
    assert finding.startswith(f"nothing stored for this fingerprint in main: nearest stored fingerprint is {other.key} "
                              "(scope main); it differs in: ")
    assert f"torch '2.12.0+cpu' here {this.parts['torch']!r}" in finding
    assert "TORCHINDUCTOR_MAX_AUTOTUNE '1' here unset" in finding
    assert finding.endswith("; the first run compiles cold and uploads")


def test_this_fingerprint_in_a_scope_not_read(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                              this: Fingerprint) -> None:
    seed(LocalDirStore(tmp_path), "release", this.key)
    rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
    assert rc == 0
    assert checks["restore"][0] == "warn"
    assert "this fingerprint is stored only in scope(s) this session does not read: release" in checks["restore"][1]


def test_read_only_mode_writes_nothing(capsys: pytest.CaptureFixture[str], aws: S3Server, proxy: FaultProxy,
                                       this: Fingerprint) -> None:
    bucket = aws.new_bucket()
    seed(S3Store(bucket, aws.client()), "main", this.key)
    rc, checks, _out = run(capsys, *s3_args(proxy.url, bucket), "--megacache-mode", "read")
    assert rc == 0
    assert checks["write"] == ("ok", "read-only by mode (read)")
    assert checks["restore"][0] == "ok"
    assert [m for m, _, _ in proxy.requests if m not in ("GET", "HEAD")] == []


def test_a_fork_pull_request_is_read_only(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"pull_request": {"number": 7, "head": {"repo": {"id": 2, "full_name": "x/fork"}}},
                                 "repository": {"id": 1, "full_name": "org/repo", "default_branch": "trunk"}}))
    for name, value in {"GITHUB_EVENT_NAME": "pull_request", "GITHUB_EVENT_PATH": str(event),
                        "GITHUB_REF": "refs/pull/7/merge"}.items():
        monkeypatch.setenv(name, value)
    rc, checks, _out = run(capsys, "--dir", str(tmp_path / "store"))
    assert rc == 0
    assert "mode read: pull_request from a fork (x/fork into org/repo)" in checks["settings"][1]
    assert checks["settings"][1].endswith("writes scope pr-7, reads pr-7, trunk")
    assert checks["write"][1].startswith("read-only by mode (read: pull_request from a fork")


def test_an_unanswering_endpoint_fails_within_the_budget(capsys: pytest.CaptureFixture[str], aws: S3Server,
                                                         proxy: FaultProxy) -> None:
    bucket = aws.new_bucket()
    proxy.mode = "blackhole"
    start = time.monotonic()
    rc, checks, _out = run(capsys, *s3_args(proxy.url, bucket), "--megacache-timeout", "2")
    took = time.monotonic() - start
    assert rc == 1
    assert 2.0 <= took < 30, took  # the 2 s budget, not botocore's 3 x 30 s read timeouts
    assert checks["bucket"] == ("FAIL", "checking the bucket did not finish within the budget of the doctor's store "
                                        "checks (2 s, --megacache-timeout)")
    assert checks["restore"][0] == "FAIL"
    # The same through the entry point, timed until the process has exited: nothing waits on the abandoned
    # request at interpreter exit (the store calls run in daemon threads).
    aws_env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    start = time.monotonic()
    proc = _subprocess(*s3_args(proxy.url, bucket), "--megacache-timeout", "2", env=aws_env)
    took = time.monotonic() - start
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert "did not finish within the budget" in proc.stdout
    assert 2.0 <= took < 30, took  # the 2 s budget plus the interpreter's start, not botocore's 3 x 30 s


def test_a_refused_write(capsys: pytest.CaptureFixture[str], aws: S3Server, proxy: FaultProxy,
                         this: Fingerprint) -> None:
    bucket = aws.new_bucket()
    seed(S3Store(bucket, aws.client()), "main", this.key)
    proxy.mode = "reset-put"
    rc, checks, _out = run(capsys, *s3_args(proxy.url, bucket), "--megacache-timeout", "20")
    assert rc == 1
    assert statuses(checks)["list"] == statuses(checks)["restore"] == "ok"
    assert checks["write"][0] == "FAIL" and checks["write"][1].startswith("S3 put on bucket")
    assert aws.keys(bucket) == [f"{PREFIX}/main/{this.key}/20250101T000000-1-000000000000.mcb"]


# --- directory stores --------------------------------------------------------------------------------


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_healthy_directory_store(capsys: pytest.CaptureFixture[str], tmp_path: Path, this: Fingerprint) -> None:
    seed(LocalDirStore(tmp_path), "main", this.key)
    seed(LocalDirStore(tmp_path), "main", this.key, 1)
    before = _tree(tmp_path)
    rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
    assert rc == 0
    assert list(checks)[4:7] == ["directory", "list", "write"]
    assert set(statuses(checks).values()) == {"ok"}
    assert checks["directory"][1] == f"{tmp_path} exists"
    assert checks["restore"][1].startswith("2 objects, ")
    assert _tree(tmp_path) == before  # the probe file and its folder are gone


def test_a_directory_store_not_created_yet(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = tmp_path / "cache" / "store"
    rc, checks, _out = run(capsys, "--dir", str(store), *SCOPES)
    assert rc == 0
    assert checks["directory"] == ("ok", f"{store} does not exist yet; the first upload creates it")
    assert checks["write"][0] == "ok"
    assert not (tmp_path / "cache").exists()  # what the probe created is removed again
    rc, checks, _out = run(capsys, "--dir", str(store), *SCOPES, "--megacache-mode", "read")
    assert rc == 0 and checks["directory"][0] == "warn" and "nothing to restore" in checks["directory"][1]


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """``path`` made unwritable: by its mode, or (for root, whom modes do not stop) immutable."""
    path.chmod(0o555)
    immutable = False
    try:
        if os.access(path, os.W_OK):
            immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode == 0
            if not immutable:
                pytest.skip("cannot make a directory unwritable here (root without chattr)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=False)
        path.chmod(0o755)


def test_an_unwritable_directory_store(capsys: pytest.CaptureFixture[str], tmp_path: Path, this: Fingerprint) -> None:
    seed(LocalDirStore(tmp_path), "main", this.key)
    with unwritable(tmp_path / PREFIX / "main"):  # the write scope's folder, where the probe goes
        rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
        assert rc == 1
        assert statuses(checks)["directory"] == statuses(checks)["list"] == statuses(checks)["restore"] == "ok"
        assert checks["write"][0] == "FAIL" and checks["write"][1].startswith("cannot write ")
        rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES, "--megacache-mode", "read")
        assert rc == 0 and checks["write"] == ("ok", "read-only by mode (read)")


def test_a_probe_that_cannot_be_deleted(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: LocalDirStore, folder: str, name: str) -> None:
        raise StoreError(f"cannot delete {name}: Permission denied", "io")

    monkeypatch.setattr(LocalDirStore, "delete", refuse)
    rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
    assert rc == 0  # uploads work; compaction would not
    status, finding = checks["write"]
    assert status == "warn" and finding.startswith("allowed, but deleting the probe failed (cannot delete doctor-probe-")
    [probe] = (tmp_path / PREFIX / "main").iterdir()
    assert finding.endswith(f"Remove {PREFIX}/main/{probe.name} by hand")


def test_a_directory_store_under_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    rc, checks, _out = run(capsys, "--dir", str(tmp_path / "file" / "store"), *SCOPES)
    assert rc == 1
    assert checks["directory"] == ("FAIL", f"{tmp_path / 'file' / 'store'} cannot be created: {tmp_path / 'file'} is "
                                           "not a directory")
    assert checks["restore"][0] == "FAIL"


# --- the signing key ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "argv", "status", "finding"),
    [("Zq9xK2short", [], "FAIL", "MEGACACHE_SIGNING_KEY: key 1 is shorter than 16 characters: a session is inactive"),
     (None, ["--megacache-require-signature"], "FAIL", "required (--megacache-require-signature) but"),
     ("", [], "warn", "MEGACACHE_SIGNING_KEY is set but empty"),
     (None, [], "ok", "not configured"),
     (SIGNING_KEY, ["--megacache-require-signature"], "ok", f"set: signs with kid {bundle.key_id(SIGNING_KEY.encode())}")],
    ids=["short", "required-unset", "empty", "unset", "good"],
)
def test_signing_key(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                     value: str | None, argv: list[str], status: str, finding: str) -> None:
    if value is not None:
        monkeypatch.setenv("MEGACACHE_SIGNING_KEY", value)
    rc, checks, out = run(capsys, "--dir", str(tmp_path), *SCOPES, *argv)
    assert checks["signing key"][0] == status and checks["signing key"][1].startswith(finding)
    assert rc == (1 if status == "FAIL" else 0)
    if value:
        assert value not in out


def test_stored_objects_a_signing_session_refuses(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, this: Fingerprint) -> None:
    monkeypatch.setenv("MEGACACHE_SIGNING_KEY", SIGNING_KEY)
    seed(LocalDirStore(tmp_path), "main", this.key, signing_key=SIGNING_KEY.encode())
    rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
    assert rc == 0 and checks["restore"][0] == "ok"
    seed(LocalDirStore(tmp_path), "main", this.key, 1)  # newer, unsigned
    rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
    assert rc == 0 and checks["restore"][0] == "warn"
    assert checks["restore"][1].endswith("but the newest object is unsigned, so a session with these keys refuses it")
    other = b"another-signing-key-0123456789"
    seed(LocalDirStore(tmp_path), "main", this.key, 2, signing_key=other)  # newer, signed with another key
    rc, checks, _out = run(capsys, "--dir", str(tmp_path), *SCOPES)
    assert rc == 0 and checks["restore"][0] == "warn"
    assert f"but the newest object is signed with another key (kid {bundle.key_id(other)})" in checks["restore"][1]


# --- failures of every kind, and secrets ---------------------------------------------------------------


def _no_torch() -> Any:
    raise TorchUnavailable("torch is not installed")


def _unreadable_cpuinfo() -> Any:
    raise OSError(5, "cpuinfo unreadable")


def _gpu_without_triton(this: Fingerprint) -> Fingerprint:
    return Fingerprint({**this.parts, "cuda": "13.0", "gpus": ["NVIDIA H100 80GB HBM3"], "triton": None})


@pytest.mark.parametrize("case", ["no-torch", "fingerprint-raises", "gpu-without-triton", "bad-setting", "mode-off",
                                  "no-store"])
def test_each_check_can_fail(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             this: Fingerprint, case: str) -> None:
    argv = ["--dir", str(tmp_path), *SCOPES]
    if case == "no-torch":
        monkeypatch.setattr(doctor, "torch_info", _no_torch)
    elif case == "fingerprint-raises":
        monkeypatch.setattr(doctor, "compute", _unreadable_cpuinfo)
    elif case == "gpu-without-triton":
        monkeypatch.setattr(doctor, "compute", lambda: _gpu_without_triton(this))
    elif case == "bad-setting":
        monkeypatch.setenv("MEGACACHE_MODE", "sometimes")
    elif case == "mode-off":
        argv += ["--megacache-mode", "off"]
    else:
        argv = SCOPES
    rc, checks, _out = run(capsys, *argv)
    assert rc == 1
    failed = {name: finding for name, (status, finding) in checks.items() if status == "FAIL"}
    expected = {
        "no-torch": {"torch": "torch is not installed: nothing is compiled, so nothing is cached",
                     "triton": "not checked: no usable torch", "fingerprint": "not checked: no usable torch",
                     "restore": "not checked: no fingerprint"},
        "fingerprint-raises": {"fingerprint": "OSError: [Errno 5] cpuinfo unreadable", "triton": "not checked: no fingerprint",
                               "restore": "not checked: no fingerprint"},
        "gpu-without-triton": {"triton": "not installed: torch.compile on the GPU needs it (pip install triton, or torch "
                                         "from the index matching its CUDA/ROCm build)"},
        "bad-setting": {"settings": "environment (MEGACACHE_MODE): mode 'sometimes' is not one of readwrite, read, write, off",
                        "store": "not checked: the settings are unusable",
                        "signing key": "not checked: the settings are unusable",
                        "restore": "not checked: the settings are unusable"},
        "mode-off": {"settings": f"dir:{tmp_path}/{PREFIX}, mode off, budget 120 s; writes scope main, reads main: mode "
                                 "off, so the plugin restores and uploads nothing"},
        "no-store": {"settings": "no store configured: pass --bucket or --dir (or set MEGACACHE_BUCKET or MEGACACHE_DIR); "
                                 "without one the plugin is off",
                     "store": "not checked: no store configured", "restore": "not checked: no store configured"},
    }[case]
    assert failed == expected


def test_no_secret_reaches_the_output(capsys: pytest.CaptureFixture[str], aws: S3Server, this: Fingerprint,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {"AWS_ACCESS_KEY_ID": "AKIAFAKEDOCTOR0123456", "AWS_SECRET_ACCESS_KEY": "fake/Secret+doctor-0123456789",
               "MEGACACHE_SIGNING_KEY": "fake-signing-secret-0123456789abcdef"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    bucket = aws.new_bucket()
    seed(S3Store(bucket, aws.client()), "main", this.key, signing_key=secrets["MEGACACHE_SIGNING_KEY"].encode())
    password = "hunter2-doctor"
    outputs = []
    for argv in (s3_args(aws.url, bucket), ["--json", *s3_args(aws.url, bucket)],
                 s3_args(f"http://ci:{password}@127.0.0.1:{free_port()}", bucket)):
        rc = cli.main(["doctor", *argv])
        out, err = capsys.readouterr()
        assert rc == (1 if password in " ".join(argv) else 0), out
        outputs.append(out + err)
    assert "http://***@127.0.0.1" in outputs[2]  # the failing endpoint is named, its password masked
    # A failure whose message carries a secret: masked in its FAIL line.
    def leaky(self: S3Store, folder: str) -> Any:
        raise RuntimeError(f"the client said {secrets['AWS_SECRET_ACCESS_KEY']} and {secrets['MEGACACHE_SIGNING_KEY']}")

    monkeypatch.setattr(S3Store, "list", leaky)
    rc, checks, out = run(capsys, *s3_args(aws.url, bucket))
    assert rc == 1
    assert checks["list"] == ("FAIL", "listing the store: RuntimeError: the client said <AWS_SECRET_ACCESS_KEY> and "
                                      "<MEGACACHE_SIGNING_KEY>")
    outputs.append(out)
    for text in outputs:
        for value in (*secrets.values(), password):
            assert value not in text
