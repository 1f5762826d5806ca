"""The roles that run tests in this process: :class:`Compiling` (torch's compile callbacks, the restore started when
torch is imported, the load on the first compile, per-test accounting) and :class:`Solo`, a plain session (also
``-n 0``) that restores, loads on the first compile and uploads. An xdist worker is a :class:`Compiling` too
(:mod:`pytest_megacache.xdist`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import pytest

from . import dynamo, isaprobe
from .context import Context, Reuse
from .importhook import AfterImports, initializing
from .report import TritonWatch, triton_figures
from .roles import Role
from .torch_adapter import PostImportHook, TorchAdapter

if TYPE_CHECKING:
    from .core import CacheSession


class Compiling(Role):
    """What the roles that run tests share (a plain session, an xdist worker): torch's compile callbacks, the
    restore started when torch is imported, the load on the first compile, per-test accounting."""

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        super().__init__(config, ctx)
        self.adapter = TorchAdapter(self._on_first_compile)
        self._torch_hook: PostImportHook | None = None
        self._isa_hook: PostImportHook | None = None
        self._dynamo_hook: PostImportHook | AfterImports | None = None
        self._start_lock = threading.Lock()
        self.triton = TritonWatch()  # Triton's kernels loaded from its cache vs compiled, once Triton is imported
        self.triton.install()

    def make_session(self) -> CacheSession:
        return self.new_session()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # The restore starts in the background when this process imports torch, or when a child process of the
        # tests (torchrun, mp.spawn, subprocess) imports torch, whichever comes first: that child waits until the
        # restore has written its files and the cache directories are snapshotted (children.hook), so that it hits what
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
        if self.ctx.reuse.on:
            # Dynamo reuse is installed where torch._dynamo is imported (a session that never compiles pays nothing)
            if "torch._dynamo" in sys.modules:
                self._reuse_dynamo()
            else:
                self._dynamo_hook = PostImportHook("torch._dynamo", lambda _module: self._reuse_dynamo())
                sys.meta_path.insert(0, self._dynamo_hook)

    def _reuse_dynamo(self) -> None:
        # torch._dynamo imported from inside another import of torch's own (a Triton op defined where a module is
        # imported imports it half way through torch._inductor's modules): some of torch's modules that reuse wraps
        # cannot be imported yet. Reuse is turned on once those imports are over: at the next import, or before the
        # next test, whichever comes first (a function wrapped in between is compiled as without reuse).
        if under_way := initializing("torch", besides="torch._dynamo"):
            self._dynamo_hook = AfterImports(under_way, self._reuse_dynamo)
            sys.meta_path.insert(0, self._dynamo_hook)
            return
        with self.contained("turning Dynamo reuse on"):
            if why_not := TorchAdapter.enable_precompile(str(self.config.rootpath), self.ctx.reuse.asked):
                self.ctx.reuse = Reuse(False, why_not, self.ctx.reuse.asked)
                if self.ctx.reuse.asked:  # by default, the report says why
                    self.problems.append(f"--megacache-precompile ignored: {why_not}")
                return
            # torch looks a stored entry up when torch.compile() wraps a function (at import, for a decorator), before
            # any compile starts: the restore is loaded where it first does so (it runs beside collection until then)
            self.start_cache()
            if not dynamo.before_first_load(self._on_first_compile):
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
        settled (children.RestoreSignal, in the spool: this session's own, or an xdist worker's controller's)."""
        from .children import SPOOL_ENV, RestoreSignal

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
                # (Child processes wait by themselves when they import torch: children.)
                self.session.wait_restore()
            if isinstance(self._dynamo_hook, AfterImports):
                self._dynamo_hook.poll()  # reuse waiting for torch's imports to be over (_reuse_dynamo)
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
        for hook in (self._torch_hook, self._dynamo_hook):
            if hook is not None:
                hook.remove()
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
            cs.torch_stats.triton = triton_figures(self.triton, cs)


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
