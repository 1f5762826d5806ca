"""torch 2.7: its cache container (the ``records`` layout), its compile callbacks (called without arguments) and
its ``CacheInfo``, without torch 2.7 installed. compat/ runs the same paths against the real torch 2.7
(``tox -e torch27``)."""

from __future__ import annotations

import enum
import sys
import zlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

from pytest_megacache import torchfmt
from pytest_megacache.errors import BundleError
from pytest_megacache.torch_adapter import MegaCache, TorchAdapter

INDUCTOR_KEY = "fxpoffplbxbjkl6adxzslxy2v3cmyu6dxzrndazikly7vvtpsfzi"
AOT_KEY = "aixem2oublb7ydve55swxbe65rd27vtrcrew7pckuk3k7nxk7jvq"
AUTOTUNE_KEY = "ab/cabc123def.best_config"
PGO_KEY = "code_state_myjob_0"
ARTIFACTS = [
    ("inductor", INDUCTOR_KEY, b"\x00fx graph\xff" * 10),
    ("aot_autograd", AOT_KEY, b"aot entry"),
    ("autotune", AUTOTUNE_KEY, b'{"XBLOCK": 128}'),
    ("pgo", PGO_KEY, b""),
]


class CacheArtifactType(enum.Enum):
    """torch 2.7's ``torch/compiler/_cache.py``."""

    INDUCTOR = 0
    AUTOTUNE = 1
    AOT_AUTOGRAD = 2
    PGO = 3


def torch27_container(artifacts: list[tuple[str, str, bytes]]) -> bytes:
    """What torch 2.7's ``save_cache_artifacts`` writes (``torch/utils/_appending_byte_serializer.py``: a uint64
    version, then per artifact ``CacheArtifact.serialize``: the type's enum value, the key as write_str, the
    content as write_bytes), transcribed from its source."""
    data = bytearray()

    def write_uint64(i: int) -> None:
        data.extend(i.to_bytes(8, byteorder="big", signed=False))

    def write_bytes(b: bytes) -> None:
        write_uint64(len(b))
        data.extend(b)

    write_uint64(1)
    for kind, key, content in artifacts:
        write_uint64(CacheArtifactType[kind.upper()].value)
        write_bytes(key.encode("utf-8"))
        write_bytes(content)
    return bytes(data)


# --- the container ------------------------------------------------------------------------------------------

def test_torch27s_container_parses() -> None:
    data = torch27_container(ARTIFACTS)
    assert torchfmt.layout_of(data) == torchfmt.RECORDS
    assert torchfmt.parse(data) == ARTIFACTS


def test_an_empty_torch27_container_is_empty_not_too_short() -> None:
    # A session that compiled nothing: torch 2.7 saves the version alone (8 bytes).
    assert torchfmt.parse(torch27_container([])) == []


def test_serialize_writes_exactly_what_torch27_writes() -> None:
    assert torchfmt.serialize(ARTIFACTS, torchfmt.RECORDS) == torch27_container(ARTIFACTS)


def test_the_two_layouts_convert_both_ways() -> None:
    sections = torchfmt.serialize(ARTIFACTS)
    assert torchfmt.layout_of(sections) == torchfmt.SECTIONS
    records = torchfmt.serialize(torchfmt.parse(sections), torchfmt.RECORDS)
    assert records == torch27_container(ARTIFACTS)
    assert torchfmt.serialize(torchfmt.parse(records)) == sections


def test_records_keep_the_last_content_of_a_repeated_key() -> None:
    data = torchfmt.serialize([("pgo", PGO_KEY, b"one"), ("pgo", PGO_KEY, b"two")], torchfmt.RECORDS)
    assert torchfmt.parse(data) == [("pgo", PGO_KEY, b"two")]


def test_a_sections_container_never_reads_as_records() -> None:
    # Its first four bytes are a checksum and the next four the version's high bytes (zero): whatever the
    # checksum, the first eight bytes are never the version alone.
    for artifacts in ([], ARTIFACTS, ARTIFACTS[:1]):
        assert torchfmt.layout_of(torchfmt.serialize(artifacts)) == torchfmt.SECTIONS


def test_torch27_has_no_precompile_artifacts() -> None:
    with pytest.raises(BundleError, match="no precompile"):
        torchfmt.serialize([("precompile", "source_id_123", b"x")], torchfmt.RECORDS)
    with pytest.raises(ValueError, match="layout"):
        torchfmt.serialize(ARTIFACTS, "pickle")


@pytest.mark.parametrize("cut", [9, 16, 20, 30, 70, -1])
def test_a_truncated_torch27_container_is_refused(cut: int) -> None:
    # torch 2.7's own reader runs past the end of a cut container and never stops (its cursor never equals the
    # length again; a 34-byte one held torch 2.7.0's load_cache_artifacts for 5 s and 775 MB): never handed to it.
    data = torch27_container(ARTIFACTS)
    with pytest.raises(BundleError, match=r"truncated|exceeds"):
        torchfmt.parse(data[:cut])


def test_an_unknown_type_number_is_refused() -> None:
    data = bytearray(torch27_container(ARTIFACTS[:1]))
    data[8:16] = (4).to_bytes(8, "big")
    with pytest.raises(BundleError, match="type number 4"):
        torchfmt.parse(bytes(data))


def test_a_non_utf8_key_is_refused() -> None:
    data = (1).to_bytes(8, "big") + (0).to_bytes(8, "big") + (2).to_bytes(8, "big") + b"\xff\xfe"
    data += (0).to_bytes(8, "big")
    with pytest.raises(BundleError, match="not UTF-8"):
        torchfmt.parse(data)


