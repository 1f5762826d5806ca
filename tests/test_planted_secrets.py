"""Secrets planted in variables torch copies reach no stored byte, report, terminal line or step summary.

torch's repro text (inside every FX graph it caches, in-process or in a child process's cache files) copies each
variable whose name *contains* TORCH, DYNAMO, INDUCTOR or TRITON. The planted values cover the prefix form, names
that merely contain one of those words, and a token inside a path; a child process compiles too, so its cache files
travel as well.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from pytest_megacache import bundle as bundlemod
from pytest_megacache import envpolicy
from pytest_megacache.errors import redact
from pytest_megacache.files import torch_cache_ident

from .helpers_torch import TorchProject, skip_without_torch

PLANTED = {
    "TORCHINDUCTOR_REDIS_URL": "redis://ci:Pl4ntedPrefixPw1@cache.example:6379/0",  # prefix form, URL password
    "TORCH_REMOTE_STORE": "redis://ci:Pl4ntedSubstrPw2@store.example/0",  # starts with TORCH_, no known prefix
    "MY_PYTORCH_OPTION": "Pl4ntedInsideName3",  # the word inside the name
    "CI_DYNAMO_SETTING": "Pl4ntedDynamoValue4",
}
PATH_TOKEN = "tok-Pl4ntedPathToken5"
# A credential the tests' own code reads while Dynamo traces it: the frame's guards hold its value.
READ_BY_A_FRAME = ("SERVICE_API_TOKEN", "Pl4ntedFrameToken7")
SECRETS = [*(value.split("@")[0].rsplit(":", 1)[-1] if "@" in value else value for value in PLANTED.values()),
           PATH_TOKEN, READ_BY_A_FRAME[1]]

SECRET_TESTS = textwrap.dedent(
    """
    import os, subprocess, sys, textwrap
    import torch

    def f(x):
        return torch.sin(x) * 2 + 1

    def test_here():
        assert torch.allclose(torch.compile(f)(torch.zeros(8)), torch.ones(8))

    TOKEN = os.environ["SERVICE_API_TOKEN"]

    def with_token(x):
        # the credential read at trace time, as a global computed from it and from os.environ (f's graph)
        if TOKEN and os.environ.get("SERVICE_API_TOKEN") == TOKEN:
            return torch.sin(x) * 2 + 1
        return x

    def test_a_frame_reads_a_credential():
        assert torch.allclose(torch.compile(with_token)(torch.zeros(8)), torch.ones(8))

    def test_in_a_child(tmp_path):
        child = tmp_path / "child.py"
        child.write_text(textwrap.dedent('''
            import torch
            def g(x):
                return torch.relu(x - 0.5).cumsum(0)
            out = torch.compile(g)(torch.ones(8))
            assert torch.allclose(out, torch.arange(1, 9) * 0.5)
        '''))
        subprocess.run([sys.executable, str(child)], check=True, timeout=300)
    """
)


def _leaks(data: bytes) -> list[str]:
    return [s for s in SECRETS if s.encode() in data or s.encode("utf-16-le") in data]


def test_messages_mask_what_torch_copies() -> None:
    env = {**PLANTED, "TORCH_COMPILE_DEBUG_DIR": f"/home/ci/{PATH_TOKEN}/debug"}
    text = " ".join(env.values())
    out = redact(text, env)
    assert _leaks(out.encode()) == [], out
    # the compiler's cache directories stay readable in messages: the plugin names them itself
    assert redact("/tmp/ind-cache here", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/ind-cache"}) == "/tmp/ind-cache here"


def test_an_entry_holding_a_credential_outside_torchs_repro_lines_is_not_stored() -> None:
    env = {**PLANTED, "HF_TOKEN": "hf_Pl4ntedToken6", "AWS_ACCESS_KEY_ID": "testing",
           "PYTORCH_TEST_ROOT": "/home/runner/work/project"}
    pieces = envpolicy.stored_pieces(env)
    assert envpolicy.stored_secret(b"\x00 hf_Pl4ntedToken6 \x00", pieces) == "HF_TOKEN"
    assert envpolicy.stored_secret("x Pl4ntedSubstrPw2 y".encode("utf-16-le"), pieces) == "TORCH_REMOTE_STORE"
    assert envpolicy.stored_secret(b"redis://ci:Pl4ntedPrefixPw1@", pieces) == "TORCHINDUCTOR_REDIS_URL"
    # a plain value of a torch-named variable (torch copies it only into its repro lines, which are blanked), a path
    # that source locations in a graph hold by coincidence, and a word too short to be a credential: not searched for
    assert envpolicy.stored_secret(b"\x00 Pl4ntedInsideName3 \x00", pieces) is None
    assert envpolicy.stored_secret(b"File /home/runner/work/project/model.py", pieces) is None
    assert envpolicy.stored_secret(b"testing", pieces) is None
    assert envpolicy.stored_secret(b"harmless bytes", pieces) is None


@pytest.mark.torch
def test_planted_secrets_reach_no_stored_byte_report_output_or_summary(pytester: pytest.Pytester) -> None:
    skip_without_torch()
    store = pytester.path / "store"
    summary = pytester.path / "step-summary.md"
    env = {"MEGACACHE_DIR": str(store), "GITHUB_STEP_SUMMARY": str(summary), **PLANTED,
           "TORCH_COMPILE_DEBUG_DIR": str(pytester.path / PATH_TOKEN / "debug"), READ_BY_A_FRAME[0]: READ_BY_A_FRAME[1]}
    # On the plugin's defaults: Dynamo reuse on, so Dynamo's entries (guards, bytecode, graphs) are stored too
    project = TorchProject(pytester, env=env, tests=SECRET_TESTS, dynamo_reuse=True)
    cold = project.run("-v")
    cold.result.assert_outcomes(passed=3)
    assert cold.report is not None and cold.report["upload"]["objects"] == 1
    warm = project.run("-v")
    warm.result.assert_outcomes(passed=3)

    for run in (cold, warm):
        output = "\n".join(run.result.outlines + run.result.errlines)
        assert "fingerprint torch-" in output  # the plugin did report...
        assert _leaks(output.encode()) == []  # ...without any planted value
        assert _leaks((run.root / "report.json").read_bytes()) == []
    summary_text = summary.read_text()
    assert summary_text.count("### pytest-megacache") == 2 and _leaks(summary_text.encode()) == []

    stored = sorted(p for p in store.rglob("*") if p.is_file())
    assert stored and all(_leaks(p.read_bytes()) == [] and _leaks(str(p).encode()) == [] for p in stored)
    entries: list[bundlemod.Entry] = []
    for path in (p for p in stored if p.suffix == ".mcb"):
        header, decoded = bundlemod.decode(path.read_bytes())
        assert _leaks(json.dumps(header.to_doc(), default=str).encode()) == []
        entries.extend(decoded)
    leaking = [(e.kind, e.name, _leaks(e.data)) for e in entries if _leaks(e.data) or _leaks(e.name.encode())]
    assert leaking == []

    # The check above can fail: the child's FX graph travelled as a file, and torch did copy the planted variables
    # into the repro text of what was stored (blanked to the same length).
    child_graphs = [e for e in entries if e.kind == "file/inductor" and torch_cache_ident(e.name) is not None
                    and torch_cache_ident(e.name)[0] == "torch/inductor"]  # type: ignore[index]
    assert child_graphs, sorted({e.kind for e in entries})
    blob = b"".join(e.data for e in entries)
    for name, value in {**PLANTED, "TORCH_COMPILE_DEBUG_DIR": env["TORCH_COMPILE_DEBUG_DIR"]}.items():
        line = f"os.environ['{name}'] = '{'*' * len(value.encode())}'".encode()
        assert line in blob, name
    assert any(b"os.environ['MY_PYTORCH_OPTION'] = '" + b"*" * len(PLANTED["MY_PYTORCH_OPTION"]) in e.data
               for e in child_graphs)

    # Dynamo's entries: f's was stored, and the warm run took its frame from it; the entry of the frame that read the
    # credential was left out (one warning names the variable, never its value), so the warm run traced that frame
    # again, and did not store it either.
    assert sum(e.kind == "torch/precompile" for e in entries) == 1, sorted({e.kind for e in entries})
    assert cold.report["upload"]["new_entries"].get("torch/precompile") == 1, cold.report["upload"]
    cold.result.stdout.fnmatch_lines([f"*not storing 1 compiled entries: they hold the value of {READ_BY_A_FRAME[0]},*"])
    assert warm.report is not None
    counters = warm.report["torch"]["counters"]
    assert (counters["dynamo_frames_reused"], counters["dynamo_traced"]) == (1, 1), counters
    assert "torch/precompile" not in warm.report["upload"]["new_entries"], warm.report["upload"]
    # The scrubbed entries still load: the frame traced again looks its graph (f's) up and hits (the AOTAutograd
    # entry holds the compiled graph).
    assert warm.aot_hits >= 1 and warm.aot_misses == warm.fx_misses == 0, warm.counters
