"""pytest hooks. ``pytest_configure`` resolves the settings and the session's :class:`Context`, picks the role
once and registers one small plugin object for it, the way pytest-xdist registers ``DSession`` only on the
controller and a ``WorkerInteractor`` only on a worker:

- :class:`Solo`: a plain session (also ``-n 0``): restores, loads on the first compile, uploads.
- :class:`Controller`: pytest-xdist's controller runs no tests: it restores once and stages the result for its
  workers, takes over what each worker hands back, merges it and uploads once.
- :class:`Worker`: an xdist worker loads what the controller staged and hands what it compiled back.
- :class:`Off`: the plugin is off or inactive; it says why.

Each role object delegates the cache flow to :mod:`pytest_megacache.core` (restore, load, collect, upload) and
:mod:`pytest_megacache.xdist` (stage, hand over, take over); what crosses between processes is plain data
(``workerinput`` / ``workeroutput``). The cache machinery (core, bundle, stores: zstandard, boto3) is imported
only once a session imports torch: a session that never does pays for settings and a fingerprint, nothing more.
"""

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

from . import ci_env, isaprobe
from . import report as reportmod
from .context import Context, Invocation, activate
from .errors import MegacacheWarning, redact, redact_cut
from .report import ProcessTimes, SessionReport, XdistStats, process_age
from .settings import OPTIONS, SettingsError, resolve
from .torch_adapter import PostImportHook, TorchAdapter
from .tritonstats import TritonWatch, figures

if TYPE_CHECKING:
    from .childhook import RestoreSignal, Spool
    from .core import CacheSession
    from .xdist import Takeover

PLUGIN_NAME = "megacache-session"
role_key = pytest.StashKey["Role"]()


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


