"""Drop-in classes: torch's ZeroRedundancyOptimizer and fairscale's OSS constructor.

Parity with torch's ZeroRedundancyOptimizer is bit for bit: both step every param with the
same optimizer class on the same reduced grads and broadcast the owners' values.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import OSS, ShardedOptimizer, ZeroRedundancyOptimizer
from shardkit.testing import world
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


@world(1)
def test_torch_keyword_on_sharded_optimizer_names_the_fix() -> None:
    with pytest.raises(TypeError, match=r"optim= .*use shardkit\.optim\.ZeroRedundancyOptimizer"):
        ShardedOptimizer(_model().parameters(), optimizer_class=torch.optim.Adam, lr=0.1)


@world(2)
def test_oss_accepts_fairscale_signature_and_deprecated_keywords() -> None:
    model = _model()
    with pytest.warns(DeprecationWarning, match="broadcast_buffer_size"):
        opt = OSS(model.parameters(), torch.optim.SGD, None, 2**20, False, lr=0.1)
    assert isinstance(opt, ShardedOptimizer) and opt.param_groups[0]["lr"] == 0.1
    with pytest.warns(DeprecationWarning, match="force_broadcast_object"):
        OSS(_model().parameters(), optim=torch.optim.SGD, force_broadcast_object=True, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OSS(_model().parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("optim", [torch.optim.Adam, torch.optim.SGD])
@world(2)
def test_zero_matches_torch_zero_bit_for_bit(optim: type[torch.optim.Optimizer]) -> None:
    ref_model, model = _model(), _model()
    ref_ddp, ddp = DDP(ref_model), DDP(model)
    kw = {"lr": 0.01}
    ref = TorchZero(ref_model.parameters(), optimizer_class=optim, **kw)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=optim, parameters_as_bucket_view=True, **kw
    )
    for step in range(4):
        x, y = _batch(step)
        for d, o in ((ref_ddp, ref), (ddp, zero)):
            o.zero_grad()
            nn.functional.mse_loss(d(x), y).backward()
            o.step()
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), step
    ref.consolidate_state_dict(to=1)
    zero.consolidate_state_dict(to=1)
    if dist.get_rank() == 1:
        want, got = ref.state_dict(), zero.state_dict()
        assert got["param_groups"] == want["param_groups"]
        for i, st in want["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)
        # torch's rule: the last consolidated state, even after more steps
        x, y = _batch(9)
        nn.functional.mse_loss(ddp(x), y).backward()
    else:
        with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=0\)"):
            zero.state_dict()
        x, y = _batch(9)
        nn.functional.mse_loss(ddp(x), y).backward()
    before = zero.state_dict() if dist.get_rank() == 1 else None
    zero.step()
    if before is not None:
        after = zero.state_dict()
        for i, st in before["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(after["state"][i][k]), torch.as_tensor(v))
    assert zero.join_process_group is zero.process_group
    assert zero.join_device == torch.device("cpu")


@world(2)
def test_join_with_uneven_inputs_matches_torch_zero() -> None:
    """Rank 0 runs out of batches after 2 steps, rank 1 after 4; Join shadows the missing
    steps (DDP's all-reduce and the optimizer's collectives) exactly as torch's ZeRO does."""
    ref_model, model = _model(), _model()
    ref_ddp, ddp = DDP(ref_model), DDP(model)
    ref = TorchZero(ref_model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05)
    steps = 2 if dist.get_rank() == 0 else 4
    for d, o in ((ref_ddp, ref), (ddp, zero)):
        with Join([d, o]):
            for step in range(steps):
                x, y = _batch(step)
                o.zero_grad()
                nn.functional.mse_loss(d(x), y).backward()
                o.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    copy.deepcopy(zero.param_groups)  # still a healthy optimizer


def test_zero_argument_errors() -> None:
    with pytest.raises(TypeError, match="overlap_with_ddp must be a bool"):
        ZeroRedundancyOptimizer([nn.Parameter(torch.ones(1))], torch.optim.SGD, overlap_with_ddp=1)  # type: ignore[arg-type]
