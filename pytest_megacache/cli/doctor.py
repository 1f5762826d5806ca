"""``pytest-megacache doctor``: what a CI setup gets wrong, one line per check.

In order: torch and triton (versions read without importing torch), the fingerprint, the settings (store, mode,
scopes), the store (S3: credentials and where boto3 found them, the bucket, listing, writing a probe object that
is deleted again; a directory: exists or can be created, listing, writing a probe file), the signing key, and
what a session would restore for this fingerprint and scope (or, when nothing, the nearest stored fingerprint
and what differs: :func:`.core.nearest_fingerprint`, the plugin's own why-miss diagnosis).

Settings come from the store flags (:mod:`.storeopts`, as for the other commands), the session flags a pytest command line would
carry (``--megacache-mode``, ``--megacache-timeout``, ...) and every ``MEGACACHE_*`` variable, resolved by the
plugin's own code; ini files are not read. Every store operation runs against one wall-clock budget,
``--megacache-timeout`` (:mod:`.deadline`). Any failure is one ``FAIL`` line, never a traceback, and every line
is masked (:func:`.errors.redact`) before it is printed. Exit status 0 when a session would work (warnings
allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import bundle as bundlemod
from .. import ci_env
from ..errors import StoreError, redact
from ..fingerprint import Fingerprint, TorchUnavailable, compute, torch_info
from ..layout import Layout
from ..report import human_age, human_bytes, plural
from ..settings import OPTIONS, SIGNING_KEY_ENV, Settings, SettingsError, resolve
from ..stores import Deadline, LocalDirStore, ObjectInfo, S3Store, Store, bounded, from_settings, new_object_name
from .storeopts import STORE_FIELDS, add_store_options, cli_flags

OK, WARN, FAIL = "ok", "warn", "FAIL"
SESSION_OPTIONS = ("mode", "timeout", "require_signature", "scope", "default_scope")  # flags besides the store's
PROBE_DATA = b"pytest-megacache doctor: a write probe, deleted again at once\n"
MAX_FINDING = 600
CREDENTIAL_SOURCES = {  # botocore's provider names (Credentials.method)
    "env": "environment variables", "shared-credentials-file": "the shared credentials file",
    "config-file": "the AWS config file", "assume-role": "a role assumed for the profile",
    "assume-role-with-web-identity": "a web identity token (OIDC)", "sso": "AWS SSO",
    "container-role": "the container credentials endpoint", "iam-role": "the instance metadata service",
    "custom-process": "a credential_process",
}


@dataclass
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    finding: str
    details: dict[str, object] = field(default_factory=dict)


def _masked(value: Any) -> Any:
    """``value`` with every string in it masked (:func:`redact`) and on one line."""
    if isinstance(value, str):
        return " ".join(redact(value).split())[:MAX_FINDING]
    if isinstance(value, dict):
        return {str(_masked(k)): _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(v) for v in value]
    return value


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist, deepest first (what a write there creates)."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _credentials() -> tuple[str, bool] | None:
    """Where boto3's chain finds credentials (``Credentials.method``), and whether they are complete; None when
    it finds none. Refreshable credentials (assume-role, web identity) are fetched, so a bad role shows here."""
    import boto3

    creds = boto3.session.Session().get_credentials()
    if creds is None:
        return None
    frozen = creds.get_frozen_credentials()
    return str(creds.method or "unknown"), bool(frozen.access_key and frozen.secret_key)


class Doctor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.env = dict(os.environ)
        self.checks: list[Check] = []
        self.settings: Settings | None = None
        self.fork_note = ""
        self.fp: Fingerprint | None = None
        self.scope, self.read_scopes = "main", ["main"]
        self.deadline = Deadline(120.0, "the doctor's store checks", "--megacache-timeout")
        self.store: Store | None = None
        self.listing: list[tuple[str, ObjectInfo]] | None = None  # this fingerprint's objects; None: not listed

    # --- bookkeeping ---------------------------------------------------------------------------------
    @staticmethod
    def attempt(name: str, fn: Callable[[], Check]) -> Check:
        """Run one check; whatever it raises is that check's FAIL line."""
        try:
            return fn()
        except StoreError as exc:
            return Check(name, FAIL, str(exc))
        except Exception as exc:  # noqa: BLE001 - a client, a store or the environment: one line, no traceback
            return Check(name, FAIL, f"{type(exc).__name__}: {exc}")

    def check(self, name: str, fn: Callable[[], Check]) -> Check:
        result = self.attempt(name, fn)
        self.checks.append(result)
        return result

    def skip(self, names: Sequence[str], why: str) -> None:
        self.checks.extend(Check(name, FAIL, f"not checked: {why}") for name in names)

    def run(self) -> None:
        torch = self.check("torch", self.check_torch)
        if torch.status == FAIL:
            self.skip(["triton", "fingerprint"], "no usable torch")
        else:
            fingerprint = self.attempt("fingerprint", self.check_fingerprint)  # triton's line reads it
            self.check("triton", self.check_triton)
            self.checks.append(fingerprint)
        self.check("settings", self.check_settings)
        if self.settings is None:
            self.skip(["store", "signing key", "restore"], "the settings are unusable")
            return
        if self.settings.bucket or self.settings.directory:
            self.store_checks()
        else:
            self.skip(["store"], "no store configured")
        self.check("signing key", self.check_signing)
        self.check("restore", self.check_restore)

    # --- torch and the fingerprint -------------------------------------------------------------------
    def check_torch(self) -> Check:
        try:
            info = torch_info()
        except TorchUnavailable as exc:
            return Check("torch", FAIL, f"{exc}: nothing is compiled, so nothing is cached")
        build = f"CUDA {info.cuda}" if info.cuda else f"ROCm {info.hip}" if info.hip else "CPU build"
        return Check("torch", OK, f"{info.version} (git {info.git_version[:12]}, {build})",
                     {"version": info.version, "git_version": info.git_version, "cuda": info.cuda, "hip": info.hip})

    def check_fingerprint(self) -> Check:
        self.fp = compute()
        return Check("fingerprint", OK, self.fp.key, {"key": self.fp.key, "digest": self.fp.digest})

    def check_triton(self) -> Check:
        if self.fp is None:
            return Check("triton", FAIL, "not checked: no fingerprint")
        version, gpus = self.fp.parts.get("triton"), self.fp.parts.get("gpus")
        if version:
            return Check("triton", OK, str(version), {"version": version})
        if gpus:
            return Check("triton", FAIL, "not installed: torch.compile on the GPU needs it (pip install triton, or "
                                         "torch from the index matching its CUDA/ROCm build)", {"version": None})
        return Check("triton", OK, "not installed (compiling for the CPU does not need it)", {"version": None})

    # --- settings ------------------------------------------------------------------------------------
    def check_settings(self) -> Check:
        names = set(STORE_FIELDS) | set(SESSION_OPTIONS)
        try:
            settings = resolve(cli=lambda name: getattr(self.args, name, None) if name in names else None,
                               env=self.env, ini=lambda _name: None)
        except SettingsError as exc:
            return Check("settings", FAIL, cli_flags(str(exc)))
        if "mode" not in settings.explicit and settings.mode == "readwrite":  # as the plugin decides it
            fork = ci_env.is_fork_pull_request(self.env)
            if fork.fork:
                settings, self.fork_note = replace(settings, mode="read"), f": {fork.reason}"
        cwd = Path.cwd()
        current, source = ci_env.current_scope(self.env, cwd)
        default = settings.default_scope or ci_env.default_scope(self.env, cwd)
        self.scope = settings.scope or current or default
        self.read_scopes = list(dict.fromkeys([self.scope, default]))
        self.deadline = Deadline(settings.timeout, "the doctor's store checks", "--megacache-timeout")
        details = {"store": settings.store_label(), "mode": settings.mode, "timeout": settings.timeout,
                   "scope": self.scope, "scope_source": "--megacache-scope" if settings.scope else source,
                   "read_scopes": self.read_scopes}
        self.settings = settings
        if not (settings.bucket or settings.directory):
            return Check("settings", FAIL, "no store configured: pass --bucket or --dir (or set MEGACACHE_BUCKET or "
                                           "MEGACACHE_DIR); without one the plugin is off", details)
        where = (f"{settings.store_label()}, mode {settings.mode}{self.fork_note}, budget {settings.timeout:g} s; "
                 f"writes scope {self.scope}, reads {', '.join(self.read_scopes)}")
        if settings.mode == "off":
            return Check("settings", FAIL, f"{where}: mode off, so the plugin restores and uploads nothing", details)
        return Check("settings", OK, where, details)

    # --- the store -----------------------------------------------------------------------------------
    def store_checks(self) -> None:
        assert self.settings is not None
        stores = StoreChecks(self.settings, self.env, self.deadline, self.fp, self.scope, self.read_scopes,
                             self.fork_note)
        stores.run(self.check, self.skip)
        self.store, self.listing = stores.store, stores.listing

    # --- signing and the restore ---------------------------------------------------------------------
    def check_signing(self) -> Check:
        assert self.settings is not None
        s = self.settings
        if s.signing_error:
            return Check("signing key", FAIL, f"{s.signing_error}: a session is inactive with it (restores and uploads "
                                              "nothing)", {"keys": 0})
        if s.signing_keys:
            kids = [bundlemod.key_id(k) for k in s.signing_keys]
            verify = f"; {len(kids) - 1} more verify" if len(kids) > 1 else ""
            return Check("signing key", OK, f"set: signs with kid {kids[0]}{verify}", {"keys": len(kids), "kids": kids})
        if s.require_signature:
            return Check("signing key", FAIL, f"required (--megacache-require-signature) but {SIGNING_KEY_ENV} is empty "
                                              "or unset: a session restores and uploads nothing", {"keys": 0})
        if self.env.get(SIGNING_KEY_ENV) is not None:
            return Check("signing key", WARN, f"{SIGNING_KEY_ENV} is set but empty (GitHub's value for a missing "
                                              "secret): restored bundles are trusted as-is", {"keys": 0})
        return Check("signing key", OK, "not configured: restored bundles are trusted as-is (fine unless "
                                        "--megacache-require-signature)", {"keys": 0})

    def check_restore(self) -> Check:
        assert self.settings is not None
        s = self.settings
        if not s.reads:
            return Check("restore", OK, f"not restoring by mode ({s.mode})")
        if self.fp is None:
            return Check("restore", FAIL, "not checked: no fingerprint")
        if self.listing is None or self.store is None:
            why = "the store could not be listed" if s.bucket or s.directory else "no store configured"
            return Check("restore", FAIL, f"not checked: {why}")
        scopes = ", ".join(self.read_scopes)
        if not self.listing:
            why = self.why_miss(self.store, self.fp)
            cold = "; the first run compiles cold and uploads" if s.writes else ""
            return Check("restore", WARN, f"nothing stored for this fingerprint in {scopes}: {why}{cold}",
                         {"objects": 0, "why_miss": why})
        now = time.time()
        size = sum(info.size for _, info in self.listing)
        newest = max(self.listing, key=lambda item: item[1].modified)
        oldest = min(info.modified for _, info in self.listing)
        per_scope = {scope: sum(f == Layout(s.prefix).folder(scope, self.fp.key) for f, _ in self.listing)
                     for scope in self.read_scopes}
        finding = (f"{plural(len(self.listing), 'object')}, {human_bytes(size)} for this fingerprint ("
                   + ", ".join(f"{k}: {v}" for k, v in per_scope.items() if v)
                   + f"); newest {human_age(now - newest[1].modified)}, oldest {human_age(now - oldest)}")
        details: dict[str, object] = {"objects": len(self.listing), "bytes": size, "scopes": per_scope,
                                      "newest": newest[1].modified, "oldest": oldest,
                                      "newest_age_s": round(now - newest[1].modified, 3),
                                      "oldest_age_s": round(now - oldest, 3)}
        unsigned = self.signature_problem(self.store, *newest) if s.signing_keys else None
        if unsigned:
            return Check("restore", WARN, f"{finding}; but the newest {unsigned}, so a session with these keys "
                                          "refuses it", details)
        return Check("restore", OK, finding, details)

    def why_miss(self, store: Store, fp: Fingerprint) -> str:
        """The plugin's own why-miss diagnosis (it also names a scope holding this fingerprint that is not read)."""
        from ..core import nearest_fingerprint

        assert self.settings is not None
        prefix = self.settings.prefix
        try:
            text = bounded(lambda: nearest_fingerprint(store, prefix, self.read_scopes, fp.key, fp.parts),
                           self.deadline, "the why-miss diagnosis")
        except StoreError as exc:
            return f"why is unknown ({exc})"
        return text or "?"

    def signature_problem(self, store: Store, folder: str, info: ObjectInfo) -> str | None:
        """Why a session with the configured keys would refuse ``info`` (from its unverified header), or None."""
        assert self.settings is not None
        head = bounded(lambda: store.head(folder, info.name, bundlemod.HEADER_PREFIX_BYTES), self.deadline,
                       "reading an object's header")
        doc = bundlemod.peek_header(head) if head is not None else None
        sig = doc.get("sig") if doc is not None else None
        kid = sig.get("kid") if isinstance(sig, dict) else None
        if doc is None:
            return None  # gone, or not a bundle: the restore names it
        if not isinstance(kid, str):
            return "object is unsigned"
        if kid not in {bundlemod.key_id(k) for k in self.settings.signing_keys}:
            shown = kid if re.fullmatch(r"[0-9a-f]{8}", kid) else "?"
            return f"object is signed with another key (kid {shown})"
        return None

    # --- output --------------------------------------------------------------------------------------
    def lines(self, seconds: float) -> list[str]:
        width = max(len(c.name) for c in self.checks)
        out = [f"{c.status:<4}  {c.name:<{width}}  {_masked(c.finding)}" for c in self.checks]
        failed = sum(c.status == FAIL for c in self.checks)
        warned = sum(c.status == WARN for c in self.checks)
        if failed:
            verdict = f"a session would not work: {failed} check{'s' * (failed != 1)} failed"
        else:
            verdict = "a session would work" + (f", with {warned} warning{'s' * (warned != 1)}" if warned else "")
        return [*out, f"{verdict} ({seconds:.1f} s)"]


