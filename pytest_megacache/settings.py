"""Settings, resolved once: command line, then environment variable, then ini file, then default.

Each default is stated once, on its :class:`Settings` field; :class:`Option` reads it from there (and its help
text shows it where it says ``{default}``). ``MEGACACHE_SIGNING_KEY`` is resolved here too, into fields that
are not options and never shown (:data:`PRIVATE_FIELDS`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .layout import SCOPE_MAX, valid_prefix, valid_scope

MODES = ("readwrite", "read", "write", "off")
CHOICES = {"compile_threads": ("auto", "keep")}

# Signing keys (kept apart from the bundle family, so that reading them costs no zstandard import: resolve()
# reads them at configure time, in sessions that may never touch the cache).
MIN_KEY_CHARS = 16
SIGNING_KEY_ENV = "MEGACACHE_SIGNING_KEY"


def parse_signing_keys(text: str | None) -> list[bytes]:
    """Keys from ``MEGACACHE_SIGNING_KEY``: separated by commas or whitespace; the first one signs.

    Every key verifies (so a rotation lists the new key first and the old one after it until old objects are
    gone). Each key must be at least 16 characters; a key is the UTF-8 bytes of its text. Error messages name a
    key by its position only, never by its text.
    """
    if text is None:
        return []
    keys: list[bytes] = []
    for i, part in enumerate((p for p in re.split(r"[\s,]+", text) if p), start=1):
        if len(part) < MIN_KEY_CHARS:
            raise ValueError(f"{SIGNING_KEY_ENV}: key {i} is shorter than {MIN_KEY_CHARS} characters")
        try:
            key = part.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes in the environment: the codec's message quotes them
            raise ValueError(f"{SIGNING_KEY_ENV}: key {i} is not valid UTF-8 text") from None
        if key not in keys:
            keys.append(key)
    return keys


class SettingsError(ValueError):
    """A bad setting; the message names where the value came from."""


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
    precompile: bool = True
    eager_backward: bool = False
    reuse_isa_check: bool = True
    children: bool = False
    explicit: frozenset[str] = frozenset()  # options set by the user (any source), not defaulted
    # From MEGACACHE_SIGNING_KEY (not an option): the keys, the first one signing, () when empty or unset; or
    # why the value is unusable (naming a key by its position, never by its text). Never in a repr or a report.
    signing_keys: tuple[bytes, ...] = field(default=(), repr=False)
    signing_error: str | None = field(default=None, repr=False)

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

    def reportable(self) -> dict[str, Any]:
        """``dataclasses.asdict`` without :data:`PRIVATE_FIELDS`: what a report may show."""
        return {k: v for k, v in asdict(self).items() if k not in PRIVATE_FIELDS}


PRIVATE_FIELDS = frozenset({"signing_keys", "signing_error"})  # never in a report
NOT_OPTIONS = frozenset({"explicit"}) | PRIVATE_FIELDS  # the Settings fields that OPTIONS does not set
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Settings)}


@dataclass(frozen=True)
class Option:
    name: str  # the Settings field, whose default is this option's
    flag: str  # --megacache-...
    env: str
    ini: str
    kind: str  # "str", "bool", "mode", "choice", "float", "int" (> 0), "count" (>= 0)
    doc: str  # the help text; "{default}" in it stands for the default
    negation: str = ""  # a bool's flag that sets it to no (--megacache-no-...), where ``flag`` alone sets it to yes

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.name]

    @property
    def help(self) -> str:
        return self.doc.format(default=shown(self.default))


def shown(value: Any) -> str:
    """A default as a help text shows it: ``yes``/``no``, ``120`` (not ``120.0``)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


