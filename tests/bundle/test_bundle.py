"""The bundle format: round trips, entry-set semantics, and every refusal of a hostile object."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import zstandard

from pytest_megacache import bundle, torchfmt
from pytest_megacache.bundle import Entries, Entry, Limits
from pytest_megacache.errors import BundleError

FP = "torch-2.13.0/cpu-avx2-t4/py3.11-linux-x86_64/0123456789ab"
INDUCTOR_KEY = "fxpoffplbxbjkl6adxzslxy2v3cmyu6dxzrndazikly7vvtpsfzi"
AOT_KEY = "aixem2oublb7ydve55swxbe65rd27vtrcrew7pckuk3k7nxk7jvq"


def sample_entries() -> Entries:
    return Entries([
        Entry("torch/inductor", INDUCTOR_KEY, b"\x00graph\xff" * 50),
        Entry("torch/aot_autograd", AOT_KEY, b"aot"),
        Entry("torch/autotune", "ab/cabc123def.best_config", b"{}"),
        Entry("file/inductor", "ab/cabc123def.so", b"\x7fELF" + bytes(range(256)), 0o755),
        Entry("file/inductor", "ab/cabc123def.cpp", b"int main() {}", 0o644),
        Entry("file/triton", "deadbeef/kernel.cubin", b"", 0o644),
    ])


def as_tuples(entries: Entries) -> list[tuple[str, str, bytes, int]]:
    return [(e.kind, e.name, e.data, e.mode) for e in entries]


# --- hand-built objects ------------------------------------------------------------------------------

DROP = object()


def raw_entry(kind: str, name: str, data: bytes, mode: int = 0o644) -> bytes:
    k, n = kind.encode(), name.encode()
    return (len(k).to_bytes(1, "big") + k + len(n).to_bytes(2, "big") + n + mode.to_bytes(4, "big")
            + len(data).to_bytes(8, "big") + data)


def raw_payload(*entries: bytes, count: int | None = None, trailing: bytes = b"") -> bytes:
    n = len(entries) if count is None else count
    return bundle.PAYLOAD_MAGIC + n.to_bytes(4, "big") + b"".join(entries) + trailing


def build(raw: bytes, *, payload: bytes | None = None, **overrides: Any) -> bytes:
    """An object whose header is correct for ``payload`` (``raw`` zstd-compressed by default), then overridden."""
    if payload is None:
        payload = zstandard.ZstdCompressor().compress(raw)
    doc: dict[str, Any] = {
        "format": 1,
        "fingerprint": FP,
        "payload_size": len(payload),
        "raw_size": len(raw),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "entries": 1,
        "created": 1.0,
    }
    doc.update(overrides)
    doc = {k: v for k, v in doc.items() if v is not DROP}
    header = json.dumps(doc).encode()
    return bundle.MAGIC + bytes([bundle.FORMAT_VERSION]) + len(header).to_bytes(4, "big") + header + payload


def frame(header: bytes, payload: bytes = b"", version: int = bundle.FORMAT_VERSION) -> bytes:
    return bundle.MAGIC + bytes([version]) + len(header).to_bytes(4, "big") + header + payload


# --- round trips -------------------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    entries = sample_entries()
    blob = bundle.encode(entries, FP, extra={"run": "ci-42"})
    assert blob.startswith(bundle.MAGIC + bytes([bundle.FORMAT_FRAMED]))
    header, decoded = bundle.decode(blob, expected_fingerprint=FP)
    assert as_tuples(decoded) == as_tuples(entries)
    assert header.fingerprint == FP
    assert header.entries == len(entries) == 6
    assert header.extra == {"run": "ci-42"}
    assert header.payload_size == len(blob) - (9 + int.from_bytes(blob[5:9], "big"))
    assert header.raw_size > header.payload_size  # the repeated graph bytes compress


def test_round_trip_of_an_empty_bundle() -> None:
    header, decoded = bundle.decode(bundle.encode(Entries(), FP))
    assert len(decoded) == 0
    assert header.entries == 0


def test_built_helper_matches_encode() -> None:
    # The hand-built objects the refusal tests use are valid when nothing is overridden.
    raw = raw_payload(raw_entry("file/inductor", "a/b.so", b"so", 0o755))
    _, decoded = bundle.decode(build(raw))
    assert as_tuples(decoded) == [("file/inductor", "a/b.so", b"so", 0o755)]


def test_modes_lose_special_and_group_or_world_write_bits() -> None:
    raw = raw_payload(raw_entry("file/inductor", "a.so", b"x", 0o4777))
    _, decoded = bundle.decode(build(raw))
    assert [e.mode for e in decoded] == [0o755]
    blob = bundle.encode(Entries([Entry("file/inductor", "b.so", b"x", 0o6777)]), FP)
    assert [e.mode for e in bundle.decode(blob)[1]] == [0o755]


def test_encode_refuses_unsafe_entries() -> None:
    with pytest.raises(BundleError, match="unsafe file path"):
        bundle.encode(Entries([Entry("file/inductor", "../x", b"")]), FP)
    with pytest.raises(BundleError, match="unsafe inductor key"):
        bundle.encode(Entries([Entry("torch/inductor", "../../x", b"")]), FP)


# --- Entries -----------------------------------------------------------------------------------------


def test_entries_first_added_wins() -> None:
    entries = Entries([Entry("file/inductor", "a.so", b"first")])
    assert entries.add(Entry("file/inductor", "a.so", b"second")) is False
    assert entries.add(Entry("file/triton", "a.so", b"other root")) is True
    assert [e.data for e in entries] == [b"first", b"other root"]
    assert len(entries) == 2
    assert ("file/inductor", "a.so") in entries
    assert ("file/inductor", "b.so") not in entries


def test_entries_update_counts_what_was_new() -> None:
    entries = Entries([Entry("file/inductor", "a.so", b"1")])
    added = entries.update([Entry("file/inductor", "a.so", b"2"), Entry("file/inductor", "b.so", b"3"),
                            Entry("file/inductor", "b.so", b"4")])
    assert added == 1
    assert {e.name: e.data for e in entries} == {"a.so": b"1", "b.so": b"3"}


def test_entries_minus() -> None:
    entries = sample_entries()
    other = Entries([Entry("torch/inductor", INDUCTOR_KEY, b"different content"),
                     Entry("file/inductor", "not/there.so", b"")])
    left = entries.minus(other)
    assert ("torch/inductor", INDUCTOR_KEY) not in left
    assert len(left) == len(entries) - 1
    by_idents = entries.minus({("torch/aot_autograd", AOT_KEY), ("file/triton", "deadbeef/kernel.cubin")})
    assert {e.ident for e in by_idents} == {e.ident for e in entries} - {("torch/aot_autograd", AOT_KEY),
                                                                          ("file/triton", "deadbeef/kernel.cubin")}
    assert len(entries) == 6  # minus returns a new set


def test_entries_counts_and_sizes() -> None:
    entries = sample_entries()
    assert entries.counts() == {
        "file/inductor": 2,
        "file/triton": 1,
        "torch/aot_autograd": 1,
        "torch/autotune": 1,
        "torch/inductor": 1,
    }
    assert list(entries.counts()) == sorted(entries.counts())
    assert entries.raw_bytes() == sum(len(e.data) for e in sample_entries())
    assert [e.name for e in entries.of_kind_prefix("file/")] == ["ab/cabc123def.so", "ab/cabc123def.cpp",
                                                                 "deadbeef/kernel.cubin"]


def test_entries_from_torch() -> None:
    container = torchfmt.serialize([("inductor", INDUCTOR_KEY, b"g"), ("pgo", "code_state_myjob_0", b"p")])
    entries = bundle.entries_from_torch(container)
    assert as_tuples(entries) == [("torch/inductor", INDUCTOR_KEY, b"g", 0o644),
                                  ("torch/pgo", "code_state_myjob_0", b"p", 0o644)]


def test_entries_from_torch_refuses_a_corrupt_container() -> None:
    container = bytearray(torchfmt.serialize([("inductor", INDUCTOR_KEY, b"g")]))
    container[-1] ^= 0xFF
    with pytest.raises(BundleError, match="CRC mismatch"):
        bundle.entries_from_torch(bytes(container))


def test_torch_container_holds_only_torch_entries() -> None:
    container = sample_entries().torch_container()
    assert container is not None
    assert sorted(torchfmt.parse(container)) == sorted([
        ("inductor", INDUCTOR_KEY, b"\x00graph\xff" * 50),
        ("aot_autograd", AOT_KEY, b"aot"),
        ("autotune", "ab/cabc123def.best_config", b"{}"),
    ])


def test_torch_container_is_none_without_torch_entries() -> None:
    assert Entries([Entry("file/inductor", "a.so", b"x")]).torch_container() is None
    # Dynamo's stored entries are placed as files, never handed to torch's loader in memory
    assert Entries([Entry("torch/precompile", "key", b"x")]).torch_container() is None
    assert Entries().torch_container() is None


def test_torch_round_trip_through_a_bundle() -> None:
    container = torchfmt.serialize([("inductor", INDUCTOR_KEY, b"g"), ("aot_autograd", AOT_KEY, b"a")])
    _, decoded = bundle.decode(bundle.encode(bundle.entries_from_torch(container), FP))
    assert decoded.torch_container() == container


# --- refusals: the frame and the header --------------------------------------------------------------

GOOD = bundle.encode(Entries([Entry("file/inductor", "a.so", b"x" * 100)]), FP)


def test_wrong_magic() -> None:
    with pytest.raises(BundleError, match="bad magic"):
        bundle.decode(b"PMCX" + GOOD[4:])


def test_too_short_for_a_header() -> None:
    with pytest.raises(BundleError, match="bad magic"):
        bundle.decode(bundle.MAGIC + b"\x01\x00")


def test_unsupported_format_version() -> None:
    with pytest.raises(BundleError, match="bundle format 3 is not supported"):
        bundle.decode(GOOD[:4] + b"\x03" + GOOD[5:])


def test_header_length_over_the_maximum() -> None:
    blob = bundle.MAGIC + b"\x01" + (bundle.MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"{" * 70_000
    with pytest.raises(BundleError, match="header length out of range"):
        bundle.decode(blob)


def test_header_length_past_the_end() -> None:
    header_len = int.from_bytes(GOOD[5:9], "big")
    with pytest.raises(BundleError, match="header length out of range"):
        bundle.decode(GOOD[: 9 + header_len - 1])


def test_header_not_json() -> None:
    with pytest.raises(BundleError, match="header is not JSON"):
        bundle.decode(frame(b"{not json"))
    with pytest.raises(BundleError, match="header is not JSON"):
        bundle.decode(frame(b"\xff\xfe"))


def test_header_not_a_format_1_object() -> None:
    with pytest.raises(BundleError, match="not a format-1 object"):
        bundle.decode(frame(b"[1, 2]"))
    raw = raw_payload()
    with pytest.raises(BundleError, match="not a format-1 object"):
        bundle.decode(build(raw, entries=0, format=2))


@pytest.mark.parametrize("missing", ["fingerprint", "payload_sha256"])
def test_header_without_fingerprint_or_digest(missing: str) -> None:
    with pytest.raises(BundleError, match="lacks a fingerprint or a SHA-256"):
        overrides: dict[str, Any] = {"entries": 0, missing: DROP}
        bundle.decode(build(raw_payload(), **overrides))


def test_header_digest_not_hex() -> None:
    with pytest.raises(BundleError, match="lacks a fingerprint or a SHA-256"):
        bundle.decode(build(raw_payload(), entries=0, payload_sha256="Z" * 64))


@pytest.mark.parametrize("field", ["payload_size", "raw_size", "entries"])
@pytest.mark.parametrize("value", [DROP, -1, "12", True, 1.5], ids=["missing", "negative", "string", "bool", "float"])
def test_header_int_fields_missing_or_bad(field: str, value: object) -> None:
    with pytest.raises(BundleError, match=f"header field '{field}' is missing or out of range"):
        overrides: dict[str, Any] = {"entries": 0, field: value}
        bundle.decode(build(raw_payload(), **overrides))


def test_truncated_object() -> None:
    with pytest.raises(BundleError, match=r"payload is \d+ bytes, header says \d+ \(truncated\?\)"):
        bundle.decode(GOOD[:-1])


def test_object_longer_than_the_header_says() -> None:
    with pytest.raises(BundleError, match="header says"):
        bundle.decode(GOOD + b"\x00")


def test_object_over_the_size_limit() -> None:
    with pytest.raises(BundleError, match=f"object of {len(GOOD)} bytes is over the limit of 50"):
        bundle.decode(GOOD, limits=Limits(max_object_bytes=50))


def test_payload_sha256_mismatch() -> None:
    corrupt = bytearray(GOOD)
    corrupt[-3] ^= 0x40
    with pytest.raises(BundleError, match="SHA-256 mismatch"):
        bundle.decode(bytes(corrupt))


def test_fingerprint_mismatch() -> None:
    assert bundle.decode(GOOD, expected_fingerprint=FP)[0].fingerprint == FP
    with pytest.raises(BundleError, match=r"bundle is for fingerprint .*, not this environment's"):
        bundle.decode(GOOD, expected_fingerprint=FP.replace("t4", "t8"))


# --- refusals: decompression -------------------------------------------------------------------------

BIG_RAW = raw_payload(raw_entry("file/inductor", "big.so", b"\x00" * 2_000_000))


def test_decompression_bomb_without_a_declared_frame_size() -> None:
    # The frame does not state its size, so only the hard output limit (the header's raw_size) stops it.
    payload = zstandard.ZstdCompressor(write_content_size=False).compress(BIG_RAW)
    assert len(payload) < 1000
    blob = build(BIG_RAW, payload=payload, raw_size=1000)
    with pytest.raises(BundleError, match="payload does not decompress"):
        bundle.decode(blob)


def test_decompression_bomb_with_a_declared_frame_size() -> None:
    payload = zstandard.ZstdCompressor().compress(BIG_RAW)
    with pytest.raises(BundleError, match="zstd frame size disagrees with the header"):
        bundle.decode(build(BIG_RAW, payload=payload, raw_size=1000))


def test_raw_size_over_the_limit() -> None:
    blob = build(BIG_RAW)
    assert len(bundle.decode(blob)[1]) == 1
    with pytest.raises(BundleError, match="header field 'raw_size' is missing or out of range"):
        bundle.decode(blob, limits=Limits(max_raw_bytes=1_000_000))


def test_raw_size_larger_than_the_real_output() -> None:
    raw = raw_payload(raw_entry("file/inductor", "a.so", b"abc"))
    payload = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(BundleError, match="decompressed size disagrees with the header"):
        bundle.decode(build(raw, payload=payload, raw_size=len(raw) + 10))


def test_payload_that_is_not_zstd() -> None:
    with pytest.raises(BundleError, match="payload does not decompress"):
        bundle.decode(build(b"raw bytes", payload=b"definitely not a zstd frame"))


# --- refusals: the entries ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../x", "/abs/x.so", ".hidden", "a/.hidden.so", "a/../b.so", "a//b.so", "a/b/", "", "x..y.so", "a\\b.so",
     "/".join(["d"] * 17)],
)
def test_file_entry_with_an_unsafe_path(name: str) -> None:
    blob = build(raw_payload(raw_entry("file/inductor", name, b"evil")))
    with pytest.raises(BundleError, match="unsafe file path"):
        bundle.decode(blob)


def test_torch_entry_with_an_unsafe_key() -> None:
    blob = build(raw_payload(raw_entry("torch/inductor", "../../x", b"evil")))
    with pytest.raises(BundleError, match="unsafe inductor key"):
        bundle.decode(blob)


def test_torch_entry_of_an_unknown_type() -> None:
    blob = build(raw_payload(raw_entry("torch/evil", "abcdefgh", b"evil")))
    with pytest.raises(BundleError, match="unknown torch artifact type 'evil'"):
        bundle.decode(blob)


def test_unknown_entry_kind() -> None:
    blob = build(raw_payload(raw_entry("blob/x", "a.so", b"")))
    with pytest.raises(BundleError, match="unknown entry kind 'blob/x'"):
        bundle.decode(blob)


def test_unknown_file_root() -> None:
    blob = build(raw_payload(raw_entry("file/etc", "passwd", b"")))
    with pytest.raises(BundleError, match="unknown file root in kind 'file/etc'"):
        bundle.decode(blob)


def test_trailing_garbage_after_the_last_entry() -> None:
    blob = build(raw_payload(raw_entry("file/inductor", "a.so", b"x"), trailing=b"junk"))
    with pytest.raises(BundleError, match="4 trailing bytes after the last entry"):
        bundle.decode(blob)


def test_duplicate_entries() -> None:
    entry = raw_entry("file/inductor", "a.so", b"x")
    blob = build(raw_payload(entry, raw_entry("file/inductor", "a.so", b"y")), entries=2)
    with pytest.raises(BundleError, match=r"duplicate entry file/inductor:a\.so"):
        bundle.decode(blob)


def test_entry_count_disagrees_with_the_header() -> None:
    blob = build(raw_payload(raw_entry("file/inductor", "a.so", b"x")), entries=2)
    with pytest.raises(BundleError, match="entry count disagrees with the header"):
        bundle.decode(blob)


def test_payload_without_its_magic() -> None:
    with pytest.raises(BundleError, match="payload magic missing"):
        bundle.decode(build(b"XXXX\x00\x00\x00\x00", entries=0))


def test_payload_declaring_more_entries_than_allowed() -> None:
    blob = build(raw_payload(count=10), entries=0)
    with pytest.raises(BundleError, match="payload declares 10 entries, over the limit of 5"):
        bundle.decode(blob, limits=Limits(max_entries=5))


def test_payload_truncated_inside_an_entry() -> None:
    entry = raw_entry("file/inductor", "a.so", b"0123456789")
    with pytest.raises(BundleError, match=r"payload truncated in data of 'a\.so'"):
        bundle.decode(build(raw_payload(entry[:-3])))
    with pytest.raises(BundleError, match="payload truncated in name"):
        bundle.decode(build(raw_payload(entry[:16])))
    with pytest.raises(BundleError, match="payload truncated in kind"):
        bundle.decode(build(raw_payload(entry[:5])))


def test_payload_count_higher_than_the_entries_present() -> None:
    with pytest.raises(BundleError, match="payload truncated in kind length"):
        bundle.decode(build(raw_payload(raw_entry("file/inductor", "a.so", b"x"), count=2), entries=2))


def test_entry_name_not_utf8() -> None:
    bad = b"\x0dfile/inductor" + b"\x00\x02\xff\xfe" + (0o644).to_bytes(4, "big") + (0).to_bytes(8, "big")
    with pytest.raises(BundleError, match="entry name is not UTF-8"):
        bundle.decode(build(raw_payload(bad)))


# --- limits and the streaming decompression ----------------------------------------------------------


def test_default_limits() -> None:
    assert bundle.DEFAULT_LIMITS.max_object_bytes == 512 << 20
    assert bundle.DEFAULT_LIMITS.max_raw_bytes == 2 << 30


def test_payload_larger_than_one_read_chunk_without_a_frame_size() -> None:
    data = hashlib.sha256(b"seed").digest() * ((3 * bundle.DECOMPRESS_CHUNK) // 32 + 7)
    raw = raw_payload(raw_entry("file/inductor", "big.so", data))
    payload = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert len(raw) > 3 * bundle.DECOMPRESS_CHUNK
    _, decoded = bundle.decode(build(raw, payload=payload))
    assert [e.data for e in decoded] == [data]


def test_payload_of_several_frames_is_bounded_by_the_declared_size() -> None:
    raw = raw_payload(raw_entry("file/inductor", "a.so", b"x" * 100))
    one = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(BundleError, match=f"expands past its declared raw size of {len(raw)} bytes"):
        bundle.decode(build(raw, payload=one + one))


def test_payload_with_trailing_bytes_after_the_frame() -> None:
    raw = raw_payload(raw_entry("file/inductor", "a.so", b"x"))
    payload = zstandard.ZstdCompressor().compress(raw) + b"junk"
    with pytest.raises(BundleError, match="payload does not decompress"):
        bundle.decode(build(raw, payload=payload))


def test_a_changed_profile_is_new_and_the_newest_copy_wins_a_merge() -> None:
    """Dynamic-shape profiles (torch/pgo) change under their key: minus() against entries and merge()
    know it (a solo session uploads its grown profile); minus() against bare idents does not."""
    graph = Entry("torch/inductor", "f" + "a" * 51, b"graph")
    old, grown = Entry("torch/pgo", "job1", b"static"), Entry("torch/pgo", "job1", b"dynamic")
    restored = Entries([graph, old])
    assert [e.data for e in Entries([graph, grown]).minus(restored)] == [b"dynamic"]
    assert len(Entries([graph, old]).minus(restored)) == 0
    assert len(Entries([graph, grown]).minus({e.ident for e in restored})) == 0  # bare idents cannot compare data
    merged = Entries([graph, old])
    merged.merge([Entry("torch/inductor", graph.name, b"other"), grown])
    assert {e.ident: e.data for e in merged} == {graph.ident: b"graph", grown.ident: b"dynamic"}


# --- hostile headers: only BundleError ever escapes --------------------------------------------------

PLACEHOLDER = "@@hostile@@"


def build_hostile(field: str, text: str, raw: bytes | None = None, **overrides: Any) -> bytes:
    """A valid object whose header's ``field`` is the raw JSON ``text`` (which json.dumps could not write)."""
    raw = raw_payload(raw_entry("file/inductor", "a.so", b"x")) if raw is None else raw
    blob = build(raw, **{**overrides, field: PLACEHOLDER})
    header_len = int.from_bytes(blob[5:9], "big")
    header = blob[9 : 9 + header_len].replace(json.dumps(PLACEHOLDER).encode(), text.encode())
    return frame(header, blob[9 + header_len :])


