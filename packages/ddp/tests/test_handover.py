"""Nothing is built for a hand-over (shardkit-optim's [Note: Nothing built for a hand-over]).

A ``ShardedOptimizer`` handed to ``ShardedDataParallel`` never builds ZeRO-1's backend (the
wrapped optimizer, fp32 masters, flat sync buffers) only to free it; what only ZeRO-1 does
raises under the wrapper, naming it; ``optim_class`` answers in both modes.
"""

from __future__ import annotations

import pytest
import torch
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "options"),
    [
        (torch.float32, {}),
        (torch.bfloat16, {"master_dtype": torch.float32}),
        (torch.bfloat16, {"master_dtype": torch.float32, "master_remainder": True}),
        (torch.float32, {"compact_state": "int8"}),
    ],
)
@world(2)
def test_a_handed_over_optimizer_builds_no_zero1_shard(
    dtype: torch.dtype, options: dict[str, object]
) -> None:
    m = _model(dtype)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2, **options)
    assert opt._local is None  # built at first use only
    sdp = ShardedDataParallel(m, opt)
    assert opt._local is None  # and never under the wrapper
    if "compact_state" in options:  # the compact subclass that steps the shards
        assert issubclass(opt.optim_class, torch.optim.AdamW)
        assert opt.optim_class is not torch.optim.AdamW
    else:
        assert opt.optim_class is torch.optim.AdamW
    assert not opt.state
    sdp(torch.randn(4, 6, dtype=dtype)).sum().backward()
    opt.step()
    assert opt.state and opt._local is None
    for name in ("optim", "step_local", "sync_params", "refresh_trainable"):
        with pytest.raises(AttributeError, match="ShardedDataParallel holds its sharded state"):
            getattr(opt, name)
    sdp.close()


@world(2)
def test_zero1_builds_its_shard_at_first_use_and_trains_as_before() -> None:
    """Without a wrapper the backend is built by the first step (or ``optim``, a state dict):
    weights loaded between construction and that step are what the masters start from."""
    m = _model(torch.bfloat16)
    ref = _model(torch.bfloat16)
    fp32 = torch.float32
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=fp32)
    ref_opt = ShardedOptimizer(ref.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=fp32)
    assert opt._local is None and not opt.state
    assert isinstance(ref_opt.optim, torch.optim.AdamW)  # built here, before the load below
    torch.manual_seed(5)
    new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    m.load_state_dict(new)
    ref.load_state_dict(new)
    for model, o in ((m, opt), (ref, ref_opt)):
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(4, 6, dtype=torch.bfloat16)).float().pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert opt._local is not None and opt.state
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


@world(2)
def test_master_model_state_dict_works_under_the_wrapper() -> None:
    """bf16 params, fp32 masters, ZeRO-2: the fp32 export holds every param's master (the
    optimizer state dict's ``master_params``, by name), which rounds to the live bf16 param;
    the buffers upcast. Loading the masters back goes through ``load_state_dict``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(torch.bfloat16)
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32
    )
    sdp = ShardedDataParallel(m, opt)
    for step in range(3):
        torch.manual_seed(10 + step)
        sdp(torch.randn(4, 6, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    export = opt.master_model_state_dict(m, recipient_rank=-1)
    assert export is not None
    masters = opt.state_dict(all_ranks=True)["master_params"]
    names = [n for n, _ in m.named_parameters()]
    assert sorted(export) == sorted(m.state_dict())
    for i, name in enumerate(names):
        assert export[name].dtype == torch.float32
        assert torch.equal(export[name], masters[i].cpu()), name
        assert torch.equal(export[name].to(torch.bfloat16), m.state_dict()[name].cpu()), name
    assert torch.equal(export["1.running_mean"], m[1].running_mean.float())
    assert export["1.num_batches_tracked"].dtype == torch.int64
    for value in export.values():  # the export is the caller's: no live master behind it
        value.fill_(7)
    again = opt.state_dict(all_ranks=True)["master_params"]
    assert all(torch.equal(again[i], masters[i]) for i in masters)
    with pytest.raises(AttributeError, match=r"optimizer.load_state_dict\(sd\)"):
        opt.load_master_model_state_dict(m, export)
    sdp.close()
