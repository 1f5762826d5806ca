"""Signed bundles (HMAC-SHA256): round trips, every refusal, key rotation, keys from the environment, and
hostile payloads refused before (and, unsigned, without) decompression."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest
import zstandard

from pytest_megacache import bundle
from pytest_megacache.bundle import Entries, Entry, SignatureError
from pytest_megacache.errors import BundleError
from pytest_megacache.settings import parse_signing_keys

from .test_bundle import FIELD_HOSTILE, HOSTILE, PARSE_HOSTILE, build_hostile

FP = "torch-2.13.0/cpu-avx2-t4/py3.11-linux-x86_64/0123456789ab"
KEY = b"k" * 16 + b"-current-signing-key"
OLD_KEY = b"o" * 16 + b"-previous-signing-key"
OTHER_KEY = b"x" * 16 + b"-someone-elses-key"


def sample_entries() -> Entries:
    return Entries([
        Entry("file/inductor", "ab/cabc123def.so", b"\x7fELF" + bytes(range(256)) * 20, 0o755),
        Entry("file/triton", "deadbeef/kernel.cubin", b"cubin", 0o644),
    ])


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """An object's header (parsed) and payload."""
    header_len = int.from_bytes(blob[5:9], "big")
    doc = json.loads(blob[9 : 9 + header_len])
    assert isinstance(doc, dict)
    return doc, blob[9 + header_len :]


def join(doc: dict[str, Any], payload: bytes, **dumps: Any) -> bytes:
    """An object from a header and a payload, the header length fixed up."""
    header = json.dumps(doc, **dumps).encode()
    version = doc.get("format") if doc.get("format") in bundle.FORMATS else bundle.FORMAT_VERSION
    return bundle.MAGIC + bytes([version]) + len(header).to_bytes(4, "big") + header + payload


def signed_by_hand(doc: dict[str, Any], payload: bytes, key: bytes) -> bytes:
    """Sign ``doc`` (no ``sig`` in it) as a holder of ``key`` would, whatever the header claims."""
    mac = hmac.new(key, bundle.signature_input(doc, hashlib.sha256(payload).digest()), hashlib.sha256).hexdigest()
    return join({**doc, "sig": {"alg": "hmac-sha256", "kid": bundle.key_id(key), "mac": mac}}, payload)


def header_doc(payload: bytes, raw_size: int, entries: int = 1) -> dict[str, Any]:
    return {"format": 1, "fingerprint": FP, "payload_size": len(payload), "raw_size": raw_size,
            "payload_sha256": hashlib.sha256(payload).hexdigest(), "entries": entries, "created": 1.0}


# --- round trips -------------------------------------------------------------------------------------


def test_signed_round_trip() -> None:
    entries = sample_entries()
    blob = bundle.encode(entries, FP, extra={"run": "ci-7"}, signing_key=KEY)
    header, decoded = bundle.decode(blob, expected_fingerprint=FP, verify_keys=[KEY])
    assert [(e.kind, e.name, e.data, e.mode) for e in decoded] == [(e.kind, e.name, e.data, e.mode) for e in entries]
    assert header.signature is not None
    assert header.signature.alg == "hmac-sha256"
    assert header.signature.kid == hashlib.sha256(KEY).hexdigest()[:8] == bundle.key_id(KEY)
    assert header.extra == {"run": "ci-7"}  # the signature is not an extra field
    doc, _ = split(blob)
    assert set(doc["sig"]) == {"alg", "kid", "mac"}
    assert len(doc["sig"]["mac"]) == 64


def test_signature_covers_the_canonical_header_and_the_payload_digest() -> None:
    blob = bundle.encode(sample_entries(), FP, signing_key=KEY)
    doc, payload = split(blob)
    sig = doc.pop("sig")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    message = b"pytest-megacache/v1\0" + canonical + b"\0" + hashlib.sha256(payload).digest()
    assert bundle.signature_input(doc, hashlib.sha256(payload).digest()) == message
    assert hmac.new(KEY, message, hashlib.sha256).hexdigest() == sig["mac"]