# (field, raw JSON value): numbers Python's float()/int() choke on, JSON's forbidden constants, nesting and
# text no UTF-8 stream can write. Each used to escape as OverflowError, ValueError or RecursionError, or to reach
# the caller (a lone surrogate cannot be printed). "x" is an extra field: opaque to the format, still parsed.
PARSE_HOSTILE: dict[str, tuple[str, str]] = {
    "created-400-digit-int": ("created", "1" + "0" * 400),
    "created-1e400": ("created", "1e400"),
    "created-minus-1e400": ("created", "-1e400"),
    "created-NaN": ("created", "NaN"),
    "created-Infinity": ("created", "Infinity"),
    "created-minus-Infinity": ("created", "-Infinity"),
    "created-5000-digit-int": ("created", "9" * 5000),
    "payload_size-400-digit-int": ("payload_size", "1" + "0" * 400),
    "raw_size-1e400": ("raw_size", "1e400"),
    "entries-NaN": ("entries", "NaN"),
    "format-Infinity": ("format", "Infinity"),
    "fingerprint-1e400": ("fingerprint", "1e400"),
    "fingerprint-lone-surrogate": ("fingerprint", '"torch-\\ud800"'),
    "sig-kid-NaN": ("sig", '{"alg": "hmac-sha256", "kid": NaN, "mac": "0"}'),
    "extra-400-digit-int": ("x", "-" + "1" * 400),
    "extra-5000-digit-int-nested": ("x", '{"cold_seconds": {"inductor:k": ' + "7" * 5000 + "}}"),
    "extra-NaN-nested": ("x", '{"cold_seconds": {"inductor:k": NaN}}'),
    "extra-1e400-nested": ("x", '[[1e400]]'),
    "extra-nesting-past-the-recursion-limit": ("x", "[" * 20_000 + "]" * 20_000),
    "extra-nesting-past-the-depth-limit": ("x", "[" * 100 + "]" * 100),
    "extra-key-lone-surrogate": ("x", '{"\\udfff": 1}'),
}
# Values that parse but that no field accepts: refused when the field is interpreted.
FIELD_HOSTILE: dict[str, tuple[str, str]] = {
    "created-1e300": ("created", "1e300"),
    "created-past-the-year-9999": ("created", str(int(bundle.MAX_CREATED) + 1)),
    "created-negative": ("created", "-5"),
    "created-string": ("created", '"yesterday"'),
    "created-bool": ("created", "true"),
    "created-null": ("created", "null"),
    "created-object": ("created", '{"t": 1}'),
    "payload_size-string": ("payload_size", '"x"'),
    "raw_size-max-int64": ("raw_size", str((1 << 63) - 1)),
    "entries-float": ("entries", "1e18"),
    "format-true": ("format", "true"),
    "fingerprint-number": ("fingerprint", "5"),
}
HOSTILE = {**PARSE_HOSTILE, **FIELD_HOSTILE}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_header_raises_only_bundle_error(case: str) -> None:
    blob = build_hostile(*HOSTILE[case])
    for call in (lambda: bundle.decode(blob), lambda: bundle.decode_header(blob), lambda: bundle.decode(blob, FP)):
        with pytest.raises(BundleError) as info:
            call()
        # Refused by the strict parser or the field's own check, not by the last line of defence.
        assert "malformed bundle" not in str(info.value), info.value


