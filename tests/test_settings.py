"""Settings: precedence (command line > environment > ini > default), conversion and validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from pytest_megacache.settings import MODES, NOT_OPTIONS, OPTIONS, PRIVATE_FIELDS, Settings, SettingsError, resolve


def lookup(values: Mapping[str, Any] | None = None) -> Callable[[str], Any]:
    data = dict(values or {})
    return lambda name: data.get(name)


def settings(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
             ini: Mapping[str, Any] | None = None) -> Settings:
    return resolve(cli=lookup(cli), env=dict(env or {}), ini=lookup(ini))


def test_defaults_when_nothing_is_set() -> None:
    s = settings()
    assert s == Settings()
    assert s.prefix == "pytest-megacache"
    assert s.mode == "readwrite"
    assert s.timeout == 120.0
    assert s.compact_after == 8
    assert s.strict is False
    assert s.bucket is None and s.directory is None
    assert not s.enabled
    assert s.store_label() == "none"


@pytest.mark.parametrize(
    ("name", "cli_value", "env_value", "ini_value", "default"),
    [
        ("mode", "read", "write", "off", "readwrite"),
        ("prefix", "from-cli", "from-env", "from-ini", "pytest-megacache"),
        ("timeout", "1.5", "2.5", "3.5", 120.0),
        ("compact_after", "3", "4", "5", 8),
        ("directory", "/cli", "/env", "/ini", None),
        ("report", "cli.json", "env.json", "ini.json", None),
        ("scope", "cli-branch", "env+branch", "ini_branch", None),
        ("default_scope", "trunk", "main", "master", None),
        ("durations", "0", "5", "10", 0),
        ("compile_threads", "keep", "auto", "keep", "auto"),
    ],
)
def test_precedence_cli_env_ini_default(name: str, cli_value: str, env_value: str, ini_value: str,
                                        default: Any) -> None:
    opt = next(o for o in OPTIONS if o.name == name)
    cli, env, ini = {name: cli_value}, {opt.env: env_value}, {opt.ini: ini_value}
    kind = {"timeout": float, "compact_after": int, "durations": int}.get(name, str)

    assert getattr(settings(cli=cli, env=env, ini=ini), name) == kind(cli_value)
    assert getattr(settings(env=env, ini=ini), name) == kind(env_value)
    assert getattr(settings(ini=ini), name) == kind(ini_value)
    assert getattr(settings(), name) == default


def test_empty_env_and_ini_values_fall_through() -> None:
    s = settings(env={"MEGACACHE_MODE": ""}, ini={"megacache_mode": "read"})
    assert s.mode == "read"
    assert settings(env={"MEGACACHE_PREFIX": ""}, ini={"megacache_prefix": ""}).prefix == "pytest-megacache"


def test_empty_command_line_value_is_an_error() -> None:
    with pytest.raises(SettingsError, match=r"command line \(--megacache-prefix\): empty value"):
        settings(cli={"prefix": ""})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), (" 1 ", True),
     ("0", False), ("false", False), ("no", False), ("off", False), ("No", False)],
)
def test_booleans_from_env(raw: str, expected: bool) -> None:
    assert settings(env={"MEGACACHE_STRICT": raw}).strict is expected


def test_booleans_from_the_command_line_and_ini() -> None:
    assert settings(cli={"strict": True}).strict is True
    assert settings(cli={"strict": False}, env={"MEGACACHE_STRICT": "1"}).strict is False
    assert settings(ini={"megacache_strict": "yes"}).strict is True


@pytest.mark.parametrize(
    ("source", "value", "message"),
    [
        ("env", "maybe", r"environment \(MEGACACHE_STRICT\): 'maybe' is not a boolean"),
        ("cli", "2", r"command line \(--megacache-strict\): '2' is not a boolean"),
        ("ini", "sure", r"ini file \(megacache_strict\): 'sure' is not a boolean"),
    ],
)
def test_bad_boolean_names_its_source(source: str, value: str, message: str) -> None:
    kwargs = {"cli": {"strict": value}, "env": {"MEGACACHE_STRICT": value}, "ini": {"megacache_strict": value}}
    with pytest.raises(SettingsError, match=message):
        settings(**{source: kwargs[source]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env": {"MEGACACHE_MODE": "sometimes"}},
         r"environment \(MEGACACHE_MODE\): mode 'sometimes' is not one of readwrite, read, write, off"),
        ({"cli": {"mode": "rw"}}, r"command line \(--megacache-mode\): mode 'rw'"),
        ({"ini": {"megacache_mode": "READ"}}, r"ini file \(megacache_mode\): mode 'READ'"),
        ({"env": {"MEGACACHE_TIMEOUT": "soon"}}, r"environment \(MEGACACHE_TIMEOUT\): 'soon' is not a number"),
        ({"cli": {"timeout": "0"}}, r"command line \(--megacache-timeout\): '0' must be a positive"),
        ({"ini": {"megacache_timeout": "-3"}}, r"ini file \(megacache_timeout\): '-3' must be a positive"),
        ({"env": {"MEGACACHE_TIMEOUT": "nan"}}, r"environment \(MEGACACHE_TIMEOUT\): 'nan' must be a positive"),
        ({"env": {"MEGACACHE_TIMEOUT": "inf"}}, r"environment \(MEGACACHE_TIMEOUT\): 'inf' must be a positive"),
        ({"cli": {"timeout": "1e300"}}, r"'1e300' must be a positive, finite number"),
        ({"env": {"MEGACACHE_COMPACT_AFTER": "2.5"}},
         r"environment \(MEGACACHE_COMPACT_AFTER\): '2.5' is not a number"),
        ({"ini": {"megacache_compact_after": "0"}}, r"ini file \(megacache_compact_after\): '0' must be a positive"),
    ],
    ids=["env-mode", "cli-mode", "ini-mode", "env-timeout-word", "cli-timeout-zero", "ini-timeout-negative",
         "env-timeout-nan", "env-timeout-inf", "cli-timeout-huge", "env-compact-float", "ini-compact-zero"],
)
def test_bad_values_name_their_source(kwargs: dict[str, dict[str, str]], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        settings(**kwargs)


def test_a_bad_lower_precedence_value_is_not_read_when_a_higher_one_is_set() -> None:
    assert settings(cli={"mode": "read"}, env={"MEGACACHE_MODE": "garbage"}).mode == "read"


@pytest.mark.parametrize("bucket", ["My_Bucket", "ab", "-bucket", "bucket-", "a" * 64, "bucket/name", "s3://b"])
def test_bad_bucket_name(bucket: str) -> None:
    with pytest.raises(SettingsError, match=r"environment \(MEGACACHE_BUCKET\): .* is not a valid S3 bucket name"):
        settings(env={"MEGACACHE_BUCKET": bucket})


@pytest.mark.parametrize("bucket", ["abc", "my-bucket.ci", "a" * 63, "bucket123"])
def test_good_bucket_names(bucket: str) -> None:
    s = settings(cli={"bucket": bucket})
    assert s.bucket == bucket
    assert s.store_label() == f"s3://{bucket}/pytest-megacache"


@pytest.mark.parametrize("prefix", ["a/../b", "..", "../up", "a b", "a//b", "/", "x/..."])
def test_bad_prefix(prefix: str) -> None:
    with pytest.raises(SettingsError, match=r"ini file \(megacache_prefix\): prefix .* may hold only"):
        settings(ini={"megacache_prefix": prefix})


def test_prefix_slashes_are_trimmed() -> None:
    assert settings(cli={"prefix": "/team/ci/"}).prefix == "team/ci"


@pytest.mark.parametrize("url", ["ftp://host", "127.0.0.1:9000", "s3://bucket", "localhost"])
def test_endpoint_url_must_be_http(url: str) -> None:
    with pytest.raises(SettingsError, match=r"MEGACACHE_ENDPOINT_URL\): .* is not an http\(s\) URL"):
        settings(env={"MEGACACHE_ENDPOINT_URL": url})


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000", "https://s3.example.com"])
def test_endpoint_url_accepts_http_and_https(url: str) -> None:
    assert settings(cli={"endpoint_url": url}).endpoint_url == url


def test_bucket_and_directory_together_is_an_error() -> None:
    with pytest.raises(SettingsError, match=r"either a bucket .* or a directory .*, not both"):
        settings(env={"MEGACACHE_BUCKET": "my-bucket"}, ini={"megacache_dir": "/tmp/cache"})


@pytest.mark.parametrize(
    ("mode", "reads", "writes"),
    [("readwrite", True, True), ("read", True, False), ("write", False, True), ("off", False, False)],
)
def test_enabled_reads_writes_per_mode(mode: str, reads: bool, writes: bool) -> None:
    with_dir = settings(cli={"mode": mode, "directory": "/cache"})
    assert with_dir.reads is reads
    assert with_dir.writes is writes
    assert with_dir.enabled is (mode != "off")
    assert with_dir.store_label() == "dir:/cache/pytest-megacache"
    with_bucket = settings(cli={"mode": mode}, env={"MEGACACHE_BUCKET": "bucket"})
    assert with_bucket.enabled is (mode != "off")
    assert settings(cli={"mode": mode}).enabled is False  # no store configured


def test_modes_are_the_documented_ones() -> None:
    assert MODES == ("readwrite", "read", "write", "off")


def test_every_settings_field_has_an_option_and_vice_versa() -> None:
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    options = {o.name: o for o in OPTIONS}
    assert set(fields) - NOT_OPTIONS == set(options)
    assert NOT_OPTIONS == {"explicit", "signing_keys", "signing_error"}
    for name, opt in options.items():
        assert fields[name].default == opt.default, name
        assert opt.flag.startswith("--megacache-"), opt.flag
        assert opt.env.startswith("MEGACACHE_") and opt.ini.startswith("megacache_")
    assert len({o.flag for o in OPTIONS}) == len({o.env for o in OPTIONS}) == len({o.ini for o in OPTIONS}) \
        == len(OPTIONS)


@pytest.mark.parametrize("value", ["..", ".hidden", "a/b", "x" * 101, "sp ace"])
def test_unsafe_scope_is_refused(value: str) -> None:
    with pytest.raises(SettingsError, match="scope"):
        settings(cli={"scope": value})


@pytest.mark.parametrize(("name", "value"), [("durations", "-1"), ("durations", "x"), ("compile_threads", "many")])
def test_bad_choice_or_count(name: str, value: str) -> None:
    with pytest.raises(SettingsError):
        settings(cli={name: value})


def test_explicit_records_what_the_user_set() -> None:
    s = settings(env={"MEGACACHE_MODE": "readwrite"}, ini={"megacache_prefix": "p"})
    assert s.explicit == {"mode", "prefix"}
    assert settings().explicit == frozenset()


# --- one source per default ---------------------------------------------------------------------------


def test_option_defaults_are_the_settings_field_defaults() -> None:
    # Stated once, on the Settings fields: an option has no default of its own to diverge.
    assert "default" not in {f.name for f in dataclasses.fields(OPTIONS[0])}
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    for opt in OPTIONS:
        assert opt.default is fields[opt.name].default, opt.name
        assert getattr(Settings(), opt.name) == opt.default, opt.name


def test_help_texts_state_the_real_default() -> None:
    for opt in OPTIONS:
        assert "{" not in opt.help and "}" not in opt.help, opt.name  # every placeholder filled
        text = opt.help
        if opt.default is None:
            assert "(default)" not in text, opt.name  # a default in words ("the repository's default branch")
            continue
        if "(default)" in text:  # "readwrite (default), read ..."
            assert text.startswith(f"{opt.default} (default)"), opt.name
        elif "default: " in text:
            shown = {True: "yes", False: "no"}.get(opt.default, f"{opt.default:g}" if isinstance(opt.default, float)
                                                    else str(opt.default))
            assert f"default: {shown})" in text, opt.name
        elif "no longer needed" in text.lower():
            assert opt.default is False and "ignored" in text, opt.name  # a retired flag, accepted
        elif "by default" in text:  # "Off by default.", or on by default where a condition holds
            assert ("Off by default" in text, "On by default" in text) == (opt.default is False, opt.default is True), \
                opt.name


# --- MEGACACHE_SIGNING_KEY, resolved with the rest ------------------------------------------------------

KEY_A = "first-signing-key-0123456789"
KEY_B = "second-signing-key-987654321"


@pytest.mark.parametrize("value", [None, "", "  ", " , \n"])
def test_no_signing_key(value: str | None) -> None:
    s = settings(env={} if value is None else {"MEGACACHE_SIGNING_KEY": value})
    assert s.signing_keys == () and s.signing_error is None
    assert s == Settings()


def test_signing_keys_are_resolved_from_the_environment() -> None:
    s = settings(env={"MEGACACHE_SIGNING_KEY": f"{KEY_A}, {KEY_B}"})
    assert s.signing_keys == (KEY_A.encode(), KEY_B.encode())
    assert s.signing_error is None
    assert "signing_keys" not in s.explicit  # not an option: no flag, no ini, nothing "set by the user"


@pytest.mark.parametrize("value", [f"{KEY_A},short-secret", f"{KEY_A} x\udcffsurrogate-secret-key"],
                         ids=["too-short", "not-utf8"])
def test_an_unusable_signing_key_is_an_error_field_not_a_usage_error(value: str) -> None:
    s = settings(env={"MEGACACHE_SIGNING_KEY": value})  # no SettingsError: the plugin turns itself off instead
    assert s.signing_keys == ()
    assert s.signing_error is not None and s.signing_error.startswith("MEGACACHE_SIGNING_KEY: key 2 ")
    assert "secret" not in s.signing_error and KEY_A not in s.signing_error


def test_signing_keys_stay_out_of_reprs_and_reports() -> None:
    s = settings(env={"MEGACACHE_SIGNING_KEY": KEY_A})
    assert KEY_A not in repr(s) and "signing" not in repr(s)
    assert dataclasses.asdict(s)["signing_keys"] == (KEY_A.encode(),)  # asdict still works
    reportable = s.reportable()
    assert set(reportable) == {f.name for f in dataclasses.fields(Settings)} - PRIVATE_FIELDS
    assert PRIVATE_FIELDS == {"signing_keys", "signing_error"}
    assert KEY_A not in repr(reportable)
    bad = settings(env={"MEGACACHE_SIGNING_KEY": "short"})
    assert "signing" not in repr(bad) and "signing_error" not in bad.reportable()


def test_the_default_scope_setting_comes_from_every_source() -> None:
    # Resolved here once (ci_env.default_scope does not read MEGACACHE_DEFAULT_SCOPE itself).
    assert settings(env={"MEGACACHE_DEFAULT_SCOPE": "release+2.x"}).default_scope == "release+2.x"
    assert settings(ini={"megacache_default_scope": "trunk"}).default_scope == "trunk"
    with pytest.raises(SettingsError, match="scope"):
        settings(env={"MEGACACHE_DEFAULT_SCOPE": "release/2.x"})


def test_dynamo_reuse_is_on_by_default_where_checked_and_says_why() -> None:
    """Decided from torch's version as installed (torch is not imported): on by default on a checked release, for
    torch's own backends; asked for, for any backend that can be named; off elsewhere (silently by default, with a
    warning where asked for: context.activate), and off where turned off (an ini file turned it on, the command line
    off)."""
    from pytest_megacache.context import decide_reuse

    default = resolve(cli=lambda name: None, env={}, ini=lambda name: None)
    asked = resolve(cli=lambda name: True if name == "precompile" else None, env={}, ini=lambda name: None)
    again_off = resolve(cli=lambda name: False if name == "precompile" else None, env={},
                        ini=lambda name: "yes" if name == "megacache_precompile" else None)
    env_off = resolve(cli=lambda name: None, env={"MEGACACHE_PRECOMPILE": "0"}, ini=lambda name: None)
    assert default.precompile and asked.precompile and not again_off.precompile and not env_off.precompile
    on = decide_reuse(default, "2.13.0+cpu")
    assert on.on and not on.asked and on.why.startswith("on by default on torch 2.13.0"), on
    assert on.as_dict() == {"on": True, "why": on.why, "backends": "torch's own"}
    old_default = decide_reuse(default, "2.10.0+cu128")
    assert not old_default.on and not old_default.asked and "this torch is 2.10.0" in old_default.why
    explicit = decide_reuse(asked, "2.15.1")
    assert explicit.on and explicit.asked and explicit.why.startswith("asked for")
    assert explicit.as_dict()["backends"] == "any"
    old = decide_reuse(asked, "2.10.0+cu128")
    assert not old.on and old.asked and "this torch is 2.10.0" in old.why
    for off in (again_off, env_off):
        assert not decide_reuse(off, "2.13.0").on and decide_reuse(off, "2.13.0").why.startswith("turned off")
    assert not decide_reuse(asked, "").on  # no torch found: off
    # a pre-release or a local build of a checked release: off by default, said in the report only; asked for, on
    # with a warning (context.activate)
    for build in ("2.15.0a0+gitecf3bae", "2.14.0.dev20260101+cpu", "2.13.0rc1", "2.13.0+git1234abc"):
        quiet = decide_reuse(default, build)
        assert not quiet.on and quiet.why.startswith("off by default") and build in quiet.why
        assert quiet.warning() is None
        loud = decide_reuse(asked, build)
        assert loud.on and loud.asked and build in (loud.warning() or ""), loud
    assert on.warning() is None and explicit.warning() is None and old_default.warning() is None
    assert (old.warning() or "").startswith("--megacache-precompile ignored: checked on torch")