class Role:
    """What every role does: one channel for problems (said in one warning at the end), the selection digest,
    the report (built in one place, :meth:`build_report`), the header and the summary."""

    role = "solo"
    process = "main"  # this process's name in the per-process times (a worker's row is named by its controller)

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        self.config, self.ctx, self.settings = config, ctx, ctx.settings
        self.started = time.perf_counter()
        self.age_at_start = process_age()
        self._collected: float | None = None  # perf_counter() when collection finished
        self._run_end: tuple[float, float] | None = None  # perf_counter() and the restore waits when tests ended
        self.problems = list(ctx.problems)  # every problem of the session, for the report and strict mode
        self._said = len(self.problems)  # those before this index were warned about already
        self.notes = list(ctx.notes)
        self.session: CacheSession | None = None
        self.selection: str | None = None  # digest of the collected test ids
        self.meta: dict[str, object] = {}
        self.report: SessionReport | None = None
        self.single_thread = False
        self.spool: Spool | None = None  # where the processes this session starts write their counters
        self.restore_signal: RestoreSignal | None = None  # tells those processes when the restore has settled
        if ctx.active:
            from .childhook import disarm

            disarm()  # this process reports itself; only the processes it starts write records

    def pytest_report_header(self, config: pytest.Config) -> str:
        if not self.ctx.active or self.ctx.fingerprint is None:
            return f"megacache: off ({self.ctx.reason})"
        return (f"megacache: {self.settings.store_label()} [{self.settings.mode}] scope {self.ctx.scope} "
                f"{self.ctx.fingerprint.key}")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._collected = time.perf_counter()
        if self.ctx.active and session.items:
            digest = hashlib.sha256("\n".join(sorted(item.nodeid for item in session.items)).encode())
            self.selection = digest.hexdigest()[:32]
            self.meta.update(selection=self.selection, tests=len(session.items))
            if self.session is not None:
                self.session.meta.update(self.meta)

    @contextmanager
    def contained(self, what: str) -> Iterator[None]:
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
                self.problems.append(message)

    def new_session(self, **kwargs: Any) -> CacheSession:
        """The session's flow object, its collaborators passed in; ``kwargs`` are what the role changes."""
        from .core import CacheSession, Diagnosis
        from .stores import from_settings

        ctx, settings = self.ctx, self.settings
        assert ctx.fingerprint is not None
        fp = ctx.fingerprint
        folders = [ctx.folder(ctx.scope), ctx.folder(ctx.default_scope)]
        args: dict[str, Any] = dict(
            store_factory=lambda: from_settings(settings), folder=folders[0], read_folders=folders,
            fingerprint=fp.key, roots=ctx.roots(), reads=settings.reads, writes=settings.writes,
            compact_after=settings.compact_after, signing_keys=ctx.signing_keys,
            meta={"scope": ctx.scope, "fingerprint_parts": fp.parts, **self.meta},
            restore_timeout=settings.timeout, upload_timeout=settings.upload_timeout,
            diagnosis=Diagnosis(settings.prefix, [ctx.scope, ctx.default_scope], fp.key, fp.parts))
        args.update(kwargs)
        return CacheSession(**args)

    def strict_wait(self) -> None:
        """Under --megacache-strict, wait for the restore (within its budget) and stop the session on a problem."""
        if self.settings.strict and self.session is not None:
            self.session.wait_restore()
            if self.session.problems:
                raise pytest.UsageError("pytest-megacache (strict): " + "; ".join(map(redact, self.session.new_problems())))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.tests_ended()
        with self.contained("finishing the session"):
            self.finish()
        with self.contained("writing the report"):
            self.write_report()
        self.warn_once()
        if self.settings.strict and self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def finish(self) -> None:
        """The role's end of session (upload, hand over): a no-op unless the role has one."""

    def _clock(self) -> tuple[float, float]:
        """Now, and the seconds spent waiting for the restore so far."""
        return time.perf_counter(), self.session.wait_seconds if self.session is not None else 0.0

    def tests_ended(self) -> None:
        self._run_end = self._clock()

    def process_times(self) -> ProcessTimes:
        """Where this process's seconds went, from its start to now (see :class:`ProcessTimes`)."""
        now = time.perf_counter()
        collected = self._collected if self._collected is not None else self.started
        run_end, waited = self._run_end or self._clock()
        t = ProcessTimes(process=self.process, startup=self.age_at_start, collect=collected - self.started,
                         finish=now - run_end, restore_wait=waited)
        adapter: TorchAdapter | None = getattr(self, "adapter", None)
        compiled = imported_in_tests = 0.0
        if adapter is not None:
            # torch's and torch._dynamo's imports (the latter inside a test's first torch.compile, typically): their
            # own phase, taken out of the phase they happened in (spans do not nest: torch is done first).
            for start, end in adapter.import_spans:
                t.imports += end - start
                if end <= collected:
                    t.collect -= end - start
                else:
                    imported_in_tests += end - start
            adapter.absorb_metrics()
            t.dynamo, t.backend, t.backward = (round(adapter.split[k], 4) for k in ("dynamo", "backend", "backward"))
            compiled = max(adapter.compile_seconds, t.dynamo + t.backend + t.backward)
            t.compile_other = max(0.0, adapter.compile_seconds - (t.dynamo + t.backend + t.backward))
        # torch's vector-ISA load checks (isaprobe saw them): inside the backend's seconds when a compile ran them
        # (the first CPU graph), else inside a test's; their own phase, taken out of whichever held them.
        t.isa_check = round(isaprobe.check_seconds(), 4)
        in_backend = min(t.isa_check, t.backend)
        t.backend -= in_backend
        isa_elsewhere = t.isa_check - in_backend
        if self.session is not None and self.session.load_stats.called:
            t.load = self.session.load_stats.seconds
        t.tests = max(0.0, run_end - collected - waited - t.load - compiled - imported_in_tests - isa_elsewhere)
        t.total = (t.startup or 0.0) + now - self.started
        return t

    def drain(self) -> None:
        if self.session is not None:
            self.problems.extend(redact(p) for p in self.session.new_problems())

    def warn_once(self) -> None:
        self.drain()
        pending, self._said = self.problems[self._said:], len(self.problems)
        if pending:
            more = f" (and {len(pending) - 1} more: " + "; ".join(pending[1:]) + ")" if len(pending) > 1 else ""
            warnings.warn(MegacacheWarning(pending[0] + more), stacklevel=2)

    def build_report(self) -> SessionReport:
        """The one place the session report is assembled."""
        self.drain()
        ctx, cs = self.ctx, self.session
        settings = self.settings.reportable()  # no signing keys
        settings.update(store=self.settings.store_label(), explicit=sorted(self.settings.explicit),
                        signing=bool(ctx.signing_keys))
        if settings["endpoint_url"]:
            settings["endpoint_url"] = redact(settings["endpoint_url"])
        fp = ctx.fingerprint
        report = SessionReport(
            enabled=ctx.active, reason=ctx.reason, settings=settings, notes=self.notes, problems=list(self.problems),
            fingerprint={"key": fp.key, **fp.parts} if fp is not None else None,
            scope={"write": ctx.scope, "read": [ctx.scope, ctx.default_scope]} if ctx.active else None,
            session_seconds=time.perf_counter() - self.started)
        if cs is not None:
            report.restore, report.load, report.torch, report.upload = (cs.restore_stats, cs.load_stats,
                                                                         cs.torch_stats, cs.upload_stats)
            report.torch.single_compile_thread = self.single_thread
            report.xdist = self.xdist_stats()
        if ctx.active:
            report.processes = [self.process_times(), *self.worker_times()]
        return report

    def worker_times(self) -> list[ProcessTimes]:
        return []

    def xdist_stats(self) -> XdistStats:
        return XdistStats(self.role)

    def write_report(self) -> None:
        self.report = self.build_report()
        if self.settings.report:
            try:
                reportmod.write_json(self.settings.report, self.report)
            except OSError as exc:
                self.problems.append(redact(f"cannot write the report to {self.settings.report}: {exc}"))
        if self.ctx.active:
            try:
                reportmod.append_step_summary(self.report, durations=self.settings.durations)
            except OSError as exc:
                self.problems.append(redact(f"cannot append to GITHUB_STEP_SUMMARY: {exc}"))

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.report is None or (not self.ctx.active and not self.settings.enabled):
            return
        terminalreporter.write_sep("-", "megacache")
        for line in reportmod.terminal_lines(self.report, config.get_verbosity(), durations=self.settings.durations):
            terminalreporter.write_line(line)
        if self.settings.strict and self.problems:
            terminalreporter.write_line(f"megacache strict: {len(self.problems)} cache problem(s) fail this session",
                                        red=True)

    def close(self) -> None:
        """Undo what the role installed in this process (torch hooks)."""

    def open_spool(self) -> None:
        """For the role that reports (a plain session, an xdist controller): child processes of the tests, and
        of xdist workers, write their own torch counters here (``childhook``; the variable is inherited)."""
        from .childhook import Spool

        with self.contained("preparing the spool for child processes"):
            self.spool = Spool()

    def read_children(self) -> None:
        """The child processes' records, validated, into the report: per child, like xdist workers."""
        if self.spool is None:
            return
        records, rejects = self.spool.read()
        if rejects:
            self.problems.append(redact(f"{len(rejects)} child-process record(s) refused: " + "; ".join(rejects[:3])))
        compiled = [r for r in records if r.compiled]
        if self.session is None:
            if compiled:
                self.notes.append(f"{len(compiled)} child process(es) compiled without asking for this session's cache "
                                  "(it starts when a process imports torch through the usual import), so nothing was "
                                  "restored or stored for them")
            return
        self.session.torch_stats.children = [r.row() for r in compiled]

    def release(self) -> None:
        """At unconfigure (also after an interrupt): what outlives the session's end (the spool, the restore's
        signal to child processes, their variables going back as they were, and the session's scratch files)."""
        if self.restore_signal is not None:
            self.restore_signal.close()
        if self.spool is not None:
            self.spool.close()
        if self.session is not None:
            self.session.close()  # its scratch files