def test_the_hostile_builder_makes_valid_objects_from_sane_values() -> None:
    # The evidence that each case above is refused for its value: the same object with a sane one decodes.
    assert bundle.decode(build_hostile("created", "2.5"))[0].created == 2.5
    assert bundle.decode(build_hostile("entries", "1"))[0].entries == 1
    assert bundle.decode(build_hostile("fingerprint", json.dumps(FP)), FP)[0].fingerprint == FP
    cold = '{"cold_seconds": {"inductor:k": 1.5}}'
    assert bundle.decode(build_hostile("x", cold))[0].extra == {"x": {"cold_seconds": {"inductor:k": 1.5}}}


def test_created_is_a_float_in_range_or_absent() -> None:
    raw = raw_payload(raw_entry("file/inductor", "a.so", b"x"))
    assert bundle.decode(build(raw, created=DROP))[0].created == 0.0
    assert bundle.decode(build(raw, created=0))[0].created == 0.0
    header = bundle.decode(build(raw, created=int(bundle.MAX_CREATED)))[0]
    assert header.created == bundle.MAX_CREATED and isinstance(header.created, float)


def test_header_numbers_in_extra_are_finite_and_convert_to_float() -> None:
    big = (1 << 63) - 1
    header, _ = bundle.decode(build_hostile("x", f'{{"a": [{big}, {-big - 1}, 1e308, -0.0, 1e-400]}}'))
    values = header.extra["x"]
    assert isinstance(values, dict)
    assert values["a"] == [big, -big - 1, 1e308, -0.0, 0.0]
    assert all(isinstance(float(v), float) for v in values["a"])
    with pytest.raises(BundleError, match="integer out of range"):
        bundle.decode(build_hostile("x", str(big + 1)))
    with pytest.raises(BundleError, match="integer out of range"):
        bundle.decode(build_hostile("x", str(-big - 2)))