def test_reformatted_header_still_verifies() -> None:
    # Key order, whitespace and escapes are not part of what is signed: the parsed header is.
    original = bundle.encode(sample_entries(), FP, extra={"note": "é"}, signing_key=KEY)
    doc, payload = split(original)
    reordered = dict(reversed(list(doc.items())))
    blob = join(reordered, payload, indent=3, ensure_ascii=False)
    assert blob[9:] != original[9:]
    header, _ = bundle.decode(blob, verify_keys=[KEY])
    assert header.extra == {"note": "é"}


def test_signed_objects_decode_without_keys() -> None:
    header, decoded = bundle.decode(bundle.encode(sample_entries(), FP, signing_key=KEY))
    assert len(decoded) == 2
    assert header.signature is not None


def test_unsigned_objects_decode_without_keys() -> None:
    header, decoded = bundle.decode(bundle.encode(sample_entries(), FP))
    assert len(decoded) == 2
    assert header.signature is None
    assert "sig" not in split(bundle.encode(sample_entries(), FP))[0]


def test_decode_header_verifies_when_given_keys() -> None:
    blob = bundle.encode(sample_entries(), FP, signing_key=KEY)
    header, offset = bundle.decode_header(blob, verify_keys=[KEY])
    assert header.signature is not None and offset == 9 + int.from_bytes(blob[5:9], "big")
    with pytest.raises(SignatureError, match="unknown key"):
        bundle.decode_header(blob, verify_keys=[OTHER_KEY])
    with pytest.raises(SignatureError, match="unsigned object"):
        bundle.decode_header(bundle.encode(sample_entries(), FP), verify_keys=[KEY])
    assert bundle.decode_header(bundle.encode(sample_entries(), FP))[0].signature is None


# --- refusals ----------------------------------------------------------------------------------------


def test_tampered_payload_byte() -> None:
    blob = bytearray(bundle.encode(sample_entries(), FP, signing_key=KEY))
    blob[-5] ^= 0x01
    with pytest.raises(SignatureError, match=r"signature mismatch \(tampered\?\)"):
        bundle.decode(bytes(blob), verify_keys=[KEY])
    # Without keys the digest still catches it, as before.
    with pytest.raises(BundleError, match="SHA-256 mismatch"):
        bundle.decode(bytes(blob))


def test_tampered_payload_with_a_matching_digest_in_the_header() -> None:
    # A writer without the key replaces the payload and fixes every header field that describes it.
    blob = bundle.encode(sample_entries(), FP, signing_key=KEY)
    doc, _ = split(blob)
    evil_raw = bundle.PAYLOAD_MAGIC + (0).to_bytes(4, "big")
    evil = zstandard.ZstdCompressor().compress(evil_raw)
    doc.update(payload_size=len(evil), raw_size=len(evil_raw), entries=0, format=1,
               payload_sha256=hashlib.sha256(evil).hexdigest())
    forged = join(doc, evil)
    assert len(bundle.decode(forged)[1]) == 0  # structurally valid: only the signature stops it
    with pytest.raises(SignatureError, match="signature mismatch"):
        bundle.decode(forged, verify_keys=[KEY])


@pytest.mark.parametrize(
    ("edit", "value"),
    [("fingerprint", FP.replace("t4", "t8")), ("raw_size", None), ("created", 2.0), ("entries", 1),
     ("run", "added-field"), ("format", None)],
)
def test_tampered_header_field(edit: str, value: object) -> None:
    blob = bundle.encode(sample_entries(), FP, extra={"job": "x"}, signing_key=KEY)
    doc, payload = split(blob)
    if edit == "raw_size":
        value = doc["raw_size"] + 1
    if edit == "format":  # moving a value between fields: the canonical form tells them apart
        doc["job"], doc["fingerprint"] = doc["fingerprint"], doc["job"]
    else:
        doc[edit] = value
    with pytest.raises(SignatureError, match="signature mismatch"):
        bundle.decode(join(doc, payload), verify_keys=[KEY])


