"""torch's mega-cache container, written and parsed without torch: round trips and every refusal."""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
import textwrap
import zlib

import pytest

from pytest_megacache import torchfmt
from pytest_megacache.errors import BundleError

INDUCTOR_KEY = "fxpoffplbxbjkl6adxzslxy2v3cmyu6dxzrndazikly7vvtpsfzi"
AOT_KEY = "aixem2oublb7ydve55swxbe65rd27vtrcrew7pckuk3k7nxk7jvq"
AUTOTUNE_KEY = "ab/cabc123def.best_config"
PGO_KEY = "code_state_myjob_0"

ARTIFACTS: list[tuple[str, str, bytes]] = [
    ("inductor", INDUCTOR_KEY, b"\x00fx graph\xff" * 10),
    ("aot_autograd", AOT_KEY, b"aot entry"),
    ("autotune", AUTOTUNE_KEY, b'{"XBLOCK": 128}'),
    ("pgo", PGO_KEY, b""),
    ("precompile", "source_id_123", b"precompiled"),
]


# --- hand-built containers ---------------------------------------------------------------------------


def u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def blob(data: bytes) -> bytes:
    return u64(len(data)) + data


def text(value: str) -> bytes:
    return blob(base64.b64encode(value.encode()))


def seal(body: bytes) -> bytes:
    """Prefix ``body`` (version onwards) with its correct CRC, so only the structure can be refused."""
    return zlib.crc32(body).to_bytes(4, "big") + body


def section(artifact_type: str, items: list[tuple[str, bytes]], count: int | None = None) -> bytes:
    out = text(artifact_type) + u64(len(items) if count is None else count)
    for key, content in items:
        out += text(key) + blob(content)
    return out


VERSION = u64(torchfmt.ENCODING_VERSION)


# --- round trips -------------------------------------------------------------------------------------


def test_round_trip_keeps_every_artifact() -> None:
    data = torchfmt.serialize(ARTIFACTS)
    assert sorted(torchfmt.parse(data)) == sorted(ARTIFACTS)


def test_serialize_matches_the_documented_layout() -> None:
    data = torchfmt.serialize([("inductor", INDUCTOR_KEY, b"abc")])
    assert data == seal(VERSION + section("inductor", [(INDUCTOR_KEY, b"abc")]))


def test_empty_container_round_trips() -> None:
    data = torchfmt.serialize([])
    assert data == seal(VERSION)
    assert torchfmt.parse(data) == []


def test_one_section_per_type_when_the_input_repeats_a_type() -> None:
    key2 = "abcdefgh12345678"
    artifacts = [
        ("inductor", INDUCTOR_KEY, b"one"),
        ("pgo", PGO_KEY, b"pgo"),
        ("inductor", key2, b"two"),
    ]
    data = torchfmt.serialize(artifacts)
    type_name = base64.b64encode(b"inductor")
    assert data.count(type_name) == 1
    expected = seal(VERSION + section("inductor", [(INDUCTOR_KEY, b"one"), (key2, b"two")])
                    + section("pgo", [(PGO_KEY, b"pgo")]))
    assert data == expected
    assert torchfmt.parse(data) == [("inductor", INDUCTOR_KEY, b"one"), ("inductor", key2, b"two"),
                                    ("pgo", PGO_KEY, b"pgo")]


def test_serialize_keeps_the_last_content_of_a_repeated_key() -> None:
    # As torch: an artifact recorded again under its key (a grown dynamic-shape profile) is the current one.
    data = torchfmt.serialize([("inductor", INDUCTOR_KEY, b"first"), ("inductor", INDUCTOR_KEY, b"second")])
    assert torchfmt.parse(data) == [("inductor", INDUCTOR_KEY, b"second")]