def test_nesting_up_to_the_depth_limit_is_accepted() -> None:
    depth = bundle.MAX_HEADER_DEPTH - 1  # the header object itself is level 1
    header, _ = bundle.decode(build_hostile("x", "[" * depth + "]" * depth))
    assert header.extra["x"] is not None
    with pytest.raises(BundleError, match=f"nests deeper than {bundle.MAX_HEADER_DEPTH} levels"):
        bundle.decode(build_hostile("x", "[" * (depth + 1) + "]" * (depth + 1)))


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (2.5, 2.5), (0, 0.0), (True, None), (None, None), ("1", None), (-1, None), (float("nan"), None),
     (float("inf"), None), (10**400, None), ([1], None)],
)
def test_number_reads_extra_values_safely(value: object, expected: float | None) -> None:
    assert bundle.number(value) == expected


def test_number_bounds() -> None:
    assert bundle.number(5, upper=4) is None
    assert bundle.number(-3, lower=-5) == -3.0


@pytest.mark.parametrize(
    "extra",
    [{"x": float("nan")}, {"x": float("inf")}, {"x": 10**30}, {"x": "\ud800"}, {"x": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}],
    ids=["nan", "inf", "huge-int", "surrogate", "deep"],
)
def test_encode_refuses_extra_fields_a_decoder_would_refuse(extra: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="extra header fields would not decode"):
        bundle.encode(Entries(), FP, extra=extra)


