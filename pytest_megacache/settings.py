"""Settings, resolved once: command line, then environment variable, then ini file, then default."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("readwrite", "read", "write", "off")
CHOICES = {"compile_threads": ("auto", "keep")}


class SettingsError(ValueError):
    """A bad setting; the message names where the value came from."""


@dataclass(frozen=True)
class Option:
    name: str  # dataclass field
    flag: str  # --megacache-...
    env: str
    ini: str
    kind: str  # "str", "bool", "mode", "choice", "float", "int" (> 0), "count" (>= 0)
    default: Any
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("bucket", "--megacache-bucket", "MEGACACHE_BUCKET", "megacache_bucket", "str", None,
           "S3 bucket holding the cache (boto3's standard credential chain)."),
    Option("prefix", "--megacache-prefix", "MEGACACHE_PREFIX", "megacache_prefix", "str", "pytest-megacache",
           "Key prefix inside the bucket or directory (default: pytest-megacache)."),
    Option("endpoint_url", "--megacache-endpoint-url", "MEGACACHE_ENDPOINT_URL", "megacache_endpoint_url", "str", None,
           "S3 endpoint URL for S3-compatible stores; AWS_ENDPOINT_URL_S3 is honoured too."),
    Option("directory", "--megacache-dir", "MEGACACHE_DIR", "megacache_dir", "str", None,
           "Local directory store (for example one persisted by actions/cache)."),
    Option("mode", "--megacache-mode", "MEGACACHE_MODE", "megacache_mode", "mode", "readwrite",
           "readwrite (default), read (restore only), write (upload only) or off."),
    Option("strict", "--megacache-strict", "MEGACACHE_STRICT", "megacache_strict", "bool", False,
           "Turn cache problems into errors instead of warnings."),
    Option("require_signature", "--megacache-require-signature", "MEGACACHE_REQUIRE_SIGNATURE",
           "megacache_require_signature", "bool", False,
           "Fail closed: restore and upload nothing unless MEGACACHE_SIGNING_KEY holds a key (an empty secret is "
           "GitHub's value for a missing one)."),
    Option("files", "--megacache-files", "MEGACACHE_FILES", "megacache_files", "bool", True,
           "Carry the compiled files mega-cache leaves out, such as CPU C++ kernels (yes/no; default: yes)."),
    Option("report", "--megacache-report", "MEGACACHE_REPORT", "megacache_report", "str", None,
           "Write a JSON report of what the cache did to this path."),
    Option("timeout", "--megacache-timeout", "MEGACACHE_TIMEOUT", "megacache_timeout", "float", 120.0,
           "Wall-clock budget of the restore, in seconds from its start (connecting, listing, fetching); "
           "compiles wait for it this long at most, in all, then the session goes on cold (default: 120)."),
    Option("upload_timeout", "--megacache-upload-timeout", "MEGACACHE_UPLOAD_TIMEOUT", "megacache_upload_timeout",
           "float", 60.0, "Wall-clock budget of the upload at session end, compaction included, in seconds; past it "
                          "the session ends without it (default: 60)."),
    Option("compact_after", "--megacache-compact-after", "MEGACACHE_COMPACT_AFTER", "megacache_compact_after", "int", 8,
           "Merge a fingerprint's objects into one once it has more than this many (default: 8)."),
    Option("scope", "--megacache-scope", "MEGACACHE_SCOPE", "megacache_scope", "str", None,
           "Cache scope written to (default: the branch from GITHUB_REF or git); reads fall back to the "
           "default branch's scope."),
    Option("default_scope", "--megacache-default-scope", "MEGACACHE_DEFAULT_SCOPE", "megacache_default_scope", "str",
           None, "The scope every run may read (default: the repository's default branch, else main)."),
    Option("durations", "--megacache-durations", "MEGACACHE_DURATIONS", "megacache_durations", "count", 0,
           "List the N tests with the most uncached compile time (like --durations)."),
    Option("compile_threads", "--megacache-compile-threads", "MEGACACHE_COMPILE_THREADS", "megacache_compile_threads",
           "choice", "auto", "auto (default): one Inductor compile thread when the restored cache is expected to "
                             "cover the session, sparing its worker pool; keep: torch's default."),
    Option("precompile", "--megacache-precompile", "MEGACACHE_PRECOMPILE", "megacache_precompile", "bool", False,
           "Experimental: turn on torch's caching precompile (Dynamo) and carry its artifacts. Off by default."),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Settings:
    bucket: str | None = None
    prefix: str = "pytest-megacache"
    endpoint_url: str | None = None
    directory: str | None = None
    mode: str = "readwrite"
    strict: bool = False
    files: bool = True
    report: str | None = None
    timeout: float = 120.0
    upload_timeout: float = 60.0
    require_signature: bool = False
    compact_after: int = 8
    scope: str | None = None
    default_scope: str | None = None
    durations: int = 0
    compile_threads: str = "auto"
    precompile: bool = False
    explicit: frozenset[str] = frozenset()  # options set by the user (any source), not defaulted

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and (self.bucket is not None or self.directory is not None)

    @property
    def reads(self) -> bool:
        return self.mode in ("readwrite", "read")

    @property
    def writes(self) -> bool:
        return self.mode in ("readwrite", "write")

    def store_label(self) -> str:
        if self.bucket:
            return f"s3://{self.bucket}/{self.prefix}"
        if self.directory:
            return f"dir:{self.directory}/{self.prefix}"
        return "none"


def _convert(opt: Option, value: Any, source: str) -> Any:
    where = f"{source} ({opt.flag if source == 'command line' else opt.env if source == 'environment' else opt.ini})"
    if opt.kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise SettingsError(f"{where}: {value!r} is not a boolean (use 1/0, true/false, yes/no)")
    text = str(value).strip()
    if opt.kind == "mode":
        if text not in MODES:
            raise SettingsError(f"{where}: mode {text!r} is not one of {', '.join(MODES)}")
        return text
    if opt.kind == "choice":
        if text not in CHOICES[opt.name]:
            raise SettingsError(f"{where}: {text!r} is not one of {', '.join(CHOICES[opt.name])}")
        return text
    if opt.kind == "count":
        if not text.isdigit() or int(text) > 1_000_000:
            raise SettingsError(f"{where}: {text!r} is not a whole number >= 0")
        return int(text)
    if opt.kind in ("float", "int"):
        try:
            number = float(text) if opt.kind == "float" else int(text)
        except ValueError:
            raise SettingsError(f"{where}: {text!r} is not a number") from None
        # Not NaN, inf or beyond what threading's waits accept (they raise OverflowError past TIMEOUT_MAX).
        if not 0 < number <= threading.TIMEOUT_MAX:
            raise SettingsError(f"{where}: {text!r} must be a positive, finite number")
        return number
    if not text:
        raise SettingsError(f"{where}: empty value")
    if opt.name == "bucket" and not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", text):
        raise SettingsError(f"{where}: {text!r} is not a valid S3 bucket name")
    if opt.name == "prefix":
        text = text.strip("/")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*", text) or ".." in text:
            raise SettingsError(f"{where}: prefix {text!r} may hold only letters, digits, '_.-' and '/'")
    if opt.name in ("scope", "default_scope") and not re.fullmatch(r"[A-Za-z0-9_+\-][A-Za-z0-9_.+\-]{0,99}", text):
        raise SettingsError(f"{where}: scope {text!r} may hold only letters, digits and '_.+-' (at most 100)")
    if opt.name == "endpoint_url" and not re.match(r"https?://", text):
        raise SettingsError(f"{where}: {text!r} is not an http(s) URL")
    return text


def resolve(
    cli: Callable[[str], Any],
    env: Mapping[str, str],
    ini: Callable[[str], Any],
) -> Settings:
    """Resolve every option. ``cli(name)`` and ``ini(name)`` return None when unset."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        for source, raw in (("command line", cli(opt.name)), ("environment", env.get(opt.env)), ("ini file", ini(opt.ini))):
            if raw is None or (source != "command line" and raw == ""):
                continue
            values[opt.name] = _convert(opt, raw, source)
            break
    settings = Settings(**values, explicit=frozenset(values))
    if settings.bucket and settings.directory:
        raise SettingsError("set either a bucket (--megacache-bucket) or a directory (--megacache-dir), not both")
    return settings

