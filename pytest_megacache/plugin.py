"""pytest hooks. ``pytest_configure`` resolves the settings and the session's :class:`Context`, picks the role
once and registers one small plugin object for it, the way pytest-xdist registers ``DSession`` only on the
controller and a ``WorkerInteractor`` only on a worker:

- :class:`Solo`: a plain session (also ``-n 0``): restores, loads on the first compile, uploads.
- :class:`Controller`: pytest-xdist's controller runs no tests: it restores once and stages the result for its
  workers, takes over what each worker hands back, merges it and uploads once.
- :class:`Worker`: an xdist worker loads what the controller staged and hands what it compiled back.
- :class:`Off`: the plugin is off or inactive; it says why.

The role objects live in :mod:`pytest_megacache.roles` (their base, ``Off``), :mod:`pytest_megacache.compiling`
(``Solo``) and :mod:`pytest_megacache.xdist` (``Controller``, ``Worker``). Each delegates the cache flow to
:mod:`pytest_megacache.core` (restore, load, collect, upload) and :mod:`pytest_megacache.xdist.staging` (stage, hand over,
take over); what crosses between processes is plain data (``workerinput`` / ``workeroutput``). The cache machinery
(core, bundle, stores: zstandard, boto3) is imported only once a session imports torch: a session that never does
pays for settings and a fingerprint, nothing more.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from . import ci_env
from .compiling import Solo
from .context import Invocation, activate
from .errors import MegacacheWarning
from .roles import Off, Role
from .settings import OPTIONS, SettingsError, resolve
from .xdist import Controller, Worker

PLUGIN_NAME = "megacache-session"
role_key = pytest.StashKey[Role]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("megacache", "torch.compile cache (pytest-megacache)")
    for opt in OPTIONS:
        dest = f"megacache_{opt.name}"
        if opt.kind == "bool" and opt.negation:
            group.addoption(opt.flag, action="store_const", const=True, dest=dest, default=None,
                            help=f"{opt.help} [{opt.env}]")
            group.addoption(opt.negation, action="store_const", const=False, dest=dest, default=None,
                            help=f"The opposite of {opt.flag}.")
        elif opt.kind == "bool" and not opt.default:
            group.addoption(opt.flag, action="store_true", dest=dest, default=None, help=f"{opt.help} [{opt.env}]")
        else:
            group.addoption(opt.flag, action="store", dest=dest, default=None, metavar=opt.name.upper(),
                            help=f"{opt.help} [{opt.env}]")
        parser.addini(opt.ini, help=opt.help, default=None)


def pytest_configure(config: pytest.Config) -> None:
    try:
        settings = resolve(cli=lambda name: config.getoption(f"megacache_{name}"), env=os.environ,
                           ini=lambda name: config.getini(name))
    except SettingsError as exc:
        raise pytest.UsageError(f"pytest-megacache: {exc}") from None
    notes: list[str] = []
    if "mode" not in settings.explicit and settings.mode == "readwrite":
        fork = ci_env.is_fork_pull_request(os.environ)
        if fork.fork:
            settings = replace(settings, mode="read")
            notes.append(f"read-only: {fork.reason} (set --megacache-mode to override)")
    invocation = Invocation(config.rootpath, config.invocation_params.dir, config.inipath,
                            config.getoption("megacache_directory", None))
    if "children" in settings.explicit:
        notes.append("--megacache-children (MEGACACHE_CHILDREN) is no longer needed: child processes are carried by "
                     "default")
    ctx = activate(settings, invocation, notes=notes)
    if ctx.inactive and settings.strict:
        raise pytest.UsageError(f"pytest-megacache (strict): {ctx.reason}")
    for warning in map(MegacacheWarning, ctx.problems):
        config.issue_config_time_warning(warning, stacklevel=2)
    worker = hasattr(config, "workerinput")
    if not ctx.active and worker:
        return  # an inactive worker hands nothing over; its controller is inactive too and says why
    role = Off(config, ctx) if not ctx.active else Worker(config, ctx) if worker else \
        Controller(config, ctx) if _xdist_controller(config) else Solo(config, ctx)
    config.stash[role_key] = role
    config.pluginmanager.register(role, PLUGIN_NAME)


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether pytest-xdist will register its DSession (its own test: a dist mode other than "no", which
    ``-n 0`` gives, and not --collect-only)."""
    return bool(config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") != "no"
                and not config.getoption("collectonly", False))


def pytest_unconfigure(config: pytest.Config) -> None:
    role = config.stash.get(role_key, None)
    if role is not None:
        role.close()
        role.release()
        del config.stash[role_key]
        config.pluginmanager.unregister(role)

