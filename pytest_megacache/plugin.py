"""pytest hooks. ``pytest_configure`` only resolves settings and registers :class:`MegacachePlugin`;
the cache flow itself lives in :mod:`pytest_megacache.core`."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from . import ci_env
from . import report as reportmod
from .errors import MegacacheWarning, redact, redact_cut
from .fingerprint import Fingerprint, TorchUnavailable, compute
from .settings import OPTIONS, Settings, SettingsError, resolve
from .torch_adapter import PostImportHook, TorchAdapter, disable_precompiled_headers

if TYPE_CHECKING:
    from .bundle import Entries, Entry
    from .core import CacheSession, Diagnosis
    from .files import FileRoot

# The cache machinery (core, bundle, stores, xdist: zstandard, boto3, thread pools) is imported only once
# a session imports torch: a session that never does pays for settings and a fingerprint, nothing more.

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
    notes: list[str] = []
    if "mode" not in settings.explicit and settings.mode == "readwrite":
        fork = ci_env.is_fork_pull_request(os.environ)
        if fork.fork:
            settings = replace(settings, mode="read")
            notes.append(f"read-only: {fork.reason} (set --megacache-mode to override)")
    plugin = MegacachePlugin(config, settings, notes)
    config.stash[megacache_key] = plugin
    config.pluginmanager.register(plugin, PLUGIN_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.stash.get(megacache_key, None)
    if plugin is not None:
        plugin.close()
        del config.stash[megacache_key]
        config.pluginmanager.unregister(plugin)


class MegacachePlugin:
    def __init__(self, config: pytest.Config, settings: Settings, notes: list[str] | None = None) -> None:
        self.config = config
        self.settings = settings
        self.notes = list(notes or [])  # said once in the summary, not warnings
        self.started = time.perf_counter()
        self.fingerprint: Fingerprint | None = None
        self.reason: str | None = None
        self.session: CacheSession | None = None
        self.adapter: TorchAdapter | None = None
        self.report: dict[str, Any] | None = None
        self.warned: list[str] = []
        self._warned_upto = 0  # warned holds every problem; those before this index were said already
        self.signing_keys: list[bytes] = []
        self.scope = self.default_scope = "main"
        self.role = "worker" if hasattr(config, "workerinput") else "solo"  # "controller" decided at start
        self.worker_id = str(getattr(config, "workerinput", {}).get("workerid", ""))
        self.stage_dir: Path | None = None
        self.selection: str | None = None
        self.worker_outputs: list[dict[str, Any]] = []
        self.worker_entries: Entries | None = None
        self.worker_profiles: dict[tuple[str, str], list[Entry]] = {}
        self.lost_workers: list[str] = []
        self.single_thread = False
        self._meta: dict[str, object] = {}
        self._start_lock = threading.Lock()
        self._torch_hook: PostImportHook | None = None
        if settings.mode == "off":
            self.reason = "mode off"
        elif not settings.enabled:
            self.reason = "no store configured; set --megacache-bucket or --megacache-dir"
        else:
            self._activate()

    def _activate(self) -> None:
        config, settings = self.config, self.settings
        from .keys import parse_signing_keys

        try:
            self.signing_keys = parse_signing_keys(os.environ.get("MEGACACHE_SIGNING_KEY"))
        except ValueError as exc:
            self._inactive(f"MEGACACHE_SIGNING_KEY is unusable: {exc}")
            return
        if settings.require_signature and not self.signing_keys:
            self._inactive("signatures are required (--megacache-require-signature) but MEGACACHE_SIGNING_KEY is "
                           "empty or unset, so nothing is restored or uploaded")
            return
        # Before the fingerprint, which covers TORCHINDUCTOR_* settings: xdist workers inherit the variable.
        disable_precompiled_headers()
        try:
            self.fingerprint = compute()
        except TorchUnavailable as exc:
            self._inactive(str(exc))
            return
        self._check_rootdir()
        root = str(config.rootpath)
        scope, _source = ci_env.current_scope(os.environ, root)
        self.default_scope = settings.default_scope or ci_env.default_scope(os.environ, root)
        self.scope = settings.scope or scope or self.default_scope
        if not self.signing_keys and settings.reads:
            self.notes.append("restored bundles are trusted as-is: set MEGACACHE_SIGNING_KEY to sign and verify them")
        if self.role == "worker":
            self._worker_dirs()
        if settings.precompile:
            why_not = TorchAdapter.enable_precompile()
            if why_not:
                self._config_warning(f"--megacache-precompile ignored: {why_not}")

    def _check_rootdir(self) -> None:
        """``pytest --megacache-dir /outside/the/project`` (a space, no test paths): pytest picks its rootdir
        before plugins' options are known, takes the value for a test path, and misses the project's ini."""
        cli_dir = self.config.getoption("megacache_directory", None)
        if not cli_dir:
            return
        store, root = Path(cli_dir).absolute(), self.config.rootpath
        invoked = self.config.invocation_params.dir
        if self.config.inipath is None and store.is_relative_to(root) and not store.is_relative_to(invoked):
            message = (f"pytest took the --megacache-dir value for a test path (rootdir {root}), so the project's "
                       f"ini file was not read; write --megacache-dir={cli_dir} or set MEGACACHE_DIR")
            self._config_warning(message)

    def _inactive(self, reason: str) -> None:
        self.reason = reason
        if self.settings.strict:
            raise pytest.UsageError(f"pytest-megacache (strict): {reason}")
        self._config_warning(f"pytest-megacache is inactive: {reason}")

    def _config_warning(self, message: str) -> None:
        self._problem(message)
        self._warned_upto = len(self.warned)
        self.config.issue_config_time_warning(MegacacheWarning(message), stacklevel=3)

    def _worker_dirs(self) -> None:
        """Each xdist worker compiles into its own directories unless the user chose them (then they are
        shared, and Inductor/Triton directories shared between processes can race: see the README)."""
        from . import xdist
        from .files import inductor_cache_dir, triton_cache_dir

        for var, base in (("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir()), ("TRITON_CACHE_DIR", triton_cache_dir())):
            if not os.environ.get(var):
                os.environ[var] = xdist.worker_dir(str(base), self.worker_id)

    @property
    def active(self) -> bool:
        return self.reason is None

    def _problem(self, message: str) -> None:
        """A problem of this session: all of them are said in one warning at its end (:meth:`_warn_once`)."""
        self.warned.append(redact(message))

    def _warn_once(self) -> None:
        pending = self.warned[self._warned_upto:]
        self._warned_upto = len(self.warned)
        if pending:
            more = f" (and {len(pending) - 1} more: " + "; ".join(pending[1:]) + ")" if len(pending) > 1 else ""
            warnings.warn(MegacacheWarning(pending[0] + more), stacklevel=2)

    @contextmanager
    def _contained(self, what: str) -> Iterator[None]:
        """The boundary: no exception of any type from the cache machinery, a store, a bundle, torch's cache
        API or the environment reaches pytest (or the test that triggered a compile); it becomes a problem."""
        try:
            yield
        except pytest.UsageError:
            raise
        except Exception as exc:  # noqa: BLE001
            message = f"{what} failed unexpectedly: {type(exc).__name__}: {redact_cut(str(exc))}"
            if self.session is not None:
                self.session.problem(message)
            else:
                self._problem(message)

    def _folder(self, scope: str) -> str:
        assert self.fingerprint is not None
        return f"{self.settings.prefix}/{scope}/{self.fingerprint.key}"

    def _roots(self) -> list[FileRoot]:
        from .files import FileRoot, inductor_cache_dir, triton_cache_dir, triton_installed

        if not self.settings.files:
            return []
        roots = [FileRoot("inductor", inductor_cache_dir())]
        if triton_installed():
            roots.append(FileRoot("triton", triton_cache_dir()))
        return roots

    # --- hooks ------------------------------------------------------------------------------------
    def pytest_report_header(self, config: pytest.Config) -> str:
        if not self.active or self.fingerprint is None:
            return f"megacache: off ({self.reason})"
        return (f"megacache: {self.settings.store_label()} [{self.settings.mode}] scope {self.scope} "
                f"{self.fingerprint.key}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if not self.active or self.fingerprint is None:
            return
        if self.role == "solo" and self.config.pluginmanager.getplugin("dsession") is not None:
            self.role = "controller"
        self.adapter = TorchAdapter(self._on_first_compile)
        # Strict runs restore up front (and wait for it, within its budget) so a problem stops the session
        # before any test runs; an xdist controller stages for its workers at once. Otherwise the restore
        # starts, in the background, when the session imports torch (or, failing that, on the first compile).
        if self.settings.strict or self.role == "controller" or "torch" in sys.modules:
            self._start_cache()
        else:
            self._torch_hook = PostImportHook("torch", lambda _module: self._start_cache())
            sys.meta_path.insert(0, self._torch_hook)
        self.adapter.install()
        if self.settings.strict and self.session is not None:
            self.session.wait_restore()
            if self.session.problems:
                raise pytest.UsageError("pytest-megacache (strict): " + "; ".join(map(redact, self.session.new_problems())))

    def _start_cache(self) -> None:
        with self._contained("starting the restore"), self._start_lock:
            if self.session is not None or self.fingerprint is None:
                return
            self._build_session(self.fingerprint)
            assert self.session is not None
            self.session.start_restore()

    def _build_session(self, fingerprint: Fingerprint) -> None:
        from . import xdist
        from .core import CacheSession, Diagnosis
        from .stores import from_settings

        settings = self.settings
        store_factory = lambda: from_settings(settings)  # noqa: E731
        folders = [self._folder(self.scope), self._folder(self.default_scope)]
        roots = self._roots()
        diagnosis: Diagnosis | None = Diagnosis(settings.prefix, [self.scope, self.default_scope], fingerprint.key,
                                                fingerprint.parts)
        if self.role == "worker":
            stage = self._worker_stage()
            store_factory = lambda: xdist.StagedStore(stage, settings.timeout)  # noqa: E731
            folders = [xdist.STAGE_FOLDER]
            diagnosis = None
        elif self.role == "controller":
            roots = []  # the controller runs no tests; workers restore files into their own directories
            self.stage_dir = xdist.make_stage_dir()
        self.session = CacheSession(
            store_factory=store_factory,
            folder=folders[0],
            read_folders=folders,
            fingerprint=fingerprint.key,
            roots=roots,
            reads=settings.reads,
            writes=settings.writes and self.role != "worker",
            compact_after=settings.compact_after,
            signing_keys=self.signing_keys if self.role != "worker" else (),
            meta={"scope": self.scope, "fingerprint_parts": fingerprint.parts, **self._meta},
            restore_timeout=settings.timeout,
            upload_timeout=settings.upload_timeout,
            diagnosis=diagnosis,
        )
        if self.role == "worker":
            self.session.restore_stats.source = "controller"
        if self.role == "controller":
            self.session.after_restore = self._stage

    def _stage(self, session: CacheSession) -> None:
        from . import xdist

        if self.stage_dir is not None:
            xdist.stage(self.stage_dir, session.restored, session.fingerprint, session.restore_stats.ok)

    def _worker_stage(self) -> Path:
        from . import xdist

        workerinput: dict[str, Any] = getattr(self.config, "workerinput", {})
        if xdist.same_host(workerinput):
            self.stage_dir = Path(workerinput[xdist.KEY]["stage"])
            return self.stage_dir
        info = workerinput.get(xdist.KEY) or {}
        return xdist.unpack_remote_stage(info.get("blob"))

    def _on_first_compile(self) -> None:
        """Called by torch's compile-start callback: nothing may escape into the compile (or the test)."""
        self._start_cache()
        session, adapter = self.session, self.adapter
        if session is None or adapter is None:
            return
        with self._contained("loading the restored artifacts into torch"):
            session.load_into_torch()
            if self.settings.compile_threads == "auto" and session.expects_full_coverage(self.selection):
                self.single_thread = adapter.single_compile_thread()

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist controller: tell each worker where the staged restore is (or send it, for remote ones)."""
        from . import xdist

        if self.session is None or self.stage_dir is None:
            return
        info: dict[str, Any] = {"stage": str(self.stage_dir), "host": socket.gethostname()}
        with self._contained("staging the cache for a remote xdist worker"):
            if not getattr(getattr(node.gateway, "spec", None), "popen", False):
                # A remote worker cannot read our disk: wait for the restore and send the staged object.
                self.session.wait_restore()
                staged = sorted((self.stage_dir / xdist.STAGE_FOLDER).glob("*.mcb"))
                info["blob"] = staged[0].read_bytes() if staged else None
        node.workerinput[xdist.KEY] = info

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist controller: take over what a worker compiled."""
        from . import xdist
        from .bundle import MUTABLE_KINDS, Entries

        if self.session is None or self.fingerprint is None:
            return
        if self.worker_entries is None:
            self.worker_entries = Entries()
        worker = str(getattr(node, "gateway", None) and node.gateway.id)
        output = getattr(node, "workeroutput", {}).get(xdist.KEY)
        if output is None:
            self.lost_workers.append(worker)
            self.session.problem(f"xdist worker {worker} ended without handing over its cache work "
                                 f"({error or 'no output'}); only its new artifacts are lost")
            return
        try:
            for entry in xdist.take_over(output, self.fingerprint.key):
                if entry.kind in MUTABLE_KINDS:  # every worker's copy of a profile: merged at the end
                    self.worker_profiles.setdefault(entry.ident, []).append(entry)
                else:
                    self.worker_entries.add(entry)
        except Exception as exc:  # noqa: BLE001 - OSError, BundleError or whatever a broken hand-over provokes
            self.session.problem(f"xdist worker {worker}'s artifacts were refused: {type(exc).__name__}: "
                                 f"{redact_cut(str(exc))}")
        self.worker_outputs.append(output)
        for problem in output.get("problems", []):
            self.session.problem(f"[{worker}] {problem}")
        if self.selection is None and output.get("selection"):
            # Every worker collects the whole selection: the first one's digest is the session's.
            self.selection = str(output["selection"])
            self.session.meta.update(selection=self.selection)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.active and session.items:
            digest = hashlib.sha256("\n".join(sorted(item.nodeid for item in session.items)).encode())
            self.selection = digest.hexdigest()[:32]
            self._meta.update(selection=self.selection, tests=len(session.items))
            if self.session is not None:
                self.session.meta.update(self._meta)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        adapter = self.adapter
        if adapter is None:
            return (yield)
        with self._contained("preparing a test"):
            if self.session is not None and any(r.name == "triton" for r in self.session.roots):
                # User @triton.jit kernels compile at first launch, outside our compile callbacks: have their
                # cache entries in place before the first test runs (paid once: later waits return at once).
                self.session.wait_restore()
            adapter.ensure_registered()
            adapter.begin_test(item.nodeid)
        try:
            return (yield)
        finally:
            with self._contained("accounting a test"):
                adapter.end_test()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        # torch._dynamo.reset() (common in fixtures) drops compile callbacks: put ours back.
        if self.adapter is not None:
            with self._contained("registering torch's compile callbacks"):
                self.adapter.ensure_registered()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stats = None
        with self._contained("finishing the session"):
            stats = self._finish()
        if self.role == "worker":
            return
        with self._contained("writing the report"):
            self._write_report(stats)
        if self.session is not None:
            for problem in self.session.new_problems():
                self._problem(problem)
        self._warn_once()
        if self.settings.strict and self.warned and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _finish(self) -> dict[str, Any] | None:
        """Upload (or hand over, on a worker) and account; the session's stats, or None if it never started."""
        if self._torch_hook is not None:
            self._torch_hook.remove()
        if self.adapter is not None:
            self.adapter.uninstall()
        if self.session is None and self.active and self.role == "worker":
            workeroutput: dict[str, Any] = getattr(self.config, "workeroutput", {})
            workeroutput["megacache"] = {"idle": True, "problems": []}  # never imported torch
        if self.session is None or self.adapter is None:
            return None
        if self.role == "worker":
            self._finish_worker()
            return None
        cs = self.session
        cs.finish(self.adapter if self.role == "solo" else None,
                  workers=[o.get("torch", {}) for o in self.worker_outputs],
                  worker_entries=self.worker_entries if self.role == "controller" else None,
                  worker_profiles=self.worker_profiles)
        cs.check_unused(self.selection)
        cs.wait_diagnosis()
        self.notes.extend(cs.notes)
        stats = cs.stats()
        stats["torch"]["single_compile_thread"] = self.single_thread
        stats["xdist"] = {"role": self.role, "workers": len(self.worker_outputs), "lost": self.lost_workers}
        return stats

    def _write_report(self, stats: dict[str, Any] | None) -> None:
        if self.session is not None:  # the report lists every problem, these included
            for problem in self.session.new_problems():
                self._problem(problem)
        settings = asdict(self.settings)
        settings["store"] = self.settings.store_label()
        if settings["endpoint_url"]:
            settings["endpoint_url"] = redact(settings["endpoint_url"])
        settings["explicit"] = sorted(self.settings.explicit)
        settings["signing"] = bool(self.signing_keys)
        self.report = reportmod.build(
            enabled=self.active,
            reason=self.reason,
            settings=settings,
            fingerprint={"key": self.fingerprint.key, **self.fingerprint.parts} if self.fingerprint else None,
            stats=stats,
            problems=list(self.warned),
            session_seconds=time.perf_counter() - self.started,
            scope={"write": self.scope, "read": [self.scope, self.default_scope]} if self.active else None,
            notes=self.notes,
        )
        if self.settings.report:
            try:
                reportmod.write_json(self.settings.report, self.report)
            except OSError as exc:
                self._problem(f"cannot write the report to {self.settings.report}: {exc}")
        if self.active:
            try:
                reportmod.append_step_summary(self.report, durations=self.settings.durations)
            except OSError as exc:
                self._problem(f"cannot append to GITHUB_STEP_SUMMARY: {exc}")

    def _finish_worker(self) -> None:
        """Account, then hand what this worker compiled (and the controller lacks) to the controller."""
        from . import xdist

        assert self.session is not None and self.adapter is not None and self.fingerprint is not None
        cs = self.session
        output: dict[str, Any] = {}
        with self._contained("handing over to the xdist controller"):
            cs.wait_restore()
            ts = cs.account(self.adapter)
            output.update({"torch": {k: v for k, v in asdict(ts).items() if k != "layers"},
                           "selection": self.selection, "restore": asdict(cs.restore_stats)})
            if ts.compiled and self.settings.writes:
                # A profile (pgo) this worker grew counts as new too: the controller merges the workers' copies.
                new = cs.collect(self.adapter).minus(cs.restored)
                output.update(xdist.hand_over(self.stage_dir, self.worker_id, new, self.fingerprint.key))
        output["problems"] = [redact(p) for p in cs.new_problems()]
        workeroutput: dict[str, Any] = getattr(self.config, "workeroutput", {})
        workeroutput[xdist.KEY] = output

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.report is None or (not self.active and not self.settings.enabled):
            return
        terminalreporter.write_sep("-", "megacache")
        for line in reportmod.terminal_lines(self.report, config.get_verbosity(), durations=self.settings.durations):
            terminalreporter.write_line(line)
        if self.settings.strict and self.warned:
            terminalreporter.write_line(f"megacache strict: {len(self.warned)} cache problem(s) fail this session",
                                        red=True)

    def close(self) -> None:
        if self._torch_hook is not None:
            self._torch_hook.remove()
        if self.adapter is not None:
            self.adapter.uninstall()

