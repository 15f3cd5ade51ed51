"""The public step-driver contract of ShardedOptimizer (``StepDriver`` / ``ShardOwner``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer, ShardLayout, ShardOwner, StepDriver
from shardkit.testing import live_storages, world
from torch import nn


class _RecordingOwner(ShardOwner):
    """A toy ZeRO-2 owner: records what the optimizer forwards to it."""

    name = "the recording owner"

    def __init__(self, opt: ShardedOptimizer) -> None:
        self.opt = opt
        self.calls: list[tuple[str, Any]] = []

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        self.opt.check_step(None)  # the contract: agree before changing anything
        self.calls.append(("step", kwargs))
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool) -> None:
        self.calls.append(("zero_grad", set_to_none))

    def clip_grad_norm(
        self, max_norm: float, norm_type: float, filter_params_fn: Any = None
    ) -> torch.Tensor:
        self.calls.append(("clip", (max_norm, norm_type)))
        return torch.tensor(1.5)

    def full_state_dict(self, recipient_rank: int = -1, skip: Any = frozenset()) -> dict[str, Any]:
        self.calls.append(("full", None))
        return {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.5, "params": [0, 1]}],
        }

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append(("load", state_dict["param_groups"][0]["lr"]))

    def checkpoint_state_dict(self) -> dict[str, Any]:
        self.calls.append(("checkpoint", None))
        return {"state": {}, "param_groups": []}

    def checkpoint_indices(self) -> list[int]:
        return [0, 1]

    def unscale_for_scaler(self, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        self.calls.append(("unscale", float(inv_scale)))
        return {}

    def drop_grad_factors(self) -> None:
        self.calls.append(("drop", None))


def test_abstract_methods_are_the_contract() -> None:
    assert ShardOwner.__abstractmethods__ == {
        "step",
        "zero_grad",
        "clip_grad_norm",
        "full_state_dict",
        "load_full_state_dict",
        "checkpoint_state_dict",
        "checkpoint_indices",
        "unscale_for_scaler",
        "drop_grad_factors",
    }
    assert StepDriver.__abstractmethods__ == {"step"}
    with pytest.raises(TypeError):
        ShardOwner()  # type: ignore[abstract]


@world(2)
def test_a_shard_owner_gets_every_call_and_the_optimizer_frees_its_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)).to(torch.bfloat16)
    opt = ShardedOptimizer(
        model.parameters(), optim=torch.optim.AdamW, lr=0.5, master_dtype=torch.float32
    )
    assert isinstance(opt.shard_layout, ShardLayout)
    assert opt.shard_layout.params == tuple(model.parameters())
    # Nothing of ZeRO-1's backend exists before its first use ([Note: Nothing built for a
    # hand-over]); used once (``opt.optim``), its flat buffers and fp32 masters are alive ...
    assert opt._local is None
    assert isinstance(opt.optim, torch.optim.AdamW)
    for p in model.parameters():  # a ShardOwner re-points params into its own buffers
        p.data = p.data.clone()
    before = set(live_storages())
    owner = _RecordingOwner(opt)
    opt.attach_driver(owner)
    after = set(live_storages())
    assert len(before - after) >= 2, "the flat buffers and the masters should be freed"
    assert opt.driver is owner and opt._local is None and not opt.state
    with pytest.raises(AttributeError, match="no 'optim' while the recording owner holds"):
        opt.optim
    # ... and every call reaches the owner.
    assert opt.step(lambda: 7.0) == 7.0
    opt.zero_grad(set_to_none=False)
    assert float(opt.clip_grad_norm(1.0, 2.0)) == 1.5
    opt.consolidate_state_dict(0)
    sd = opt.state_dict()  # every rank holds it: the owner assembles it on every rank
    assert sd["param_groups"][0]["lr"] == 0.5
    assert opt.state_dict(all_ranks=True)["state"][0]["step"].item() == 3.0
    opt.load_state_dict({"state": {}, "param_groups": [{"lr": 0.25, "params": [0, 1, 2, 3]}]})
    assert opt.param_groups[0]["lr"] == 0.25
    assert opt.local_state_dict() == {"state": {}, "param_groups": []}
    opt._unscale_for_scaler(torch.tensor(0.5))
    opt._drop_grad_factors()
    names = [c[0] for c in owner.calls]
    assert names == [
        "step",
        "zero_grad",
        "clip",
        "full",
        "full",
        "load",
        "checkpoint",
        "unscale",
        "drop",
    ], names
    # Re-partitioning is refused while an owner holds the state, on every rank alike.
    for name in ("set_partition", "refresh_trainable", "add_param_group"):
        with pytest.raises(AttributeError, match=f"no '{name}' while the recording owner"):
            getattr(opt, name)
    with pytest.raises(RuntimeError, match="cannot be detached"):
        opt.detach_driver()
    dist.barrier()