def test_parse_accepts_a_hand_built_container_with_two_sections_of_one_type() -> None:
    # torch itself may append several sections of one type; parse must read them all.
    key2 = "abcdefgh12345678"
    data = seal(VERSION + section("inductor", [(INDUCTOR_KEY, b"a")]) + section("inductor", [(key2, b"b")]))
    assert torchfmt.parse(data) == [("inductor", INDUCTOR_KEY, b"a"), ("inductor", key2, b"b")]


# --- refusals ----------------------------------------------------------------------------------------


def test_too_short() -> None:
    with pytest.raises(BundleError, match="too short"):
        torchfmt.parse(b"\x00" * 11)


def test_bad_crc() -> None:
    data = bytearray(torchfmt.serialize(ARTIFACTS))
    data[-1] ^= 0x01
    with pytest.raises(BundleError, match="CRC mismatch"):
        torchfmt.parse(bytes(data))


def test_wrong_version() -> None:
    with pytest.raises(BundleError, match="version 2 is not 1"):
        torchfmt.parse(seal(u64(2)))


def test_count_larger_than_the_artifacts_present() -> None:
    body = VERSION + section("inductor", [(INDUCTOR_KEY, b"x")], count=5)
    with pytest.raises(BundleError, match="truncated in inductor key length"):
        torchfmt.parse(seal(body))


def test_count_says_two_but_the_data_ends_after_one() -> None:
    # Sixteen stray bytes pass the "can the count fit" check; the second key's length then overruns.
    body = VERSION + section("inductor", [(INDUCTOR_KEY, b"x")], count=2) + u64(100) + b"\x00" * 8
    with pytest.raises(BundleError, match="inductor key length 100 exceeds the 8 bytes left"):
        torchfmt.parse(seal(body))


def test_length_field_exceeding_the_remaining_bytes() -> None:
    body = VERSION + text("inductor") + u64(1) + text(INDUCTOR_KEY) + u64(1000) + b"short"
    with pytest.raises(BundleError, match=r"inductor content length 1000 exceeds the 5 bytes left"):
        torchfmt.parse(seal(body))


def test_type_name_length_exceeding_the_remaining_bytes() -> None:
    body = VERSION + u64(2**40) + b"aW5kdWN0b3I="
    with pytest.raises(BundleError, match="type name length"):
        torchfmt.parse(seal(body))


def test_huge_count() -> None:
    body = VERSION + text("inductor") + u64(2**63) + text(INDUCTOR_KEY) + blob(b"x")
    with pytest.raises(BundleError, match=f"{2**63} inductor artifacts cannot fit"):
        torchfmt.parse(seal(body))


def test_truncated_inside_a_length_field() -> None:
    body = VERSION + text("inductor")[:5]
    with pytest.raises(BundleError, match="truncated in type name length"):
        torchfmt.parse(seal(body))


def test_unknown_type_name() -> None:
    with pytest.raises(BundleError, match="unknown torch artifact type 'evil'"):
        torchfmt.parse(seal(VERSION + section("evil", [("abcdefgh", b"x")])))


def test_non_base64_type_name() -> None:
    body = VERSION + blob(b"not base64!!") + u64(0)
    with pytest.raises(BundleError, match="type name is not base64"):
        torchfmt.parse(seal(body))


def test_non_utf8_key() -> None:
    body = VERSION + text("pgo") + u64(1) + blob(base64.b64encode(b"\xff\xfe")) + blob(b"x")
    with pytest.raises(BundleError, match="pgo key is not base64 UTF-8"):
        torchfmt.parse(seal(body))


UNSAFE_KEYS = [
    ("inductor", "../../etc/passwd"),
    ("inductor", "/abs"),
    ("inductor", "a/../b"),
    ("inductor", ""),
    ("inductor", "abcdefgh\x00ijkl"),
    ("aot_autograd", "../aixem2oublb7ydve55swxbe65rd27"),
    ("autotune", "../cabc123def.best_config"),
    ("autotune", "ab/../cabc.best_config"),
    ("autotune", "ab/c..d.best_config"),
    ("autotune", "/ab/cabc123def.best_config"),
    ("autotune", ""),
    ("pgo", ".."),
    ("pgo", "code..state"),
    ("pgo", ".hidden"),
    ("pgo", "a\\b"),
    ("pgo", ""),
    ("pgo", "code_state\x00"),
    ("precompile", "../x"),
]