class Off(Role):
    """The plugin is off (no store, ``--megacache-mode off``) or inactive (no usable torch, a bad signing key):
    the header and the summary say why, the report records it."""


class Compiling(Role):
    """What the roles that run tests share (a plain session, an xdist worker): torch's compile callbacks, the
    restore started when torch is imported, the load on the first compile, per-test accounting."""

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        super().__init__(config, ctx)
        self.adapter = TorchAdapter(self._on_first_compile)
        self._torch_hook: PostImportHook | None = None
        self._isa_hook: PostImportHook | None = None
        self._start_lock = threading.Lock()
        self.triton = TritonWatch()  # Triton's kernels loaded from its cache vs compiled, once Triton is imported
        self.triton.install()

    def make_session(self) -> CacheSession:
        return self.new_session()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # The restore starts in the background when this process imports torch, or when a child process of the
        # tests (torchrun, mp.spawn, subprocess) imports torch, whichever comes first: that child waits until the
        # restore has written its files and the cache directories are snapshotted (childhook), so that it hits what
        # was restored and what it compiles is carried. A session in which nothing imports torch pays nothing.
        # Strict runs restore up front (and wait for it, within its budget) so a problem stops the session before
        # any test runs.
        self.signal_children()
        if self.settings.strict or "torch" in sys.modules:
            self.start_cache()
        else:
            self._torch_hook = PostImportHook("torch", lambda _module: self.start_cache(), self.adapter.import_spans)
            sys.meta_path.insert(0, self._torch_hook)
        self.adapter.install()
        isaprobe.reset_counts()  # this session's checks only (an earlier one may have run in this process: pytester)
        if self.settings.reuse_isa_check:
            with self.contained("arming the vector-ISA check's reuse"):
                self._isa_hook = isaprobe.arm(self._isa_not_armed)
        self.strict_wait()
        if self.settings.precompile:
            # torch looks a precompile entry up when torch.compile() wraps a function (at import, for a decorator),
            # before any compile starts: with --megacache-precompile the restore is loaded before collection.
            self._on_first_compile()

    def _isa_not_armed(self, why: str) -> None:
        self.notes.append(why)  # a whole sentence: what happens instead (isaprobe.install)

    def start_cache(self) -> None:
        with self.contained("starting the restore"), self._start_lock:
            if self.session is None:
                self.session = self.make_session()
                if self.restore_signal is not None:
                    self.session.on_settled = self.restore_signal.set
                self.session.start_restore()

    def signal_children(self) -> None:
        """Child processes started from now on ask for the restore when they import torch and wait until it has
        settled (childhook.RestoreSignal, in the spool: this session's own, or an xdist worker's controller's)."""
        from .childhook import SPOOL_ENV, RestoreSignal

        spool = self.spool.path if self.spool is not None else os.environ.get(SPOOL_ENV)
        if not (self.settings.files and self.settings.reads and spool and os.path.isdir(spool)):
            return
        with self.contained("preparing the restore's signal to child processes"):
            # A child waits at most the restore's budget and a margin (the restore's own grace is 1 s).
            self.restore_signal = RestoreSignal(spool, self.settings.timeout + 2.0, self.start_cache)

    def _on_first_compile(self) -> None:
        """Called by torch's compile-start callback: nothing may escape into the compile (or the test)."""
        self.start_cache()
        if self.session is None:
            return
        with self.contained("loading the restored artifacts into torch"):
            self.session.load_into_torch()
            if self.settings.compile_threads == "auto" and self.session.expects_full_coverage(self.selection):
                self.single_thread = self.adapter.single_compile_thread()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        with self.contained("preparing a test"):
            if self.session is not None and self.session.roots and "torch" in sys.modules:
                # Compiles outside our callbacks need the restored files in place: user @triton.jit kernels (at
                # first launch) in a process that has imported torch. Paid once: later waits return at once.
                # (Child processes wait by themselves when they import torch: childhook.)
                self.session.wait_restore()
            self.adapter.ensure_registered()
            self.adapter.begin_test(item.nodeid)
        try:
            return (yield)
        finally:
            with self.contained("accounting a test"):
                self.adapter.end_test()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        # A fixture's torch._dynamo.reset() used to drop our callbacks: make sure they are there.
        with self.contained("registering torch's compile callbacks"):
            self.adapter.ensure_registered()

    def close(self) -> None:
        if self._torch_hook is not None:
            self._torch_hook.remove()
        if self.restore_signal is not None:
            # The tests are over: a child still to come starts no restore and waits for none.
            self.restore_signal.set()
        isaprobe.disarm(self._isa_hook)
        self._isa_hook = None
        self.adapter.uninstall()
        self.triton.uninstall()

    def account_triton(self, cs: CacheSession) -> None:
        """This process's Triton figures into the session's torch figures (after ``cs.account``)."""
        with self.contained("counting Triton's kernels"):
            cs.torch_stats.triton = figures(self.triton, cs)