class StoreChecks:
    """The store's checks, as a session would meet the store: credentials (S3), the bucket or the directory, listing
    this fingerprint's folders in the scopes read (the listing is kept for the restore's check) and a probe written
    and deleted where the session writes."""

    def __init__(self, settings: Settings, env: dict[str, str], deadline: Deadline, fp: Fingerprint | None,
                 scope: str, read_scopes: list[str], fork_note: str) -> None:
        self.settings, self.env, self.deadline, self.fp = settings, env, deadline, fp
        self.scope, self.read_scopes, self.fork_note = scope, read_scopes, fork_note
        self.store: Store | None = None
        self.listing: list[tuple[str, ObjectInfo]] | None = None  # this fingerprint's objects; None: not listed

    def open_store(self) -> Store:
        settings = self.settings
        self.store = bounded(lambda: from_settings(settings), self.deadline, "building the store's client")
        return self.store

    def run(self, check: Callable[[str, Callable[[], Check]], Check],
            skip: Callable[[Sequence[str], str], None]) -> None:
        """Each check in turn (``check`` runs and records one, ``skip`` records those a failure leaves unchecked)."""
        if self.settings.bucket:
            if check("credentials", self.check_credentials).status == FAIL:
                skip(["bucket", "list", "write"], "no credentials")
                return
            first = check("bucket", self.check_bucket)
        else:
            first = check("directory", self.check_directory)
        if first.status == FAIL:
            skip(["list", "write"], f"the {first.name} check failed")
            return
        check("list", self.check_list)
        check("write", self.check_write)

    def check_credentials(self) -> Check:
        found = bounded(_credentials, self.deadline, "looking for AWS credentials")
        if found is None:
            return Check("credentials", FAIL, "none found: boto3 looked in the environment, the shared credentials "
                                              "and config files, web identity, the container and instance metadata")
        method, complete = found
        profile = f", profile {self.env['AWS_PROFILE']}" if self.env.get("AWS_PROFILE") else ""
        where = f"{method} ({CREDENTIAL_SOURCES.get(method, 'botocore provider')}{profile})"
        if not complete:
            return Check("credentials", FAIL, f"incomplete, from {where}", {"method": method})
        return Check("credentials", OK, f"found, from {where}", {"method": method})

    def check_bucket(self) -> Check:
        store = self.open_store()
        assert isinstance(store, S3Store)

        def head() -> tuple[str | None, str | None]:
            from botocore.exceptions import ClientError

            try:
                response = store.client.head_bucket(Bucket=store.bucket)
            except ClientError as exc:
                return str(exc.response.get("Error", {}).get("Code", "?")), None
            return None, response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")

        code, region = bounded(head, self.deadline, "checking the bucket")
        where = f"s3://{store.bucket} at {store.client.meta.endpoint_url}"
        if code in ("404", "NoSuchBucket"):
            return Check("bucket", FAIL, f"{where} does not exist ({code})", {"exists": False})
        if code in ("403", "AccessDenied"):
            return Check("bucket", WARN, f"{where}: HeadBucket was denied ({code}), so whether it exists is unknown; "
                                         "the listing below decides", {"exists": None})
        if code is not None:
            return Check("bucket", FAIL, f"{where}: HeadBucket answered {code}", {"exists": None})
        return Check("bucket", OK, f"{where} exists" + (f" (region {region})" if region else ""),
                     {"exists": True, "region": region})

    def check_directory(self) -> Check:
        assert self.settings.directory is not None
        root, writes = Path(self.settings.directory), self.settings.writes
        self.open_store()

        def look() -> Check:
            if root.is_dir():
                return Check("directory", OK, f"{root} exists", {"exists": True})
            if root.exists():
                return Check("directory", FAIL, f"{root} exists but is not a directory", {"exists": False})
            parent = (_missing_dirs(root) or [root])[-1].parent
            if not parent.is_dir():
                return Check("directory", FAIL, f"{root} cannot be created: {parent} is not a directory", {"exists": False})
            if writes:
                return Check("directory", OK, f"{root} does not exist yet; the first upload creates it", {"exists": False})
            return Check("directory", WARN, f"{root} does not exist, so there is nothing to restore (is it the path "
                                            "your CI restores, e.g. actions/cache's?)", {"exists": False})

        return bounded(look, self.deadline, "looking at the directory")

    def check_list(self) -> Check:
        assert self.store is not None
        store, prefix, fp = self.store, self.settings.prefix, self.fp
        if fp is None:  # no folder to list for this fingerprint: the whole prefix, then
            walked = bounded(lambda: store.walk(prefix), self.deadline, "listing the store")
            return Check("list", OK, f"allowed: {len(walked)} objects under {prefix}", {"objects": len(walked)})
        folders = [Layout(prefix).folder(scope, fp.key) for scope in self.read_scopes]
        try:
            self.listing = [(folder, info) for folder in folders
                            for info in bounded(lambda f=folder: store.list(f), self.deadline,  # type: ignore[misc]
                                                "listing the store")]
        except StoreError as exc:
            return Check("list", FAIL if self.settings.reads else WARN, str(exc))
        counts = [sum(f == folder for f, _ in self.listing) for folder in folders]
        where = ", ".join((f"{plural(n, 'object')} of this fingerprint" if i == 0 else str(n)) + f" in {scope}"
                          for i, (n, scope) in enumerate(zip(counts, self.read_scopes, strict=True)))
        return Check("list", OK, f"allowed: {where}", {"objects": len(self.listing)})

    def check_write(self) -> Check:
        assert self.store is not None
        settings, store = self.settings, self.store
        if not settings.writes:
            return Check("write", OK, f"read-only by mode ({settings.mode}{self.fork_note})", {"probe": False})
        # Beside the fingerprint folders, never in one: a restore never lists the probe, even while it exists.
        folder, name = f"{settings.prefix}/{self.scope}", "doctor-probe-" + new_object_name()
        created = _missing_dirs(store.root.joinpath(*folder.split("/"))) if isinstance(store, LocalDirStore) else []
        try:
            bounded(lambda: store.put(folder, name, PROBE_DATA), self.deadline, "writing a probe object")
            try:
                bounded(lambda: store.delete(folder, name), self.deadline, "deleting the probe object")
            except StoreError as exc:
                return Check("write", WARN, f"allowed, but deleting the probe failed ({exc}); compaction deletes too. "
                                            f"Remove {folder}/{name} by hand", {"probe": True})
        finally:
            for path in created:  # what the probe created, deepest first; left alone unless empty
                try:
                    path.rmdir()
                except OSError:
                    break
        return Check("write", OK, f"allowed: a probe object was written to {folder}/ and deleted again", {"probe": True})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="a machine-readable report")
    group = parser.add_argument_group("session", "as on the pytest command line; each falls back to its variable")
    for opt in OPTIONS:
        if opt.name in SESSION_OPTIONS:
            if opt.kind == "bool":
                group.add_argument(opt.flag, dest=opt.name, action="store_true", default=None,
                                   help=f"{opt.help} [{opt.env}]")
            else:
                group.add_argument(opt.flag, dest=opt.name, metavar=opt.name.upper(), help=f"{opt.help} [{opt.env}]")
    add_store_options(parser)


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    doctor = Doctor(args)
    doctor.run()
    seconds = time.monotonic() - start
    ok = not any(c.status == FAIL for c in doctor.checks)
    if args.json:
        doc = {"ok": ok, "seconds": round(seconds, 3),
               "checks": [{"check": c.name, "status": c.status.lower(), "finding": c.finding, "details": c.details}
                          for c in doctor.checks]}
        print(json.dumps(_masked(doc), indent=2))
    else:
        print("\n".join(doctor.lines(seconds)))
    return 0 if ok else 1