def test_unexpected_exceptions_become_bundle_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    # The last line of defence: whatever a check misses cannot escape the public entry points as anything else.
    def explode(*_args: object) -> object:
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(bundle, "_created_field", explode)
    for call in (bundle.decode, bundle.decode_header):
        with pytest.raises(BundleError, match=r"malformed bundle \(OverflowError: int too large"):
            call(GOOD)
    monkeypatch.undo()
    monkeypatch.setattr(bundle.payloadmod, "read_framed", explode)
    with pytest.raises(BundleError, match=r"malformed bundle \(OverflowError"):
        bundle.decode(GOOD)
    assert bundle.decode_header(GOOD)[0].fingerprint == FP  # the payload is not decoded there


def test_keyboard_interrupt_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupt(*_args: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(bundle.payloadmod, "read_framed", interrupt)
    with pytest.raises(KeyboardInterrupt):
        bundle.decode(GOOD)


@pytest.mark.parametrize("case", list(PARSE_HOSTILE))
def test_peek_header_returns_none_for_hostile_headers(case: str) -> None:
    # The unverified peek (a diagnosis shows what another run recorded) parses as strictly as decode.
    assert bundle.peek_header(build_hostile(*PARSE_HOSTILE[case])[: bundle.HEADER_PREFIX_BYTES]) is None
    doc = bundle.peek_header(GOOD[: bundle.HEADER_PREFIX_BYTES])
    assert doc is not None and doc["fingerprint"] == FP