def test_signature_of_another_object_does_not_transfer() -> None:
    a = bundle.encode(sample_entries(), FP, signing_key=KEY)
    b = bundle.encode(Entries([Entry("file/inductor", "other.so", b"other")]), FP, signing_key=KEY)
    doc_b, payload_b = split(b)
    doc_b["sig"] = split(a)[0]["sig"]
    with pytest.raises(SignatureError, match="signature mismatch"):
        bundle.decode(join(doc_b, payload_b), verify_keys=[KEY])


def test_wrong_key() -> None:
    blob = bundle.encode(sample_entries(), FP, signing_key=OTHER_KEY)
    with pytest.raises(SignatureError, match=rf"signed with an unknown key \(kid {bundle.key_id(OTHER_KEY)}\)"):
        bundle.decode(blob, verify_keys=[KEY])


def test_wrong_key_claiming_a_known_kid() -> None:
    doc, payload = split(bundle.encode(sample_entries(), FP, signing_key=OTHER_KEY))
    doc["sig"]["kid"] = bundle.key_id(KEY)
    with pytest.raises(SignatureError, match="signature mismatch"):
        bundle.decode(join(doc, payload), verify_keys=[KEY])


def test_missing_signature_with_keys_configured() -> None:
    with pytest.raises(SignatureError, match="unsigned object"):
        bundle.decode(bundle.encode(sample_entries(), FP), verify_keys=[KEY])


def test_signature_error_is_a_bundle_error() -> None:
    # Callers that skip a refused object on BundleError skip a badly signed one too.
    assert issubclass(SignatureError, BundleError)


@pytest.mark.parametrize(
    "sig",
    [
        "deadbeef",
        {"alg": "hmac-sha1", "kid": "0" * 8, "mac": "0" * 64},
        {"alg": "hmac-sha256", "kid": "0" * 7, "mac": "0" * 64},
        {"alg": "hmac-sha256", "kid": "0" * 8, "mac": "0" * 63},
        {"alg": "hmac-sha256", "kid": "0" * 8, "mac": "G" * 64},
        {"alg": "hmac-sha256", "kid": "0" * 8, "mac": "0" * 64, "extra": 1},
        {"alg": "hmac-sha256", "kid": 12345678, "mac": "0" * 64},
        None,
    ],
)
def test_malformed_signature_field(sig: object) -> None:
    doc, payload = split(bundle.encode(sample_entries(), FP))
    doc["sig"] = sig
    blob = join(doc, payload)
    with pytest.raises(SignatureError, match="malformed signature field"):
        bundle.decode(blob)  # refused even without keys: the shape is part of the header's validation
    with pytest.raises(SignatureError, match="malformed signature field"):
        bundle.decode_header(blob)


def test_encode_refuses_reserved_extra_fields() -> None:
    for name in ("sig", "fingerprint", "payload_sha256"):
        with pytest.raises(ValueError, match=f"reserved names: {name}"):
            bundle.encode(sample_entries(), FP, extra={name: "x"})


# --- key rotation ------------------------------------------------------------------------------------


def test_key_rotation() -> None:
    old_object = bundle.encode(sample_entries(), FP, signing_key=OLD_KEY)
    new_object = bundle.encode(sample_entries(), FP, signing_key=KEY)
    # During the rotation: sign with the new key, verify with either.
    assert bundle.decode(old_object, verify_keys=[KEY, OLD_KEY])[0].signature is not None
    assert bundle.decode(new_object, verify_keys=[KEY, OLD_KEY])[0].signature is not None
    # After it: only the new key; old objects are refused.
    assert bundle.decode(new_object, verify_keys=[KEY])[0].signature is not None
    with pytest.raises(SignatureError, match=rf"unknown key \(kid {bundle.key_id(OLD_KEY)}\)"):
        bundle.decode(old_object, verify_keys=[KEY])


