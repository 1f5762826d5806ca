"""What every role object shares (:class:`Role`), and :class:`Off`. ``plugin.pytest_configure`` registers one role
object per session; each role is a pytest plugin whose methods are the session's hooks:

- :class:`Role`: one channel for problems (said in one warning at the end), the selection digest, the report (built
  in one place), the header and the summary, and the spool that child processes report into.
- :class:`Off`: the plugin is off or inactive; it says why.

The roles that run tests are in :mod:`pytest_megacache.compiling`, pytest-xdist's in
:mod:`pytest_megacache.xdist`. The cache machinery (core, stores, children.hook) is imported only inside the
methods that use it, once a session imports torch.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

from . import dynamo, isaprobe
from . import report as reportmod
from .context import Context
from .errors import MegacacheWarning, redact, redact_cut
from .report import ProcessTimes, SessionReport, XdistStats, process_age
from .torch_adapter import TorchAdapter

if TYPE_CHECKING:
    from .children import RestoreSignal, Spool
    from .core import CacheSession


class Role:
    """What every role does: one channel for problems (said in one warning at the end), the selection digest,
    the report (built in one place, :meth:`build_report`), the header and the summary."""

    role = "solo"
    process = "main"  # this process's name in the per-process times (a worker's row is named by its controller)

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        self.config, self.ctx, self.settings = config, ctx, ctx.settings
        self.started = time.perf_counter()
        self.offered_before = dynamo.offered_seconds()  # this process's, since an earlier session in it (pytester)
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
            from .children import disarm

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
        # Dynamo reuse's own time: offering stored variants (inside the tests, outside the compiles), and loading and
        # installing stored entries where torch.compile() wrapped a function (in the collection or in a test)
        spans = [(start, end) for start, end in dynamo.cost_spans() if start >= self.started]
        in_collect = sum(end - start for start, end in spans if end <= collected)
        in_tests = sum(end - start for start, end in spans) - in_collect + dynamo.offered_seconds() - self.offered_before
        t.collect = max(0.0, t.collect - in_collect)
        t.reused = round(in_collect + in_tests, 4)
        t.tests = max(0.0, run_end - collected - waited - t.load - compiled - imported_in_tests - isa_elsewhere - in_tests)
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
                        signing=bool(ctx.signing_keys), dynamo_reuse=ctx.reuse.as_dict())
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
        verbose = reportmod.asked_verbosity(config)  # a project's own addopts -vv does not unfold the summary
        for line in reportmod.terminal_lines(self.report, verbose, durations=self.settings.durations):
            terminalreporter.write_line(line)
        if self.settings.strict and self.problems:
            terminalreporter.write_line(f"megacache strict: {len(self.problems)} cache problem(s) fail this session",
                                        red=True)

    def close(self) -> None:
        """Undo what the role installed in this process (torch hooks)."""

    def open_spool(self) -> None:
        """For the role that reports (a plain session, an xdist controller): child processes of the tests, and
        of xdist workers, write their own torch counters here (``children.hook``; the variable is inherited)."""
        from .children import Spool

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
