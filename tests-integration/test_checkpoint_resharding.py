"""Checkpoints across world sizes: train at world 2 with shardkit-optim, save sharded (DCP) and
consolidated (one plain torch state dict), then resume at world 3 and at world 1.

"Identical continuation" is checked bit-for-bit three ways at every resume:

- the resumed sharded state, consolidated, equals the one saved at world 2;
- training on from it equals plain DDP + a plain ``torch.optim.AdamW`` that loaded the
  consolidated dict, at the same world size on the same data, every step;
- a ShardedOptimizer that loaded the consolidated dict (``load_state_dict``) instead of the
  sharded checkpoint follows the same trajectory.

At world 2 itself, a fresh model + optimizer restored from the checkpoint continues exactly like
the objects that were never torn down.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _gpt import (
    assert_same_params,
    assert_same_state,
    lm_loss,
    local_batch,
    make_model,
    snapshot,
)
from shardkit.optim import ShardedOptimizer, load_consolidated, load_sharded, save_sharded
from shardkit.testing import world
from torch.nn.parallel import DistributedDataParallel as DDP

_ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
_SEED = 3
_TRAINED = 3  # steps before the checkpoint
_MORE = 3  # steps after resuming


def _train_step(ddp: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    lm_loss(ddp, local_batch(step, dist.get_rank(), dist.get_world_size())).backward()
    opt.step()
    opt.zero_grad()


@world(2)
def _train_and_save_at_world_2(out: str) -> None:
    """Trains `_TRAINED` steps and writes ``optim/`` (sharded), ``adamw.pt`` and ``model.pt``."""
    root = Path(out)
    model = make_model(_SEED)
    ddp = DDP(model)
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    for step in range(_TRAINED):
        _train_step(ddp, zero, step)
    save_sharded(zero, root / "optim")
    zero.consolidate_state_dict(recipient_rank=0)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), root / "model.pt")
        torch.save(zero.state_dict(), root / "adamw.pt")
    dist.barrier()

    # Same world size: fresh objects restored from disk continue exactly like the live ones.
    fresh = make_model(_SEED)
    fresh.load_state_dict(torch.load(root / "model.pt"))
    fresh_ddp = DDP(fresh)
    fresh_zero = ShardedOptimizer(fresh.parameters(), torch.optim.AdamW, **_ADAMW)
    load_sharded(fresh_zero, root / "optim")
    for step in range(_TRAINED, _TRAINED + 2):
        _train_step(ddp, zero, step)
        _train_step(fresh_ddp, fresh_zero, step)
        assert_same_params(snapshot(fresh), snapshot(model), f"world 2 restart, step {step}")


@pytest.fixture(scope="module")
def world2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("ckpt-world2")
    _train_and_save_at_world_2(out=str(out))
    return str(out)


def _resume(ckpt: str) -> None:
    root = Path(ckpt)
    rank, size = dist.get_rank(), dist.get_world_size()
    saved = torch.load(root / "adamw.pt")
    weights = torch.load(root / "model.pt")

    model = make_model(_SEED)
    model.load_state_dict(weights)
    from_dict_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)

    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_ADAMW)
    load_sharded(zero, root / "optim")
    zero.consolidate_state_dict(recipient_rank=-1)
    assert_same_state(zero.state_dict(), saved, f"world {size} rank {rank}: sharded reload")
    if rank == 0:
        offline = load_consolidated(root / "optim")
        assert_same_state(offline, saved, "load_consolidated")

    from_dict = ShardedOptimizer(from_dict_model.parameters(), torch.optim.AdamW, **_ADAMW)
    from_dict.load_state_dict(saved)
    plain = torch.optim.AdamW(ref_model.parameters(), **_ADAMW)
    plain.load_state_dict(saved)

    runs = [(DDP(model), zero), (DDP(from_dict_model), from_dict), (DDP(ref_model), plain)]
    for step in range(_TRAINED, _TRAINED + _MORE):
        for ddp, opt in runs:
            _train_step(ddp, opt, step)
        want = snapshot(ref_model)
        assert_same_params(snapshot(model), want, f"world {size} rank {rank}, sharded, step {step}")
        assert_same_params(
            snapshot(from_dict_model), want, f"world {size} rank {rank}, from dict, step {step}"
        )
    zero.consolidate_state_dict(recipient_rank=-1)
    assert_same_state(zero.state_dict(), plain.state_dict(), f"world {size} rank {rank}: final")


@world(3)
def test_resume_at_world_3(world2_checkpoint: str) -> None:
    _resume(world2_checkpoint)


@world(1)
def test_resume_at_world_1(world2_checkpoint: str) -> None:
    _resume(world2_checkpoint)