def test_rotation_from_the_environment_variable() -> None:
    keys = parse_signing_keys(f"{KEY.decode()}, {OLD_KEY.decode()}")
    assert keys == [KEY, OLD_KEY]
    blob = bundle.encode(sample_entries(), FP, signing_key=keys[0])
    assert bundle.decode(blob, verify_keys=keys)[0].signature.kid == bundle.key_id(KEY)  # type: ignore[union-attr]


# --- parse_signing_keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, "", "  ", " , ,\n"])
def test_no_keys(text: str | None) -> None:
    assert parse_signing_keys(text) == []


def test_keys_separated_by_commas_and_whitespace() -> None:
    a, b, c, d = ("a" * 16, "b" * 20, "c" * 17, "d" * 32)
    assert parse_signing_keys(f"{a},{b}  {c}\n\t{d},") == [x.encode() for x in (a, b, c, d)]


def test_duplicate_keys_are_listed_once() -> None:
    assert parse_signing_keys("a" * 16 + " " + "b" * 16 + "," + "a" * 16) == [b"a" * 16, b"b" * 16]


def test_keys_are_utf8_bytes_of_the_text() -> None:
    key = "ключ" * 4  # 16 characters, 32 bytes
    assert parse_signing_keys(key) == [key.encode("utf-8")]


def test_short_key_error_does_not_echo_the_key() -> None:
    secret = "s3cr3t-but-short"[:15]
    with pytest.raises(ValueError, match="MEGACACHE_SIGNING_KEY: key 2 is shorter than 16 characters") as info:
        parse_signing_keys("a" * 16 + "," + secret)
    assert secret not in str(info.value)
    assert secret[:6] not in str(info.value)


def test_key_of_exactly_16_characters_is_accepted() -> None:
    assert parse_signing_keys("x" * 16) == [b"x" * 16]
    with pytest.raises(ValueError, match="key 1 is shorter"):
        parse_signing_keys("x" * 15)


# --- decompression bombs -----------------------------------------------------------------------------

BOMB_RAW = b"\x00" * (64 << 20)
DECLARED = 1024


@pytest.fixture(scope="module")
def bomb_without_size() -> bytes:
    payload = zstandard.ZstdCompressor(write_content_size=False).compress(BOMB_RAW)
    assert len(payload) < 64 * 1024
    return payload


@pytest.fixture(scope="module")
def bomb_with_size() -> bytes:
    payload = zstandard.ZstdCompressor().compress(BOMB_RAW)
    assert zstandard.get_frame_parameters(payload).content_size == len(BOMB_RAW)
    return payload


