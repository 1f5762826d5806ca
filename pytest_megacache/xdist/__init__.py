"""pytest-xdist: the controller's and the workers' roles (this module, the family's front door) and the staging
they hand each other (:mod:`.staging`).

The :class:`Controller` runs no tests: it restores once and stages the result for its
workers, takes over what each worker hands back, merges it and uploads once; a :class:`Worker` loads what the
controller staged and hands what it compiled back. They delegate to :mod:`.staging` (stage, hand over, take
over), imported only once a session imports torch; what crosses between processes is plain data (``workerinput`` /
``workeroutput``); the controller's restore stages through the function it is handed (:func:`.staging.stage`).
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..compiling import Compiling
from ..context import Context
from ..errors import redact
from ..report import ProcessTimes, XdistStats
from ..roles import Role

if TYPE_CHECKING:
    from ..core import CacheSession
    from .staging import Takeover

__all__ = ["Controller", "Worker"]


class Worker(Compiling):
    """An xdist worker: compiles into its own cache directories, loads what its controller staged, and hands
    what it compiled (and the controller lacks) back through ``workeroutput``. It writes no report and says no
    warning: its problems travel to the controller, which says them once."""

    role = "worker"

    def __init__(self, config: pytest.Config, ctx: Context) -> None:
        super().__init__(config, ctx)
        from ..files import inductor_cache_dir, triton_cache_dir
        from . import staging

        self.workerinput: dict[str, Any] = getattr(config, "workerinput", {})
        self.worker_id = str(self.workerinput.get("workerid", ""))
        # Its own directories unless the user chose them (directories shared between processes can race).
        for var, base in (("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir()), ("TRITON_CACHE_DIR", triton_cache_dir())):
            if not os.environ.get(var):
                os.environ[var] = staging.worker_dir(str(base), self.worker_id)
        self.staged_at: Path | None = None  # the controller's staging directory, when this worker shares its disk

    def make_session(self) -> CacheSession:
        from . import staging

        if staging.same_host(self.workerinput):
            self.staged_at = Path(self.workerinput[staging.KEY]["stage"])
            stage = self.staged_at
        else:
            stage = staging.unpack_remote_stage((self.workerinput.get(staging.KEY) or {}).get("blob"))
        session = self.new_session(store_factory=lambda: staging.StagedStore(stage, self.settings.timeout),
                                   folder=staging.STAGE_FOLDER, read_folders=[staging.STAGE_FOLDER], signing_keys=(),
                                   writes=False, diagnosis=None)
        session.restore_stats.source = "controller"
        return session

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        from . import staging

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
                    new = cs.scrubbed(cs.upload.collect(self.adapter)).minus(cs.restored)
                    cs.upload.say_skipped()  # the files left out, said by the controller with this worker's name
                    output.update(staging.hand_over(self.staged_at, self.worker_id, new, cs.fingerprint))
                output.update({"torch": {k: v for k, v in asdict(ts).items() if k != "layers"},
                               "selection": self.selection, "restore": asdict(cs.restore_stats),
                               "load": asdict(cs.load_stats)})
            output["problems"] = [redact(p) for p in cs.new_problems()]
        # Notes (the vector-ISA check's, say) are said once by the controller, not once per worker.
        output["notes"] = [redact(n) for n in dict.fromkeys(self.notes + (cs.notes if cs is not None else []))]
        with self.contained("timing the worker"):
            output["times"] = asdict(self.process_times())
        workeroutput: dict[str, Any] = getattr(self.config, "workeroutput", {})
        workeroutput[staging.KEY] = output


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
        from . import staging

        assert self.ctx.fingerprint is not None
        self.takeover = staging.Takeover(self.ctx.fingerprint.key, self._scratch)
        with self.contained("starting the restore"):
            self.stage_dir = staging.make_stage_dir()
            # No roots: workers restore files into their own directories.
            self.session = self.new_session(roots=[], stage=functools.partial(staging.stage, self.stage_dir))
            self.session.start_restore()
        self.strict_wait()

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Tell each worker where the staged restore is (or send it, to a worker on another host)."""
        from . import staging

        if self.session is None or self.stage_dir is None:
            return
        info: dict[str, Any] = {"stage": str(self.stage_dir), "host": socket.gethostname()}
        with self.contained("staging the cache for a remote xdist worker"):
            if not getattr(getattr(node.gateway, "spec", None), "popen", False):
                # A remote worker cannot read our disk: wait for the restore and send the staged object.
                self.session.wait_restore()
                staged = sorted((self.stage_dir / staging.STAGE_FOLDER).glob("*.mcb"))
                info["blob"] = staged[0].read_bytes() if staged else None
        node.workerinput[staging.KEY] = info

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """Take over what a worker compiled."""
        from . import staging

        if self.session is None or self.takeover is None:
            return
        with self.contained("taking over from an xdist worker"):
            worker = str(getattr(node, "gateway", None) and node.gateway.id)
            self.takeover.take(worker, getattr(node, "workeroutput", {}).get(staging.KEY), error)
            if self.selection is None and self.takeover.selection:
                self.selection = self.takeover.selection
                self.session.meta.update(selection=self.selection)

    def finish(self) -> None:
        cs, takeover = self.session, self.takeover
        if cs is None or takeover is None:
            return
        with self.contained("merging the xdist workers' Dynamo entries"):
            takeover.merge_dynamo()
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
            from . import staging

            staging.remove_stage_dir(self.stage_dir)
            self.stage_dir = None

    def worker_times(self) -> list[ProcessTimes]:
        return list(self.takeover.times) if self.takeover is not None else []

    def xdist_stats(self) -> XdistStats:
        takeover = self.takeover
        return takeover.stats(self.role) if takeover else XdistStats(self.role)
