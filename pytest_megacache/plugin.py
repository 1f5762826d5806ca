"""pytest hooks. ``pytest_configure`` only resolves settings and registers :class:`MegacachePlugin`;
the cache flow itself lives in :mod:`pytest_megacache.core`."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict
from typing import Any

import pytest

from . import report as reportmod
from .core import CacheSession
from .errors import MegacacheWarning
from .files import FileRoot, inductor_cache_dir
from .fingerprint import Fingerprint, TorchUnavailable, compute
from .settings import OPTIONS, Settings, SettingsError, resolve
from .stores import from_settings
from .torch_adapter import TorchAdapter, disable_precompiled_headers

PLUGIN_NAME = "megacache-session"
megacache_key = pytest.StashKey["MegacachePlugin"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("megacache", "torch.compile cache (pytest-megacache)")
    for opt in OPTIONS:
        dest = f"megacache_{opt.name}"
        if opt.kind == "bool" and not opt.default:
            group.addoption(opt.flag, action="store_true", dest=dest, default=None, help=f"{opt.help} [{opt.env}]")
        else:
            group.addoption(opt.flag, action="store", dest=dest, default=None, metavar=opt.name.upper(),
                            help=f"{opt.help} [{opt.env}]")
        parser.addini(opt.ini, help=opt.help, default=None)


def pytest_configure(config: pytest.Config) -> None:
    try:
        settings = resolve(
            cli=lambda name: config.getoption(f"megacache_{name}"),
            env=os.environ,
            ini=lambda name: config.getini(name),
        )
    except SettingsError as exc:
        raise pytest.UsageError(f"pytest-megacache: {exc}") from None
    plugin = MegacachePlugin(config, settings)
    config.stash[megacache_key] = plugin
    config.pluginmanager.register(plugin, PLUGIN_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.stash.get(megacache_key, None)
    if plugin is not None:
        plugin.close()
        del config.stash[megacache_key]
        config.pluginmanager.unregister(plugin)


class MegacachePlugin:
    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.started = time.perf_counter()
        self.fingerprint: Fingerprint | None = None
        self.reason: str | None = None
        self.session: CacheSession | None = None
        self.adapter: TorchAdapter | None = None
        self.report: dict[str, Any] | None = None
        self.warned: list[str] = []
        if settings.mode == "off":
            self.reason = "mode off"
        elif not settings.enabled:
            self.reason = "no store configured; set --megacache-bucket or --megacache-dir"
        else:
            try:
                self.fingerprint = compute()
            except TorchUnavailable as exc:
                self.reason = str(exc)
                self.warned.append(f"pytest-megacache is inactive: {exc}")
                config.issue_config_time_warning(MegacacheWarning(self.warned[-1]), stacklevel=2)
        if self.active:
            self.pch_disabled = disable_precompiled_headers()

    @property
    def active(self) -> bool:
        return self.reason is None

    def _warn(self, message: str) -> None:
        self.warned.append(message)
        warnings.warn(MegacacheWarning(message), stacklevel=2)

    # --- hooks ------------------------------------------------------------------------------------
    def pytest_report_header(self, config: pytest.Config) -> str:
        if not self.active or self.fingerprint is None:
            return f"megacache: off ({self.reason})"
        return f"megacache: {self.settings.store_label()} [{self.settings.mode}] {self.fingerprint.key}"

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not self.active or self.fingerprint is None:
            return
        settings = self.settings
        self.session = CacheSession(
            store_factory=lambda: from_settings(settings),
            folder=f"{settings.prefix}/{self.fingerprint.key}",
            fingerprint=self.fingerprint.key,
            roots=[FileRoot("inductor", inductor_cache_dir())] if settings.files else [],
            reads=settings.reads,
            writes=settings.writes,
            compact_after=settings.compact_after,
        )
        cache_session = self.session
        self.adapter = TorchAdapter(lambda: cache_session.load_into_torch(settings.timeout))
        # Strict runs restore up front so a problem stops the session before any test runs.
        self.session.start_restore(background=not settings.strict)
        if settings.strict and self.session.problems:
            raise pytest.UsageError("pytest-megacache (strict): " + "; ".join(self.session.new_problems()))
        self.adapter.install()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        # torch._dynamo.reset() (common in fixtures) drops compile callbacks: put ours back.
        if self.adapter is not None:
            self.adapter.ensure_registered()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stats = None
        if self.session is not None and self.adapter is not None:
            self.adapter.uninstall()
            self.session.finish(self.adapter, self.settings.timeout)
            stats = self.session.stats()
            for problem in self.session.new_problems():
                self._warn(problem)
        settings = asdict(self.settings)
        settings["store"] = self.settings.store_label()
        self.report = reportmod.build(
            enabled=self.active,
            reason=self.reason,
            settings=settings,
            fingerprint={"key": self.fingerprint.key, **self.fingerprint.parts} if self.fingerprint else None,
            stats=stats,
            problems=list(self.warned),
            session_seconds=time.perf_counter() - self.started,
        )
        if self.settings.report:
            try:
                reportmod.write_json(self.settings.report, self.report)
            except OSError as exc:
                self._warn(f"cannot write the report to {self.settings.report}: {exc}")
        if self.active:
            try:
                reportmod.append_step_summary(self.report)
            except OSError as exc:
                self._warn(f"cannot append to GITHUB_STEP_SUMMARY: {exc}")
        if self.settings.strict and self.warned and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.report is None or (not self.active and not self.settings.enabled):
            return
        terminalreporter.write_sep("-", "megacache")
        for line in reportmod.terminal_lines(self.report, config.get_verbosity()):
            terminalreporter.write_line(line)
        if self.settings.strict and self.warned:
            terminalreporter.write_line(f"megacache strict: {len(self.warned)} cache problem(s) fail this session",
                                        red=True)

    def close(self) -> None:
        if self.adapter is not None:
            self.adapter.uninstall()