def test_unsafe_keys_are_refused_or_skipped_as_in_the_other_layout() -> None:
    data = torch27_container([("pgo", "../escape", b"bad"), ("pgo", "job:None:", b"good")])
    with pytest.raises(BundleError, match="unsafe pgo key"):
        torchfmt.parse(data)
    skipped: list[str] = []
    assert torchfmt.parse(data, skipped) == [("pgo", "job:None:", b"good")]
    assert skipped == ["unsafe pgo key '../escape'"]
    with pytest.raises(BundleError, match="unsafe"):
        torchfmt.serialize([("inductor", "/etc/passwd", b"")], torchfmt.RECORDS)


def test_a_records_container_has_no_checksum_to_check() -> None:
    # torch 2.7 wrote none; the sections layout still refuses a bad one.
    data = torch27_container(ARTIFACTS)
    assert zlib.crc32(data[4:]) != int.from_bytes(data[:4], "big")
    assert torchfmt.parse(data) == ARTIFACTS


# --- the adapter --------------------------------------------------------------------------------------------

def modules(*, checksum: bool, factory: bool, enum_type: Any = CacheArtifactType) -> dict[str, ModuleType]:
    serializer = ModuleType("torch.utils._appending_byte_serializer")
    cache = ModuleType("torch.compiler._cache")
    if checksum:
        serializer.CHECKSUM_DIGEST_SIZE = 4  # type: ignore[attr-defined]
    if factory:
        cache.CacheArtifactFactory = object  # type: ignore[attr-defined]
    if enum_type is not None:
        cache.CacheArtifactType = enum_type  # type: ignore[attr-defined]
    return {serializer.__name__: serializer, cache.__name__: cache}


class OtherTypes(enum.Enum):
    INDUCTOR = 0
    AOT_AUTOGRAD = 1


@pytest.mark.parametrize("shape,layout", [
    (dict(checksum=True, factory=True, enum_type=None), torchfmt.SECTIONS),  # torch 2.8 and later
    (dict(checksum=False, factory=False), torchfmt.RECORDS),  # torch 2.7
    (dict(checksum=True, factory=False, enum_type=None), None),
    (dict(checksum=False, factory=False, enum_type=OtherTypes), None),
    (dict(checksum=False, factory=False, enum_type=None), None),
])
def test_the_adapter_reads_the_layout_from_torch(monkeypatch: pytest.MonkeyPatch, shape: dict[str, Any],
                                                 layout: str | None) -> None:
    for name, module in modules(**shape).items():
        monkeypatch.setitem(sys.modules, name, module)
    assert MegaCache.container_layout() == layout


def test_the_adapter_knows_no_layout_before_torch_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch.compiler._cache", raising=False)
    assert MegaCache.container_layout() is None


@dataclass
class CacheInfo27:
    """torch 2.7's CacheInfo: one list per type."""

    inductor_artifacts: list[str] = field(default_factory=list)
    autotune_artifacts: list[str] = field(default_factory=list)
    aot_autograd_artifacts: list[str] = field(default_factory=list)
    pgo_artifacts: list[str] = field(default_factory=list)


@dataclass
class CacheInfo28:
    artifacts: dict[str, list[str]] = field(default_factory=dict)


def test_loaded_counts_from_either_cache_info() -> None:
    assert MegaCache.loaded_counts(CacheInfo27(["a", "b"], [], ["c"])) == {"inductor": 2, "aot_autograd": 1}
    assert MegaCache.loaded_counts(CacheInfo28({"inductor": ["a"], "precompile": ["p"]})) == {
        "inductor": 1, "precompile": 1}


@dataclass(frozen=True)
class Artifact27:
    type: CacheArtifactType
    key: str


@dataclass(frozen=True)
class Artifact28:
    key: str

    def type(self) -> str:
        return "aot_autograd"


def test_attribution_reads_torch27s_artifact_type(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ModuleType("torch.compiler._cache")
    manager = type("CacheArtifactManager", (), {"_seen_artifacts": [Artifact27(CacheArtifactType.INDUCTOR, "fxabc"),
                                                                     Artifact28("aiabc")]})
    cache.CacheArtifactManager = manager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.compiler._cache", cache)
    assert TorchAdapter._seen() == [("inductor", "fxabc"), ("aot_autograd", "aiabc")]


@pytest.mark.parametrize("args", [(), ("torch 2.8's CallbackArgs",)], ids=["torch2.7-no-args", "torch2.8-one-arg"])
def test_compile_callbacks_take_what_each_torch_passes(args: tuple[Any, ...]) -> None:
    calls: list[int] = []
    adapter = TorchAdapter(lambda: calls.append(1))
    adapter._on_start(*args)
    adapter._on_end(*args)
    adapter._on_start(*args)
    adapter._on_end(*args)
    assert calls == [1] and adapter.compiles == 2 and adapter.compile_seconds >= 0


def test_a_fault_in_the_first_compile_never_reaches_torch() -> None:
    # torch 2.7 counts pending callbacks: a start callback that raised failed every later compile of the process.
    def boom() -> None:
        raise RuntimeError("the store went away")

    adapter = TorchAdapter(boom)
    adapter._on_start()
    adapter._on_end()
    adapter._on_start()
    assert adapter.compiles == 2 and adapter.first_compile_seen