@pytest.mark.parametrize(("artifact_type", "key"), UNSAFE_KEYS)
def test_parse_refuses_unsafe_keys(artifact_type: str, key: str) -> None:
    data = seal(VERSION + section(artifact_type, [(key, b"payload")]))
    with pytest.raises(BundleError, match=f"unsafe {artifact_type} key"):
        torchfmt.parse(data)


@pytest.mark.parametrize(("artifact_type", "key"), UNSAFE_KEYS)
def test_serialize_refuses_unsafe_keys(artifact_type: str, key: str) -> None:
    with pytest.raises(BundleError, match=f"unsafe {artifact_type} key"):
        torchfmt.serialize([(artifact_type, key, b"payload")])


def test_serialize_refuses_unknown_types() -> None:
    with pytest.raises(BundleError, match="unknown torch artifact type"):
        torchfmt.serialize([("fx_graph", INDUCTOR_KEY, b"x")])


@pytest.mark.parametrize(
    ("artifact_type", "key"),
    [
        ("inductor", INDUCTOR_KEY),
        ("aot_autograd", AOT_KEY),
        ("autotune", AUTOTUNE_KEY),
        ("pgo", PGO_KEY),
        ("precompile", "source_id_123"),
    ],
)
def test_validate_key_accepts_realistic_keys(artifact_type: str, key: str) -> None:
    torchfmt.validate_key(artifact_type, key)  # must not raise
    assert torchfmt.parse(torchfmt.serialize([(artifact_type, key, b"c")])) == [(artifact_type, key, b"c")]


def test_known_types_match_the_key_patterns() -> None:
    assert {"inductor", "aot_autograd", "autotune", "pgo", "precompile"} == torchfmt.KNOWN_TYPES


# --- compatibility with torch's own reader -----------------------------------------------------------

_TORCH_READER = textwrap.dedent(
    """
    import json, sys
    from torch.compiler._cache import CacheArtifactManager
    result = CacheArtifactManager.deserialize(sys.stdin.buffer.read())
    assert result is not None, "torch refused the container"
    print(json.dumps({t: [[a.key, a.content.hex()] for a in arts] for t, arts in result.items()}))
    """
)


@pytest.mark.torch  # a process importing torch: seconds
def test_torch_reads_what_we_write() -> None:
    # Skip without torch, but never import it here: that takes seconds and changes the whole process.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    data = torchfmt.serialize(ARTIFACTS)
    proc = subprocess.run([sys.executable, "-c", _TORCH_READER], input=data, capture_output=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    decoded = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    expected: dict[str, list[list[str]]] = {}
    for artifact_type, key, content in ARTIFACTS:
        expected.setdefault(artifact_type, []).append([key, content.hex()])
    assert decoded == expected


def test_pgo_keys_of_a_job_id_with_slashes_are_accepted() -> None:
    """TORCH_COMPILE_JOB_ID=myorg/myrepo gives pgo keys like 'myorg/myrepo:None:'; torch turns '/' into '_'
    before such a key names a file, so the container is accepted as it is."""
    data = seal(VERSION + section("pgo", [("myorg/myrepo:None:", b"profile")]))
    assert torchfmt.parse(data) == [("pgo", "myorg/myrepo:None:", b"profile")]


def test_parse_can_skip_and_name_unsafe_keys() -> None:
    data = seal(VERSION + section("pgo", [("../escape", b"bad"), ("job:None:", b"good")]))
    skipped: list[str] = []
    assert torchfmt.parse(data, skipped) == [("pgo", "job:None:", b"good")]
    assert skipped == ["unsafe pgo key '../escape'"]