class Recorder:
    """Wraps zstandard's decompressor and frame parser: counts calls and the bytes produced."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decompressors = 0
        self.frame_parses = 0
        self.produced = 0
        real_dctx, real_params = zstandard.ZstdDecompressor, zstandard.get_frame_parameters
        recorder = self

        class CountingReader:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __enter__(self) -> CountingReader:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)

            def read(self, size: int = -1) -> bytes:
                data: bytes = self.inner.read(size)
                recorder.produced += len(data)
                return data

        class CountingDecompressor:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                recorder.decompressors += 1
                self.inner = real_dctx(*args, **kwargs)

            def stream_reader(self, *args: Any, **kwargs: Any) -> CountingReader:
                return CountingReader(self.inner.stream_reader(*args, **kwargs))

            def decompress(self, data: bytes, *args: Any, **kwargs: Any) -> bytes:
                out: bytes = self.inner.decompress(data, *args, **kwargs)
                recorder.produced += len(out)
                return out

        def counting_params(data: bytes) -> Any:
            recorder.frame_parses += 1
            return real_params(data)

        monkeypatch.setattr(zstandard, "ZstdDecompressor", CountingDecompressor)
        monkeypatch.setattr(zstandard, "get_frame_parameters", counting_params)


def test_recorder_sees_a_normal_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    # The evidence the tests below rely on: a good object does go through the wrapped decompressor.
    blob = bundle.encode(sample_entries(), FP, signing_key=KEY)
    rec = Recorder(monkeypatch)
    header, _ = bundle.decode(blob, verify_keys=[KEY])
    assert rec.decompressors == 2  # the index's frame and the entries' one
    assert rec.produced == header.raw_size


def test_unsigned_bomb_without_a_frame_size_is_refused(monkeypatch: pytest.MonkeyPatch, bomb_without_size: bytes) -> None:
    blob = join(header_doc(bomb_without_size, DECLARED), bomb_without_size)
    rec = Recorder(monkeypatch)
    with pytest.raises(BundleError, match=f"expands past its declared raw size of {DECLARED} bytes"):
        bundle.decode(blob)
    assert rec.decompressors == 1
    assert rec.produced <= DECLARED + 1  # the overflow was never produced


def test_unsigned_bomb_with_a_frame_size_is_refused(monkeypatch: pytest.MonkeyPatch, bomb_with_size: bytes) -> None:
    blob = join(header_doc(bomb_with_size, DECLARED), bomb_with_size)
    rec = Recorder(monkeypatch)
    with pytest.raises(BundleError, match="zstd frame size disagrees with the header"):
        bundle.decode(blob)
    assert rec.produced == 0


@pytest.mark.parametrize("which", ["without_size", "with_size"])
def test_unsigned_bomb_with_a_key_is_refused_before_decompression(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, which: str
) -> None:
    payload: bytes = request.getfixturevalue(f"bomb_{which}")
    blob = join(header_doc(payload, DECLARED), payload)
    rec = Recorder(monkeypatch)
    with pytest.raises(SignatureError, match="unsigned object"):
        bundle.decode(blob, verify_keys=[KEY])
    assert (rec.decompressors, rec.frame_parses, rec.produced) == (0, 0, 0)


def test_bomb_signed_with_another_key_is_refused_before_decompression(
    monkeypatch: pytest.MonkeyPatch, bomb_without_size: bytes
) -> None:
    blob = signed_by_hand(header_doc(bomb_without_size, DECLARED), bomb_without_size, OTHER_KEY)
    rec = Recorder(monkeypatch)
    with pytest.raises(SignatureError, match="unknown key"):
        bundle.decode(blob, verify_keys=[KEY])
    assert (rec.decompressors, rec.frame_parses, rec.produced) == (0, 0, 0)


def test_bomb_signed_with_the_key_is_still_bounded(monkeypatch: pytest.MonkeyPatch, bomb_without_size: bytes) -> None:
    # A signature vouches for the writer, not the content: the size limits hold for signed objects too.
    blob = signed_by_hand(header_doc(bomb_without_size, DECLARED), bomb_without_size, KEY)
    rec = Recorder(monkeypatch)
    with pytest.raises(BundleError, match="expands past its declared raw size"):
        bundle.decode(blob, verify_keys=[KEY])
    assert rec.produced <= DECLARED + 1


def test_bomb_declaring_its_true_size_is_refused_by_the_raw_limit(bomb_without_size: bytes) -> None:
    blob = join(header_doc(bomb_without_size, len(BOMB_RAW)), bomb_without_size)
    with pytest.raises(BundleError, match="header field 'raw_size' is missing or out of range"):
        bundle.decode(blob, limits=bundle.Limits(max_raw_bytes=1 << 20))


# --- hostile headers with signing keys configured ----------------------------------------------------

@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_unsigned_header_with_keys_raises_only_bundle_error(case: str) -> None:
    blob = build_hostile(*HOSTILE[case])
    for call in (lambda: bundle.decode(blob, verify_keys=[KEY]), lambda: bundle.decode_header(blob, verify_keys=[KEY])):
        with pytest.raises(BundleError) as info:
            call()
        assert "malformed bundle" not in str(info.value), info.value
    # A good signed object still decodes with the same keys.
    assert bundle.decode(bundle.encode(sample_entries(), FP, signing_key=KEY), FP, verify_keys=[KEY])[0].signature


@pytest.mark.parametrize("case", list(FIELD_HOSTILE))
def test_signature_is_checked_before_any_other_header_field(case: str) -> None:
    # Unsigned, or signed by someone else: refused for the signature, whatever the other fields hold.
    blob = build_hostile(*FIELD_HOSTILE[case])
    with pytest.raises(SignatureError, match="unsigned object"):
        bundle.decode(blob, verify_keys=[KEY])
    with pytest.raises(SignatureError, match="unsigned object"):
        bundle.decode_header(blob, verify_keys=[KEY])
    doc, payload = split(blob)
    forged = signed_by_hand(doc, payload, OTHER_KEY)
    with pytest.raises(SignatureError, match="unknown key"):
        bundle.decode(forged, verify_keys=[KEY])
    # Signed with the key: the signature passes, then the field is refused (BundleError, not a signature error).
    signed = signed_by_hand(doc, payload, KEY)
    with pytest.raises(BundleError) as info:
        bundle.decode(signed, verify_keys=[KEY])
    assert not isinstance(info.value, SignatureError), info.value


def test_fields_are_not_read_before_the_signature_is_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    real_int, real_created = bundle._int_field, bundle._created_field

    def spy_int(doc: Any, name: str, upper: int) -> int:
        read.append(name)
        return real_int(doc, name, upper)

    def spy_created(doc: Any) -> float:
        read.append("created")
        return real_created(doc)

    monkeypatch.setattr(bundle, "_int_field", spy_int)
    monkeypatch.setattr(bundle, "_created_field", spy_created)
    with pytest.raises(SignatureError, match="unknown key"):
        bundle.decode(bundle.encode(sample_entries(), FP, signing_key=OTHER_KEY), verify_keys=[KEY])
    with pytest.raises(SignatureError, match="unsigned object"):
        bundle.decode_header(bundle.encode(sample_entries(), FP), verify_keys=[KEY])
    assert read == []
    bundle.decode(bundle.encode(sample_entries(), FP, signing_key=KEY), verify_keys=[KEY])
    assert sorted(read) == ["created", "entries", "index_size", "payload_size", "raw_size"]


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), 10**400, 1e300, "\ud800"],
                         ids=["nan", "inf", "huge-int", "1e300", "surrogate"])
def test_validly_signed_hostile_created_is_still_refused(value: object) -> None:
    # A key holder's object is vouched for, not trusted to be sane: it cannot crash the reader either.
    payload = zstandard.ZstdCompressor().compress(bundle.PAYLOAD_MAGIC + (0).to_bytes(4, "big"))
    blob = signed_by_hand({**header_doc(payload, 8, entries=0), "created": value}, payload, KEY)
    assert bundle.decode(signed_by_hand(header_doc(payload, 8, entries=0), payload, KEY), verify_keys=[KEY])
    for call in (lambda: bundle.decode(blob, verify_keys=[KEY]), lambda: bundle.decode_header(blob, verify_keys=[KEY])):
        with pytest.raises(BundleError) as info:
            call()
        assert "malformed bundle" not in str(info.value), info.value


def test_parse_hostile_cases_are_refused_before_the_signature() -> None:
    # They never reach the MAC: the JSON itself is refused (a signature could not vouch for what cannot be parsed).
    for case in PARSE_HOSTILE.values():
        with pytest.raises(BundleError) as info:
            bundle.decode(build_hostile(*case), verify_keys=[KEY])
        assert not isinstance(info.value, SignatureError), (case[0], info.value)
