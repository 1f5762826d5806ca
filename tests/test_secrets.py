"""No secret leaves the machine: not through the fingerprint, a message, the report or a stored object."""

from __future__ import annotations

import json
import pickle
import re
import textwrap
import time

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache import envpolicy
from pytest_megacache.errors import redact, redact_cut
from pytest_megacache.settings import OPTIONS

from .helpers_torch import TORCH_TESTS, TorchProject, skip_without_torch

PASSWORD = "Sup3rS3cretPassw0rd"
REDIS_URL = f"redis://ci:{PASSWORD}@redis.example:6379/0"


# --- redact ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("redis://ci:p@ss@host:6379/0", "redis://***@host:6379/0"),
     ("https://u:a@b@host/x", "https://***@host/x"),
     ("connect to http://user:hunter2@127.0.0.1:9000/bucket failed", "connect to http://***@127.0.0.1:9000/bucket failed"),
     ("redis://:only-a-password@host", "redis://***@host"),
     ("'redis://ci:pw@h', 'https://x:y@z'", "'redis://***@h', 'https://***@z'"),
     # no userinfo: nothing to mask, an '@' after the path included
     ("http://127.0.0.1:9000/x?owner=a@b.c", "http://127.0.0.1:9000/x?owner=a@b.c"),
     ("mail ci@example.com about s3://bucket/key", "mail ci@example.com about s3://bucket/key")],
)
def test_urls_lose_their_whole_userinfo(text: str, expected: str) -> None:
    assert redact(text, env={}) == expected


def test_compiler_variables_not_shown_in_the_fingerprint_are_masked() -> None:
    env = {"TORCHINDUCTOR_REDIS_URL": REDIS_URL, "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS": "ATEN,TRITON",
           "TORCHINDUCTOR_SOME_NEW_KNOB": "plain-looking-value", "TRITON_LIBDEVICE_PATH": "/opt/private/libdevice"}
    text = (f"remote cache {REDIS_URL} refused; backends ATEN,TRITON; knob plain-looking-value; "
            f"lib /opt/private/libdevice; the password {PASSWORD} alone")
    out = redact(text, env)
    assert PASSWORD not in out and "redis.example" not in out
    assert "remote cache <TORCHINDUCTOR_REDIS_URL> refused" in out
    assert "the password <TORCHINDUCTOR_REDIS_URL> alone" in out  # the URL's password on its own too
    assert "backends ATEN,TRITON" in out  # allowlisted and harmless: shown in the fingerprint, kept here
    assert "knob <TORCHINDUCTOR_SOME_NEW_KNOB>" in out and "lib <TRITON_LIBDEVICE_PATH>" in out