OPTIONS: tuple[Option, ...] = (
    Option("bucket", "--megacache-bucket", "MEGACACHE_BUCKET", "megacache_bucket", "str",
           "S3 bucket holding the cache (boto3's standard credential chain)."),
    Option("prefix", "--megacache-prefix", "MEGACACHE_PREFIX", "megacache_prefix", "str",
           "Key prefix inside the bucket or directory (default: {default})."),
    Option("endpoint_url", "--megacache-endpoint-url", "MEGACACHE_ENDPOINT_URL", "megacache_endpoint_url", "str",
           "S3 endpoint URL for S3-compatible stores; AWS_ENDPOINT_URL_S3 is honoured too."),
    Option("directory", "--megacache-dir", "MEGACACHE_DIR", "megacache_dir", "str",
           "Local directory store (for example one persisted by actions/cache)."),
    Option("mode", "--megacache-mode", "MEGACACHE_MODE", "megacache_mode", "mode",
           "readwrite (default), read (restore only), write (upload only) or off."),
    Option("strict", "--megacache-strict", "MEGACACHE_STRICT", "megacache_strict", "bool",
           "Turn cache problems into errors instead of warnings."),
    Option("require_signature", "--megacache-require-signature", "MEGACACHE_REQUIRE_SIGNATURE",
           "megacache_require_signature", "bool",
           "Fail closed: restore and upload nothing unless MEGACACHE_SIGNING_KEY holds a key (an empty secret is "
           "GitHub's value for a missing one)."),
    Option("files", "--megacache-files", "MEGACACHE_FILES", "megacache_files", "bool",
           "Carry the compiled files mega-cache leaves out, such as CPU C++ kernels (yes/no; default: {default})."),
    Option("report", "--megacache-report", "MEGACACHE_REPORT", "megacache_report", "str",
           "Write a JSON report of what the cache did to this path."),
    Option("timeout", "--megacache-timeout", "MEGACACHE_TIMEOUT", "megacache_timeout", "float",
           "Wall-clock budget of the restore, in seconds from its start (connecting, listing, fetching); "
           "compiles wait for it this long at most, in all, then the session goes on cold (default: {default})."),
    Option("upload_timeout", "--megacache-upload-timeout", "MEGACACHE_UPLOAD_TIMEOUT", "megacache_upload_timeout",
           "float", "Wall-clock budget of the upload at session end, compaction included, in seconds; past it "
                    "the session ends without it (default: {default})."),
    Option("compact_after", "--megacache-compact-after", "MEGACACHE_COMPACT_AFTER", "megacache_compact_after", "int",
           "Merge a fingerprint's objects into one once it has more than this many (default: {default})."),
    Option("scope", "--megacache-scope", "MEGACACHE_SCOPE", "megacache_scope", "str",
           "Cache scope written to (default: the branch from GITHUB_REF or git); reads fall back to the "
           "default branch's scope."),
    Option("default_scope", "--megacache-default-scope", "MEGACACHE_DEFAULT_SCOPE", "megacache_default_scope", "str",
           "The scope every run may read (default: the repository's default branch, else main)."),
    Option("durations", "--megacache-durations", "MEGACACHE_DURATIONS", "megacache_durations", "count",
           "List the N tests with the most uncached compile time (like --durations)."),
    Option("compile_threads", "--megacache-compile-threads", "MEGACACHE_COMPILE_THREADS", "megacache_compile_threads",
           "choice", "auto (default): one Inductor compile thread when the restored cache is expected to "
                     "cover the session, sparing its worker pool; keep: torch's default."),
    Option("precompile", "--megacache-precompile", "MEGACACHE_PRECOMPILE", "megacache_precompile", "bool",
           "Dynamo reuse: Dynamo's traced work taken again for unchanged code (torch's caching precompile behind the "
           "plugin's checks: entries keyed by the code itself, every live guard kept, identity guards proven where a "
           "stored variant is taken, variants taken only under the backend, mode and settings they were compiled "
           "under, each frame failing open). On by default on the torch releases it was checked on "
           "(docs/what-is-cached.md), for torch's own backends; off elsewhere, without a warning. Asked for "
           "explicitly, it also covers a suite's own backends that are plain functions, and a torch it does not "
           "cover is said in a warning. --megacache-no-precompile turns it off.",
           negation="--megacache-no-precompile"),
    Option("eager_backward", "--megacache-eager-backward", "MEGACACHE_EAGER_BACKWARD", "megacache_eager_backward",
           "bool", "Opt-in: compile each AOTAutograd backward together with its forward (torch's functorch "
                   "force_non_lazy_backward_lowering), so that a graph whose inputs require grad is stored even when "
                   "its test never calls backward(), and hits warm. Changes what torch compiles: more cold compile "
                   "time, other AOTAutograd keys, and a backward that fails to compile fails its test. Applies to pytest's "
                   "own processes (xdist workers included), not to child processes. Off by default."),
    Option("reuse_isa_check", "--megacache-reuse-isa-check", "MEGACACHE_REUSE_ISA_CHECK", "megacache_reuse_isa_check",
           "bool", "Run torch's CPU vector-ISA load check (a new Python process per ISA library, in every process that "
                   "compiles for the CPU; tens of seconds with torch < 2.13) once per library and machine kind, and "
                   "take its recorded success after that (yes/no; default: {default}). torch's config and keys are "
                   "not touched."),
    Option("children", "--megacache-children", "MEGACACHE_CHILDREN", "megacache_children", "bool",
           "No longer needed, accepted and ignored: the restore starts with every session, and what child "
           "processes compile (torchrun, mp.spawn, subprocess) is carried by default."),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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
        if not valid_prefix(text):
            raise SettingsError(f"{where}: prefix {text!r} may hold only letters, digits, '_.-' and '/'")
    if opt.name in ("scope", "default_scope") and not valid_scope(text):
        raise SettingsError(f"{where}: scope {text!r} may hold only letters, digits and '_.+-' (at most {SCOPE_MAX})")
    if opt.name == "endpoint_url" and not re.match(r"https?://", text):
        raise SettingsError(f"{where}: {text!r} is not an http(s) URL")
    return text


def resolve(
    cli: Callable[[str], Any],
    env: Mapping[str, str],
    ini: Callable[[str], Any],
) -> Settings:
    """Resolve every option, and the signing keys from ``env``. ``cli(name)`` and ``ini(name)`` return None when
    unset. A bad option raises :class:`SettingsError`; an unusable signing key does not (it is no usage error:
    the plugin turns itself off and says why), it sets ``signing_error`` instead."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        for source, raw in (("command line", cli(opt.name)), ("environment", env.get(opt.env)), ("ini file", ini(opt.ini))):
            if raw is None or (source != "command line" and raw == ""):
                continue
            values[opt.name] = _convert(opt, raw, source)
            break
    try:
        signing_keys, signing_error = tuple(parse_signing_keys(env.get(SIGNING_KEY_ENV))), None
    except ValueError as exc:  # its message names a key by position only
        signing_keys, signing_error = (), str(exc)
    settings = Settings(**values, explicit=frozenset(values), signing_keys=signing_keys, signing_error=signing_error)
    if settings.bucket and settings.directory:
        raise SettingsError("set either a bucket (--megacache-bucket) or a directory (--megacache-dir), not both")
    return settings

