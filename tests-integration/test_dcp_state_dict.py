"""torch.distributed.checkpoint.state_dict with a ShardedOptimizer: what torchtitan, Accelerate
and Lightning's distributed checkpointing call.

Trained at world 2 with ``get_state_dict(model, optimizers=zero)``: the sharded form (default
options) goes to a DCP checkpoint (``dcp.save``), the full form
(``StateDictOptions(full_state_dict=True, cpu_offload=True)``) to one ``torch.save`` file. Both are
restored with ``set_state_dict`` at world 2, 3 and 1. Every continuation is compared bit for bit
with a reference: at world 2 the objects that were never torn down (the uninterrupted run); at
every world size plain DDP + a plain ``torch.optim.AdamW`` that loaded the full dict (the same
world size sees the same data in the same reduction order, so equality is exact).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _gpt import assert_same_params, assert_same_state, lm_loss, local_batch, make_model, snapshot
from shardkit.optim import OSS, ShardedOptimizer, ZeroRedundancyOptimizer
from shardkit.testing import world
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
_SEED = 5
_TRAINED = 3
_MORE = 3
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _train_step(ddp: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    lm_loss(ddp, local_batch(step, dist.get_rank(), dist.get_world_size())).backward()
    opt.step()
    opt.zero_grad()


def _restore(root: Path, kind: str) -> tuple[nn.Module, ShardedOptimizer]:
    """A fresh model + optimizer restored the way a trainer does it."""
    model = make_model(_SEED + 100)  # other weights: the checkpoint must overwrite them all
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    if kind == "sharded":
        msd, osd = get_state_dict(model, optimizers=zero)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(root / "dcp"))
        set_state_dict(
            model, optimizers=zero, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
    else:  # full dicts from rank 0, broadcast
        full: dict[str, Any] = (
            torch.load(root / "full.pt") if dist.get_rank() == 0 else {"model": {}, "optim": {}}
        )
        # Model and optimizer separately: set_state_dict treats the empty model dict of the
        # ranks other than 0 as "optimizer only" and would skip the model's broadcast there.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full["model"], options=options)
        set_optimizer_state_dict(model, zero, full["optim"], options=options)
    return model, zero


@world(2)
def _train_and_save_at_world_2(out: str) -> None:
    root = Path(out)
    model = make_model(_SEED)
    ddp = DDP(model)
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    for step in range(_TRAINED):
        _train_step(ddp, zero, step)
    msd, osd = get_state_dict(model, optimizers=zero)
    # The sharded form is the full state on every rank (see [Note: Implicit consolidation]),
    # keyed by fully qualified names, as DCP expects.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(osd["state"]) == trainable, (sorted(osd["state"]), sorted(trainable))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp"))
    full_msd, full_osd = get_state_dict(model, optimizers=zero, options=_FULL)
    if dist.get_rank() == 0:
        torch.save({"model": full_msd, "optim": full_osd}, root / "full.pt")
        # The plain reference: the consolidated state in plain torch format.
        zero_plain = dict(zero.state_dict())
        torch.save(zero_plain, root / "plain.pt")
        torch.save(model.state_dict(), root / "model.pt")
    else:
        assert full_osd == {} and full_msd == {}  # cpu_offload: rank 0 only
    dist.barrier()

    # Same world size: fresh objects restored both ways continue exactly like the live ones.
    restored = [_restore(root, "sharded"), _restore(root, "full")]
    runs = [(ddp, zero)] + [(DDP(m), z) for m, z in restored]
    for step in range(_TRAINED, _TRAINED + 2):
        for d, o in runs:
            _train_step(d, o, step)
        for (m, _), kind in zip(restored, ("sharded", "full"), strict=True):
            assert_same_params(snapshot(m), snapshot(model), f"world 2 {kind} restart {step}")


@pytest.fixture(scope="module")
def world2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("dcp-world2")
    _train_and_save_at_world_2(out=str(out))
    return str(out)


def _tuples_as_lists(sd: dict[str, Any]) -> dict[str, Any]:
    """torch's full-state-dict loading path (flatten, broadcast) turns tuple hyper-parameters
    (``betas``) into lists, for plain optimizers as well; the values are the same."""
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return {**sd, "param_groups": groups}


def _resume(ckpt: str) -> None:
    root = Path(ckpt)
    rank, size = dist.get_rank(), dist.get_world_size()
    plain_sd = torch.load(root / "plain.pt")
    ref_model = make_model(_SEED)
    ref_model.load_state_dict(torch.load(root / "model.pt"))
    plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
    plain.load_state_dict(plain_sd)

    restored = {kind: _restore(root, kind) for kind in ("sharded", "full")}
    for kind, (m, z) in restored.items():
        assert_same_params(snapshot(m), snapshot(ref_model), f"world {size} {kind}: weights")
        z.consolidate_state_dict(recipient_rank=-1)
        got = _tuples_as_lists(z.state_dict())
        assert_same_state(got, _tuples_as_lists(plain_sd), f"world {size} rank {rank} {kind}")
    runs = [(DDP(ref_model), plain)] + [(DDP(m), z) for m, z in restored.values()]
    for step in range(_TRAINED, _TRAINED + _MORE):
        for d, o in runs:
            _train_step(d, o, step)
        for kind, (m, _) in restored.items():
            assert_same_params(snapshot(m), snapshot(ref_model), f"world {size} {kind} {step}")


@world(3)
def test_dcp_checkpoint_from_world_2_resumes_at_world_3(world2_checkpoint: str) -> None:
    _resume(world2_checkpoint)


@world(1)
def test_dcp_checkpoint_from_world_2_resumes_at_world_1(world2_checkpoint: str) -> None:
    _resume(world2_checkpoint)


@pytest.mark.parametrize("cls", ["ZeroRedundancyOptimizer", "OSS"])
@world(2)
def test_drop_in_classes_round_trip_through_get_and_set_state_dict(cls: str) -> None:
    """The torch and fairscale drop-ins go through torch's state-dict API too, and a rank that
    owns no stateful param (world 2, one trainable param) does not take the API's
    state-creating step alone (see [Note: State truthiness])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2))
    model[1].requires_grad_(False)  # the frozen params have no state on their owner
    ref_model = copy.deepcopy(model)

    def build(m: nn.Module) -> torch.optim.Optimizer:
        if cls == "OSS":
            return OSS(m.parameters(), optim=torch.optim.Adam, lr=0.1)
        return ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)

    opt, ref = build(model), torch.optim.Adam(ref_model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    _, osd = get_state_dict(model, optimizers=opt)
    _, ref_osd = get_state_dict(ref_model, optimizers=ref)
    assert_same_state(osd, ref_osd, f"{cls} get_state_dict")
    fresh_model = copy.deepcopy(model)
    fresh = build(fresh_model)
    set_state_dict(fresh_model, optimizers=fresh, model_state_dict={}, optim_state_dict=osd)
    assert_same_state(fresh.state_dict(), ref.state_dict(), f"{cls} set_state_dict")
