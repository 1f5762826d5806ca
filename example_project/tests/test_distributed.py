"""A 2-rank DDP + torch.compile training step, each rank a child process (torch.multiprocessing.spawn): gloo on
CPU, NCCL when two GPUs are present. The compiles happen in the children only; pytest-megacache carries them.

With EXAMPLE_CHILD_COUNTERS set to a directory, each rank writes torch's own cache counters there
(``rank<N>.json``): the demo shows them cold and warm. (Not a TORCH*/TRITON* name: those are fingerprinted.)"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_step(rank: int, port: int, use_cuda: bool) -> None:
    # What torchrun sets for each rank; init_method "env://" reads them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
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
            Path(out, f"rank{rank}.json").write_text(json.dumps(doc))
    finally:
        dist.destroy_process_group()


def test_ddp_compiled_step_in_two_ranks() -> None:
    use_cuda = torch.cuda.device_count() >= WORLD and dist.is_nccl_available()
    mp.spawn(_rank_step, args=(_free_port(), use_cuda), nprocs=WORLD, join=True)
