"""One training job with one rank-dependent mistake, written as a user writes a script: no
try/except, launched by ``test_rank_failure_jobs.py`` with
``torchrun --standalone --nproc-per-node N _rank_failure_job.py MODE MISUSE TIMEOUT_S``.

MODE: ``zero1`` (ShardedOptimizer under torch DDP), ``overlap`` (register_zero_overlap),
``zero2`` (ShardedDataParallel). MISUSE: see ``_MISUSES``. Every rank prints ``MISTAKE <unix
time>`` when it reaches the step where the mistake happens; a job that does not fail prints
``FINISHED`` on every rank and exits 0 (which the test reports as the bug).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.overlap import register_zero_overlap
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_MISUSES = (
    "state_dict_vs_barrier",  # rank 0 saves alone (opt.state_dict()), the others dist.barrier()
    "state_dict_vs_training",  # rank 0 saves alone, the others train on
    "no_backward",  # the last rank runs a forward without backward, then steps
    "no_sync",  # rank 0 accumulates under no_sync() alone, then steps
    "per_rank_lr",  # a per-rank learning rate (e.g. a schedule from each rank's loader length)
    "forward_error",  # a Python error in the last rank's forward
)
_MISTAKE_STEP = 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError(f"bad batch on rank {dist.get_rank()} (the job's own error)")
        return self.head(self.body(x))


def main() -> None:
    mode, misuse, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if misuse not in _MISUSES:
        raise ValueError(f"unknown misuse {misuse!r}; one of {_MISUSES}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    last = world - 1
    torch.manual_seed(0)
    net = _Net()
    opt = ShardedOptimizer(
        net.parameters(),
        optim=torch.optim.Adam,
        lr=1e-2,
        collective_timeout=timedelta(seconds=timeout_s),
    )
    if mode == "zero1":
        model: nn.Module = DDP(net)
    elif mode == "overlap":
        model = DDP(net, bucket_cap_mb=0.0005)  # a few buckets: the hooks step in backward
        register_zero_overlap(model, opt)
    elif mode == "zero2":
        model = ShardedDataParallel(net, opt)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    sync = model.no_sync  # DDP and ShardedDataParallel both have it
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(4, 8, generator=g)
        if step == _MISTAKE_STEP:
            print(f"MISTAKE {time.time():.3f} rank {rank}", flush=True)
            if misuse == "state_dict_vs_barrier":
                if rank == 0:
                    opt.state_dict()
                dist.barrier()
            elif misuse == "state_dict_vs_training" and rank == 0:
                opt.state_dict()
            elif misuse == "no_backward" and rank == last:
                model(x).square().mean()  # forward only
                opt.step()
                continue
            elif misuse == "no_sync" and rank == 0:
                with sync():
                    model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                continue
            elif misuse == "per_rank_lr":
                opt.param_groups[0]["lr"] = 1e-2 * (1 + rank)
            elif misuse == "forward_error" and rank == last:
                net.fail = True
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step}", flush=True)
    print(f"FINISHED rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
