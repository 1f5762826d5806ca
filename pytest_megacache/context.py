"""What a session knows before it runs: settings, fingerprint, scopes, signing keys, and why the plugin is
off if it is. Built once at configure time by :func:`activate`, in every role (a plain session, an xdist
controller, a worker), and handed to the role's plugin object. No pytest here: the hooks module passes in
what it read from pytest's config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import ci_env
from .fingerprint import Fingerprint, TorchUnavailable, compute
from .layout import Layout
from .settings import Settings
from .torch_adapter import TorchAdapter

if TYPE_CHECKING:
    from .files import FileRoot


@dataclass
class Context:
    settings: Settings
    fingerprint: Fingerprint | None = None
    scope: str = "main"  # written to
    default_scope: str = "main"  # read too
    signing_keys: tuple[bytes, ...] = ()
    reason: str | None = None  # why the plugin does nothing this session (off, or inactive)
    inactive: bool = False  # the reason is a problem (a store was configured), not a choice
    notes: list[str] = field(default_factory=list)  # said once in the summary, not warnings
    problems: list[str] = field(default_factory=list)  # found at configure time (each warned at once)
    reuse: Reuse = field(default_factory=lambda: Reuse(False, "the plugin is off"))  # Dynamo reuse, and why

    @property
    def active(self) -> bool:
        return self.reason is None and self.fingerprint is not None

    def folder(self, scope: str) -> str:
        assert self.fingerprint is not None
        return Layout(self.settings.prefix).folder(scope, self.fingerprint.key)

    def roots(self) -> list[FileRoot]:
        """The cache directories whose compiled files travel (mega-cache leaves them out)."""
        from .files import FileRoot, inductor_cache_dir, pch_dir, pch_enabled, triton_cache_dir, triton_installed

        if not self.settings.files:
            return []
        roots = [FileRoot("inductor", inductor_cache_dir())]
        if pch_enabled():
            # Inductor's CPU precompiled header (on by default): rebuilt in seconds by every fresh machine
            # that compiles or loads a C++ kernel, unless it travels.
            roots.append(FileRoot("pch", pch_dir()))
        if triton_installed():
            roots.append(FileRoot("triton", triton_cache_dir()))
        return roots


@dataclass(frozen=True)
class Invocation:
    """What :func:`activate` needs from pytest's config."""

    rootpath: Path
    invoked_from: Path
    inipath: Path | None
    cli_dir: str | None  # --megacache-dir as given on the command line


def activate(settings: Settings, invocation: Invocation, env: Mapping[str, str] | None = None,
             notes: list[str] | None = None) -> Context:
    env = os.environ if env is None else env
    ctx = Context(settings, notes=list(notes or []))
    if settings.mode == "off":
        ctx.reason = "mode off"
        return ctx
    if not settings.enabled:
        ctx.reason = "no store configured; set --megacache-bucket or --megacache-dir"
        return ctx
    if settings.signing_error:
        return _inactive(ctx, f"MEGACACHE_SIGNING_KEY is unusable: {settings.signing_error}")
    ctx.signing_keys = settings.signing_keys
    if settings.require_signature and not ctx.signing_keys:
        return _inactive(ctx, "signatures are required (--megacache-require-signature) but MEGACACHE_SIGNING_KEY is "
                              "empty or unset, so nothing is restored or uploaded")
    try:
        ctx.fingerprint = compute()
    except TorchUnavailable as exc:
        return _inactive(ctx, str(exc))
    _check_rootdir(ctx, invocation)
    root = str(invocation.rootpath)
    scope, _source = ci_env.current_scope(env, root)
    ctx.default_scope = settings.default_scope or ci_env.default_scope(env, root)
    ctx.scope = settings.scope or scope or ctx.default_scope
    if not ctx.signing_keys and settings.reads:
        ctx.notes.append("restored bundles are trusted as-is: set MEGACACHE_SIGNING_KEY to sign and verify them")
    ctx.reuse = decide_reuse(settings, str(ctx.fingerprint.parts.get("torch", "")))
    if warning := ctx.reuse.warning():  # asked for explicitly: said; by default, the report says why
        ctx.problems.append(warning)
    # The opt-in that sets a torch config flag (it imports torch, so only when asked for).
    if settings.eager_backward and (why_not := TorchAdapter.enable_eager_backward()):
        ctx.problems.append(f"--megacache-eager-backward ignored: {why_not}")
    return ctx


@dataclass
class Reuse:
    """Whether this session reuses Dynamo's traced work (the compiling role installs it where ``torch._dynamo`` is
    imported), and on which grounds: said in the report. ``asked``: turned on by the user (a command line flag, the
    environment or an ini file), not by default; only then does it cover a backend that is not torch's own (a function
    of the suite's, which a frame taken from the store never calls), and only then is a torch it does not cover said
    in a warning."""

    on: bool
    why: str
    asked: bool = False
    unchecked: str = ""  # asked for on a build of a checked release that is not the release itself: why, said once

    def as_dict(self) -> dict[str, object]:
        return {"on": self.on, "why": self.why, "backends": "any" if self.asked else "torch's own"}

    def warning(self) -> str | None:
        """What is said as a warning: reuse asked for where it is not on, or on a torch it was not checked on."""
        if self.asked and not self.on:
            return f"--megacache-precompile ignored: {self.why}"
        if self.unchecked:
            return f"--megacache-precompile on an unchecked torch: {self.unchecked}"
        return None


def decide_reuse(settings: Settings, torch: str) -> Reuse:
    """Dynamo reuse is on by default where its checks were written for the torch installed (``torch``: its version,
    read without importing it), off where turned off or elsewhere."""
    from .dynamo import CHECKED_RELEASES, final_release, release_checked

    asked = "precompile" in settings.explicit
    if not settings.precompile:
        return Reuse(False, "turned off (--megacache-no-precompile, MEGACACHE_PRECOMPILE or megacache_precompile)")
    if not release_checked(torch):
        return Reuse(False, f"checked on torch {', '.join(CHECKED_RELEASES)} only, and this torch is "
                            f"{torch.split('+')[0] or 'unknown'}", asked)
    if not final_release(torch):
        build = f"torch {torch} is a pre-release or a local build, and reuse is checked on final releases only"
        if asked:
            return Reuse(True, f"asked for on {build}", True, unchecked=build)
        return Reuse(False, f"off by default: {build} (--megacache-precompile turns it on)")
    if asked:
        return Reuse(True, "asked for (--megacache-precompile, MEGACACHE_PRECOMPILE or megacache_precompile): "
                           "every backend that can be named in another process", True)
    return Reuse(True, f"on by default on torch {torch.split('+')[0]}, for torch's own backends "
                       "(--megacache-no-precompile turns it off)")


def _inactive(ctx: Context, reason: str) -> Context:
    ctx.reason, ctx.inactive = reason, True
    ctx.problems.append(f"pytest-megacache is inactive: {reason}")
    return ctx


def _check_rootdir(ctx: Context, invocation: Invocation) -> None:
    """``pytest --megacache-dir /outside/the/project`` (a space, no test paths): pytest picks its rootdir
    before plugins' options are known, takes the value for a test path, and misses the project's ini."""
    if not invocation.cli_dir:
        return
    store, root = Path(invocation.cli_dir).absolute(), invocation.rootpath
    if invocation.inipath is None and store.is_relative_to(root) and not store.is_relative_to(invocation.invoked_from):
        ctx.problems.append(f"pytest took the --megacache-dir value for a test path (rootdir {root}), so the project's "
                            f"ini file was not read; write --megacache-dir={invocation.cli_dir} or set MEGACACHE_DIR")