class Solo(Compiling):
    """A plain session: restore, load, upload what is new."""

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        super().__init__(config, ctx)
        self.open_spool()

    def finish(self) -> None:
        self.close()
        cs = self.session
        if cs is not None:
            cs.finish(self.adapter)
            self.account_triton(cs)
            cs.check_unused(self.selection)
            cs.check_unstorable(self.settings.eager_backward)
            cs.wait_diagnosis()
            self.notes.extend(cs.notes)
        self.read_children()


class Worker(Compiling):
    """An xdist worker: compiles into its own cache directories, loads what its controller staged, and hands
    what it compiled (and the controller lacks) back through ``workeroutput``. It writes no report and says no
    warning: its problems travel to the controller, which says them once."""

    role = "worker"

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        super().__init__(config, ctx)
        from . import xdist
        from .files import inductor_cache_dir, triton_cache_dir

        self.workerinput: dict[str, Any] = getattr(config, "workerinput", {})
        self.worker_id = str(self.workerinput.get("workerid", ""))
        # Its own directories unless the user chose them (directories shared between processes can race).
        for var, base in (("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir()), ("TRITON_CACHE_DIR", triton_cache_dir())):
            if not os.environ.get(var):
                os.environ[var] = xdist.worker_dir(str(base), self.worker_id)
        self.staged_at: Path | None = None  # the controller's staging directory, when this worker shares its disk

    def make_session(self) -> CacheSession:
        from . import xdist

        if xdist.same_host(self.workerinput):
            self.staged_at = Path(self.workerinput[xdist.KEY]["stage"])
            stage = self.staged_at
        else:
            stage = xdist.unpack_remote_stage((self.workerinput.get(xdist.KEY) or {}).get("blob"))
        session = self.new_session(store_factory=lambda: xdist.StagedStore(stage, self.settings.timeout),
                                   folder=xdist.STAGE_FOLDER, read_folders=[xdist.STAGE_FOLDER], signing_keys=(),
                                   writes=False, diagnosis=None)
        session.restore_stats.source = "controller"
        return session

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from . import xdist

        self.tests_ended()
        self.close()
        output: dict[str, Any] = {"idle": True, "problems": []}  # never imported torch
        cs = self.session
        if cs is not None:
            output = {}
            with self.contained("handing over to the xdist controller"):
                cs.wait_restore()
                ts = cs.account(self.adapter)
                ts.single_compile_thread = self.single_thread
                self.account_triton(cs)
                if self.settings.writes:
                    # What this worker compiled, and what its child processes did (in its cache directories), even
                    # when this worker compiled nothing itself (collect counts those in ts.other_processes). A
                    # profile (pgo) this worker grew counts as new too: the controller merges the workers' copies.
                    new = cs.scrubbed(cs.collect(self.adapter)).minus(cs.restored)
                    output.update(xdist.hand_over(self.staged_at, self.worker_id, new, cs.fingerprint))
                output.update({"torch": {k: v for k, v in asdict(ts).items() if k != "layers"},
                               "selection": self.selection, "restore": asdict(cs.restore_stats),
                               "load": asdict(cs.load_stats)})
            output["problems"] = [redact(p) for p in cs.new_problems()]
        # Notes (the vector-ISA check's, say) are said once by the controller, not once per worker.
        output["notes"] = [redact(n) for n in dict.fromkeys(self.notes + (cs.notes if cs is not None else []))]
        with self.contained("timing the worker"):
            output["times"] = asdict(self.process_times())
        workeroutput: dict[str, Any] = getattr(self.config, "workeroutput", {})
        workeroutput[xdist.KEY] = output


class Controller(Role):
    """pytest-xdist's controller runs no tests: it restores once, stages the result for its workers, takes
    over what each hands back, merges it and uploads once."""

    role = "controller"
    process = "controller"

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        super().__init__(config, ctx)
        self.takeover: Takeover | None = None
        self.stage_dir: Path | None = None
        self.open_spool()  # before the workers start: they and their children inherit the variable

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from . import xdist

        assert self.ctx.fingerprint is not None
        self.takeover = xdist.Takeover(self.ctx.fingerprint.key, self._scratch)
        with self.contained("starting the restore"):
            self.stage_dir = xdist.make_stage_dir()
            # No roots: workers restore files into their own directories.
            self.session = self.new_session(roots=[], stage_dir=self.stage_dir)
            self.session.start_restore()
        self.strict_wait()

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Tell each worker where the staged restore is (or send it, to a worker on another host)."""
        from . import xdist

        if self.session is None or self.stage_dir is None:
            return
        info: dict[str, Any] = {"stage": str(self.stage_dir), "host": socket.gethostname()}
        with self.contained("staging the cache for a remote xdist worker"):
            if not getattr(getattr(node.gateway, "spec", None), "popen", False):
                # A remote worker cannot read our disk: wait for the restore and send the staged object.
                self.session.wait_restore()
                staged = sorted((self.stage_dir / xdist.STAGE_FOLDER).glob("*.mcb"))
                info["blob"] = staged[0].read_bytes() if staged else None
        node.workerinput[xdist.KEY] = info

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """Take over what a worker compiled."""
        from . import xdist

        if self.session is None or self.takeover is None:
            return
        with self.contained("taking over from an xdist worker"):
            worker = str(getattr(node, "gateway", None) and node.gateway.id)
            self.takeover.take(worker, getattr(node, "workeroutput", {}).get(xdist.KEY), error)
            if self.selection is None and self.takeover.selection:
                self.selection = self.takeover.selection
                self.session.meta.update(selection=self.selection)

    def finish(self) -> None:
        cs, takeover = self.session, self.takeover
        if cs is None or takeover is None:
            return
        for problem in takeover.problems:
            cs.problem(problem)
        self.notes.extend(note for note in takeover.notes if note not in self.notes)
        cs.finish(None, workers=takeover.torch, worker_entries=takeover.entries, worker_profiles=takeover.profiles)
        takeover.fold(cs.restore_stats, cs.load_stats)  # the workers' restores of files and loads: the session's
        self.single_thread = takeover.single_thread
        cs.check_unused(self.selection)
        cs.check_unstorable(self.settings.eager_backward)
        cs.wait_diagnosis()
        self.notes.extend(cs.notes)
        self.read_children()

    def _scratch(self) -> str:
        assert self.session is not None
        return self.session.scratch.path()

    def release(self) -> None:
        """Also removes the staging directory (the restored object, the workers' hand-overs), whatever happened to
        the session or its workers."""
        super().release()
        if self.stage_dir is not None:
            import shutil

            shutil.rmtree(self.stage_dir, ignore_errors=True)
            self.stage_dir = None

    def worker_times(self) -> list[ProcessTimes]:
        return list(self.takeover.times) if self.takeover is not None else []

    def xdist_stats(self) -> XdistStats:
        takeover = self.takeover
        return takeover.stats(self.role) if takeover else XdistStats(self.role)
