"""torch's ZeroRedundancyOptimizer(overlap_with_ddp=True) loop with shardkit's classes.

The torch loop (``hook_with_zero_step`` from ``ddp_zero_hook``) switches by import to
``shardkit.optim.ZeroRedundancyOptimizer`` and ``shardkit.overlap.hook_with_zero_step`` (same
signature). One difference is on purpose: torch's overlapped optimizer does not step in the
iterations before DDP rebuilds its buckets; shardkit's steps from the first one, so it equals
plain DDP + the optimizer from step 1 (bit for bit here: world 2, a + b in both reductions).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from shardkit.optim import ZeroRedundancyOptimizer
from shardkit.overlap import hook_with_zero_step
from shardkit.testing import world
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


@world(2)
def test_overlap_with_ddp_loop_switches_by_import() -> None:
    ref_model, model = _model(), _model()
    ref_ddp = DDP(ref_model, bucket_cap_mb=0.0005)
    ddp = DDP(model, bucket_cap_mb=0.0005)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=0.01
    )
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    ref_ddp.register_comm_hook(None, allreduce_hook)
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        for d in (ref_ddp, ddp):
            nn.functional.mse_loss(d(x), y).backward()
        ref.step()
        zero.step()  # the hook stepped; this only checks it did
        ref.zero_grad()
        zero.zero_grad()
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), step