@pytest.mark.parametrize(
    "name", ["GITHUB_TOKEN", "HF_TOKEN", "DB_PASSWORD", "SMTP_PASSWD", "GOOGLE_APPLICATION_CREDENTIALS", "OPENAI_API_KEY",
             "WEBHOOK_URL", "SENTRY_DSN", "MY_SECRET", "MEGACACHE_ENDPOINT_URL", "MEGACACHE_SOMETHING_NEW",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL_S3"],
)
def test_secret_looking_variables_are_masked(name: str) -> None:
    assert redact("value: abcdef123456!", {name: "abcdef123456!"}) == f"value: <{name}>"


def test_short_values_are_left_alone() -> None:
    """Masking every '1' or 'on' would wreck the message; a credential is longer than that."""
    env = {"GITHUB_TOKEN": "abc", "TORCHINDUCTOR_REDIS_PORT": "6379", "MY_SECRET": ""}
    assert redact("abc 6379 done", env) == "abc 6379 done"


@pytest.mark.parametrize(
    ("name", "value"),
    [("MEGACACHE_BUCKET", "team-cache-bucket"), ("MEGACACHE_DIR", "/srv/megacache"), ("AWS_REGION", "eu-central-1"),
     ("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache"), ("GITHUB_SERVER_URL", "https://github.com"),
     ("HOME", "/home/runner"), ("TORCHINDUCTOR_FREEZING", "1"), ("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "TRITON")],
)
def test_harmless_values_stay_readable(name: str, value: str) -> None:
    assert redact(f"problem with {value}", {name: value}) == f"problem with {value}"


def test_signing_keys_are_masked_one_by_one() -> None:
    env = {"MEGACACHE_SIGNING_KEY": "first-key-0123456789, second-key-9876543210"}
    out = redact("refused by second-key-9876543210 and first-key-0123456789", env)
    assert out == "refused by <MEGACACHE_SIGNING_KEY> and <MEGACACHE_SIGNING_KEY>"


def test_the_longest_secret_is_masked_first() -> None:
    env = {"A_TOKEN": "abcdefgh", "B_TOKEN": "abcdefgh-and-more"}
    assert redact("x abcdefgh-and-more y abcdefgh", env) == "x <B_TOKEN> y <A_TOKEN>"


def test_redact_cut_masks_before_it_cuts() -> None:
    text = "x" * 280 + " " + REDIS_URL  # cut at 300: within the password
    cut_first = redact(text[:300], {"TORCHINDUCTOR_REDIS_URL": REDIS_URL})
    assert cut_first.endswith("redis://ci:Sup3rS3c")  # the old order: a cut secret is not recognised...
    out = redact_cut(text, 300, {"TORCHINDUCTOR_REDIS_URL": REDIS_URL})
    assert len(out) == 300 and "Sup3r" not in out and "redis://" not in out  # ...the new one masks it whole


def test_redact_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", REDIS_URL)
    assert PASSWORD not in redact(f"password {PASSWORD}")


def test_redact_is_cheap_per_message() -> None:
    env = {f"VAR_{i}": f"value-{i}" for i in range(300)} | {"GITHUB_TOKEN": "ghp_" + "x" * 36}
    message = "restore: S3 list on bucket 'b' failed: Could not connect to the endpoint URL " * 4
    start = time.perf_counter()
    for _ in range(200):
        redact(message, env)
    assert (time.perf_counter() - start) / 200 < 0.005


def test_every_plugin_setting_is_known_to_the_policy() -> None:
    """A new MEGACACHE_* setting must be listed as plain (or be a secret on purpose): otherwise its value is
    masked in every message, which is safe but unhelpful."""
    names = {option.env for option in OPTIONS}
    assert names - envpolicy.PLAIN_VALUES == {"MEGACACHE_ENDPOINT_URL"}  # may hold user:password@


def test_torch_repro_lines_are_scrubbed_in_place() -> None:
    """torch's FX graph artifact is a pickle holding a repro script with the compiler environment in it."""
    script = ("import os\n"
              f"os.environ['TORCHINDUCTOR_REDIS_URL'] = '{REDIS_URL}'\n"
              "os.environ['TORCHINDUCTOR_MAX_AUTOTUNE'] = '1'\n"
              "os.environ['TORCHINDUCTOR_CACHE_DIR'] = '/tmp/inductor'\n"
              "os.environ['TORCH_HUB_TOKEN'] = 'tok'\n"
              "os.environ['TORCHINDUCTOR_NEW_KNOB'] = 'caf\u00e9-value'\n"
              f"os.environ['TORCH_REMOTE_STORE'] = '{REDIS_URL}'\n"
              "os.environ['TORCH_COMPILE_DEBUG_DIR'] = '/home/ci/tok-4f2a9c/debug'\n"
              "os.environ['ATEN_CPU_CAPABILITY'] = 'avx2'\n")
    blob = pickle.dumps({"runnable_graph_str": script, "code": "def call(args): ..."}, protocol=4)
    scrubbed = envpolicy.scrub_torch_artifact(blob)
    assert len(scrubbed) == len(blob) and PASSWORD.encode() not in scrubbed
    loaded = pickle.loads(scrubbed)
    assert loaded["code"] == "def call(args): ..."
    lines = loaded["runnable_graph_str"].splitlines()
    assert lines[1] == "os.environ['TORCHINDUCTOR_REDIS_URL'] = '" + "*" * len(REDIS_URL) + "'"
    assert lines[2] == "os.environ['TORCHINDUCTOR_MAX_AUTOTUNE'] = '1'"  # shown in the fingerprint: kept
    # a path is not known to be harmless (it may hold a token): blanked like any value the fingerprint hides
    assert lines[3] == "os.environ['TORCHINDUCTOR_CACHE_DIR'] = '" + "*" * len("/tmp/inductor") + "'"
    assert lines[4] == "os.environ['TORCH_HUB_TOKEN'] = '***'"
    assert lines[5] == "os.environ['TORCHINDUCTOR_NEW_KNOB'] = '" + "*" * len("caf\u00e9-value".encode()) + "'"
    # torch copies names that merely contain TORCH (its own filter): those are blanked too, paths included
    assert lines[6] == "os.environ['TORCH_REMOTE_STORE'] = '" + "*" * len(REDIS_URL) + "'"
    assert lines[7] == "os.environ['TORCH_COMPILE_DEBUG_DIR'] = '" + "*" * len("/home/ci/tok-4f2a9c/debug") + "'"
    assert lines[8] == "os.environ['ATEN_CPU_CAPABILITY'] = 'avx2'"
    plain = pickle.dumps({"code": "no repro here"})
    assert envpolicy.scrub_torch_artifact(plain) is plain


# --- end to end: a real session with a credential in a variable torch reads ------------------------------


SECRETS = (PASSWORD, PASSWORD[::-1])  # the second run's, rotated

# The tests' own code reads the URL while Dynamo traces it: the frame's guards hold it, password included.
READS_THE_URL = TORCH_TESTS + textwrap.dedent(
    """
    import os

    def with_url(x):
        if os.environ.get("TORCHINDUCTOR_REDIS_URL", "").startswith("redis://"):
            return torch.sin(x) * 2 + 1  # f's graph
        return x

    def test_url():
        assert torch.allclose(torch.compile(with_url)(torch.zeros(8)), torch.ones(8))
    """
)


def _contains_secret(data: bytes) -> bool:
    return any(s.encode() in data or s.encode("utf-16-le") in data for s in SECRETS)


@pytest.mark.torch
def test_a_redis_password_reaches_no_output_report_summary_or_stored_object(pytester: pytest.Pytester) -> None:
    skip_without_torch()
    store = pytester.path / "store"
    summary = pytester.path / "step-summary.md"
    # torch reads TORCHINDUCTOR_REDIS_URL only for a remote cache, which is off unless asked for (and the redis
    # package is absent here): setting it costs nothing, but the fingerprint used to copy it everywhere. The
    # project's own code reads it too, in a compiled frame (Dynamo reuse on, the plugin's default).
    project = TorchProject(pytester, env={"MEGACACHE_DIR": str(store), "GITHUB_STEP_SUMMARY": str(summary),
                                          "TORCHINDUCTOR_REDIS_URL": REDIS_URL}, tests=READS_THE_URL, dynamo_reuse=True)
    cold = project.run("-k", "test_f or test_url", "-v")
    cold.result.assert_outcomes(passed=2, deselected=2)
    assert cold.fx_misses == 1
    assert cold.report is not None and cold.report["upload"]["objects"] == 1

    # A second session with the password rotated: another key, so nothing is restored, and the diagnosis of
    # why compares the stored fingerprint with this one.
    rotated = project.run("-k", "test_f or test_url", "-v",
                          env={"TORCHINDUCTOR_REDIS_URL": REDIS_URL.replace(*SECRETS)})
    assert rotated.report is not None and rotated.report["upload"]["objects"] == 1
    assert rotated.report["fingerprint"]["key"] != cold.report["fingerprint"]["key"]
    why = rotated.report["restore"]["why_miss"]
    assert why and "TORCHINDUCTOR_REDIS_URL" in why, why

    for run in (cold, rotated):
        output = "\n".join(run.result.outlines + run.result.errlines)
        assert "fingerprint torch-" in output  # the plugin did report...
        report_text = (run.root / "report.json").read_text()
        for secret in SECRETS:
            assert secret not in output  # ...without the password
            assert secret not in report_text
        env_part = run.report and run.report["fingerprint"]["env"]
        assert env_part and re.fullmatch(r"hidden:[0-9a-f]{16}", env_part["TORCHINDUCTOR_REDIS_URL"])
    summary_text = summary.read_text()
    assert summary_text.count("### pytest-megacache") == 2
    assert not any(secret in summary_text for secret in SECRETS)

    stored = sorted(p for p in store.rglob("*") if p.is_file())
    objects = [p for p in stored if p.suffix == ".mcb"]
    assert len(objects) == 2, stored
    for path in stored:
        assert not _contains_secret(path.read_bytes()), path
        assert not any(secret in str(path) for secret in SECRETS)
    leaks: list[bundlemod.Entry] = []
    for path in objects:
        header, entries = bundlemod.decode(path.read_bytes())
        assert not _contains_secret(json.dumps(header.to_doc(), default=str).encode())
        producer = header.extra.get("producer")
        assert isinstance(producer, dict) and "TORCHINDUCTOR_REDIS_URL" in producer["fingerprint_parts"]["env"]
        assert not _contains_secret("".join(entry.name for entry in entries).encode())
        leaks.extend(entry for entry in entries if _contains_secret(entry.data))
    assert not any(_contains_secret(p.read_bytes()) for p in project.pytester.path.glob("run*/*.json"))
    # The payloads: torch copies the environment into the repro script of the FX graphs it caches; the upload
    # blanks what no report would show (envpolicy.scrub_torch_artifact), so no stored entry carries it. And the
    # Dynamo entry of the frame that read the URL holds it in its guards: left out, with one warning naming the
    # variable; f's is stored.
    assert leaks == [], [(e.kind, e.name) for e in leaks]
    for run in (cold, rotated):
        assert run.report is not None and run.report["upload"]["new_entries"].get("torch/precompile") == 1
        assert run.report["torch"]["counters"]["dynamo_traced"] == 2, run.report["torch"]["counters"]
        run.result.stdout.fnmatch_lines(["*not storing 1 compiled entries: they hold the value of "
                                         "TORCHINDUCTOR_REDIS_URL, which may be a secret*"])
