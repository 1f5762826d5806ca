"""A 2-rank DDP + torch.compile training step, each rank a child process: gloo on CPU, NCCL when two GPUs are
present. The ranks start two ways, as users start them: ``torch.multiprocessing.spawn`` from the test, and
``torchrun`` (its elastic agent starts the ranks as new interpreters running this file). The compiles happen in
the ranks only; pytest-megacache carries them.

With EXAMPLE_CHILD_COUNTERS set to a directory, each rank writes torch's own cache counters there
(``<launcher>-rank<N>.json``): the demo shows them cold and warm. (Not a TORCH*/TRITON* name: those are
fingerprinted.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _use_cuda() -> bool:
    return torch.cuda.device_count() >= WORLD and dist.is_nccl_available()


def _rank_step(rank: int, launcher: str) -> None:
    """One rank's training step; MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE are in the environment."""
    use_cuda = _use_cuda()
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://")
    try:
        device = torch.device(f"cuda:{rank}") if use_cuda else torch.device("cpu")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
        # The compiled module inside DDP (torch.compile of the DDP wrapper graph-breaks on its hooks here).
        ddp = DistributedDataParallel(torch.compile(model), device_ids=[rank] if use_cuda else None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = torch.randn(8, 16, device=device) + rank
        loss = ddp(x).square().mean()
        loss.backward()
        optimizer.step()
        # DDP averaged the gradients: every rank holds the same weights after the step.
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(weights) for _ in range(WORLD)]
        dist.all_gather(gathered, weights)
        torch.testing.assert_close(gathered[0], gathered[1])
        out = os.environ.get("EXAMPLE_CHILD_COUNTERS")
        if out:
            from torch._dynamo.utils import counters

            doc = {group: dict(counters[group]) for group in ("inductor", "aot_autograd")}
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, f"{launcher}-rank{rank}.json").write_text(json.dumps(doc))
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, port: int) -> None:
    # What torchrun sets for each rank; init_method "env://" reads them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    _rank_step(rank, "spawn")


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_ddp_compiled_step_in_two_ranks(launcher: str) -> None:
    if launcher == "spawn":
        mp.spawn(_spawned, args=(_free_port(),), nprocs=WORLD, join=True)
        return
    # torchrun's module; --standalone: a rendezvous on a free local port. Each rank runs this file as __main__.
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                    "--monitor-interval=0.1", __file__], check=True, timeout=600)


if __name__ == "__main__":  # a rank started by torchrun
    _rank_step(int(os.environ["LOCAL_RANK"]), "torchrun")
