"""Param all-gathers overlapped with the next forward (``overlap_param_gather``, default): what
waits for them, and the probe that finds params read before their owners' pre-hooks ([Note:
Deferred param gather], [Note: Gather probe] in ``shardkit.ddp._gather``)."""

from __future__ import annotations

import copy

import pytest
import shardkit.ddp._gather as _gather_module
import torch
import torch.distributed as dist
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import captured_logs, world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class _Functional(nn.Module):
    """``early`` is never called as a module: its params are read functionally by the parent
    (before any pre-hook of their owner could wait for them); ``tied``'s weight is also read by
    ``head`` after ``tied`` ran (safe)."""

    def __init__(self) -> None:
        super().__init__()
        self.early = nn.Linear(6, 6)
        self.tied = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(x, self.early.weight, self.early.bias))
        h = torch.tanh(self.tied(h))
        h = h + nn.functional.linear(h, self.tied.weight)
        return self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


@pytest.mark.parametrize("overlap", [True, False])
@world(2)
def test_params_read_outside_their_module_are_gathered_at_the_step(overlap: bool) -> None:
    torch.manual_seed(0)
    ref_m = _Functional()
    m = copy.deepcopy(ref_m)
    ref, ref_opt = DDP(ref_m), torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    # one bucket per param: the probe's finding is per bucket
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0, overlap_param_gather=overlap)
    _gather_module._logged_sync = False  # logged once per process: workers may be reused
    with captured_logs("shardkit.ddp") as logs:
        for step in range(4):
            x, y = _batch(step)
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            # no zero_grad() needed (the step consumed the gradients): the next forward is
            # what waits for the gathers, module by module
            nn.functional.mse_loss(sdp(x), y).backward()
            opt.step()
            if overlap:
                assert set(sdp._gather.pending) == {b.index for b in sdp._buckets} - early(sdp)
            else:
                assert not sdp._gather.pending
    warned = logs.matching("read in forward before any module owning them ran")
    if overlap:
        assert sdp._gather.sync == early(sdp)  # tied.weight is read after tied ran: overlapped
        assert len(warned) == 1 and "early.weight" in warned[0], warned
    else:
        assert not warned
    got = m.state_dict()  # waits
    for n, p in ref_m.named_parameters():
        assert torch.equal(p, got[n]), n


def early(sdp: ShardedDataParallel) -> set[int]:
    m = sdp.module
    assert isinstance(m, _Functional)
    return {sdp._gather.bucket_of[id(p)] for p in m.early.parameters()}


@world(2)
def test_what_waits_for_the_param_gathers() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    x = torch.randn(2, 3)
    sdp(x).sum().backward()
    opt.step()
    assert sdp._gather.pending
    list(m.parameters())  # the wrapped module's own parameters() does not wait
    assert sdp._gather.pending
    list(sdp.parameters())  # the wrapper's does
    assert not sdp._gather.pending
    sdp(x).sum().backward()
    opt.step()
    opt.zero_grad()  # zero_grad touches no param: it leaves the gathers to the forward
    assert sdp._gather.pending
    sdp(x).sum().backward()  # the forward waited, module by module
    assert not sdp._gather.pending
    opt.step()
    sdp(x).sum().backward()
    opt.step()
    sdp.eval()
    with torch.no_grad():
        sdp(x)  # an eval forward waits through the pre-hooks, module by module
    assert not sdp._gather.pending


@world(2)
def test_load_state_dict_after_a_step_is_not_overwritten_by_the_gathers() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    saved = copy.deepcopy(m.state_dict())
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=0)
    sdp(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert sdp._gather.pending
    m[2].load_state_dict({k[2:]: v for k, v in saved.items() if k.startswith("2.")})
    assert not sdp._gather.pending  # a submodule's load waited for the gathers first
    sdp.wait_params()
    for k, v in m[2].state_dict().items():
        assert torch.equal(v, saved[f"2.{k}"]), k
