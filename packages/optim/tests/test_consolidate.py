"""Consolidation internals: the message plan, where the bytes go, odd state, and the MoE pattern.

Every rank trains on the same full batch (no DDP), so the sharded run must match a plain
optimizer in one process bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _optim_testkit import assert_state_equal, train
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.optim import ShardedOptimizer
from shardkit.testing import world
from torch import nn


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 9), nn.ReLU(), nn.Linear(9, 3))


class _Odd(torch.optim.Optimizer):
    """A custom optimizer whose state mixes dtypes, a zero-element tensor and a plain value."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["count"] = torch.zeros((), dtype=torch.int64)
                    st["acc"] = torch.zeros_like(p, dtype=torch.float64)
                    st["empty"] = torch.zeros(0, 3)
                    st["note"] = f"shape {tuple(p.shape)}"
                st["count"] += 1
                st["acc"].add_(p.grad.double())
                p.add_(st["acc"].float(), alpha=-group["lr"])


# ------------------------------------------------------------------ single process


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=0, max_size=30))
def test_plan_covers_in_order_and_respects_limits(sizes: list[int]) -> None:
    import shardkit.optim._consolidate as c

    metas = [(i, "k", (n,), torch.float32, False) for i, n in enumerate(sizes)]
    direct, pack = 4000, 12000  # bytes; float32 -> 1000 / 3000 elements
    old = (c._DIRECT_BYTES, c._PACK_BYTES)
    c._DIRECT_BYTES, c._PACK_BYTES = direct, pack
    try:
        plan = c._plan(metas, 4)
    finally:
        c._DIRECT_BYTES, c._PACK_BYTES = old
    assert [m for msg in plan for m in msg] == metas  # every tensor once, in order
    for msg in plan:
        nbytes = [m[2][0] * 4 for m in msg]
        assert msg, "no empty messages"
        if any(b >= direct for b in nbytes):
            assert len(msg) == 1  # a large tensor travels alone
        else:
            assert sum(nbytes) <= pack


# ------------------------------------------------------------------ multi process


class _Traffic:
    """Records the point-to-point and broadcast calls the consolidation makes on this rank."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (op, peer global rank, numel)
        for name, peer in (
            ("isend", "dst"),
            ("irecv", "src"),
            ("recv", "src"),
            ("broadcast", "src"),
        ):
            real = getattr(dist, name)
            mp.setattr(dist, name, self._wrap(name, peer, real))

    def _wrap(self, name: str, peer: str, real: Any) -> Any:
        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(
                (name, int(kwargs.get(peer, args[0] if args else -1)), tensor.numel())
            )
            return real(tensor, *args, **kwargs)

        return wrapped


def _numel_of(state: dict[int, dict[str, Any]]) -> int:
    return sum(
        v.numel() for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )


@world(3)
def test_tensors_go_only_to_the_recipient_and_match() -> None:
    """Point to point only, each source sends exactly its shard, nobody else receives anything;
    large tensors go straight from live state, small ones in packs; the result is bit-exact."""
    import shardkit.optim._consolidate as c

    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    own = _numel_of(opt.local_state_dict()["state"])
    rank = dist.get_rank()
    with pytest.MonkeyPatch.context() as mp:
        # 9x9 weights (324 B) travel alone, biases and step scalars in 64-byte packs
        mp.setattr(c, "_DIRECT_BYTES", 300)
        mp.setattr(c, "_PACK_BYTES", 64)
        traffic = _Traffic(mp)
        opt.consolidate_state_dict(recipient_rank=1)
    ops = {op for op, _, _ in traffic.calls}
    assert "broadcast" not in ops
    if rank == 1:
        assert ops <= {"irecv"}
        assert sum(n for _, _, n in traffic.calls) == _numel_of(ref.state_dict()["state"]) - own
        assert_state_equal(opt.state_dict(), ref.state_dict())
        assert len(traffic.calls) > 4  # several messages per source: the plan was exercised
    else:
        assert ops <= {"isend"} and {peer for _, peer, _ in traffic.calls} <= {1}
        assert sum(n for _, _, n in traffic.calls) == own  # its shard, nothing more
        with pytest.raises(RuntimeError, match="not been consolidated"):
            opt.state_dict()


@pytest.mark.parametrize(("recipient", "staged"), [(2, False), (-1, False), (0, True), (-1, True)])
@world(3)
def test_mixed_dtypes_empty_tensors_and_plain_values(recipient: int, staged: bool) -> None:
    """``staged`` runs the NCCL-shaped path (receive into a stage, copy to host) on Gloo."""
    import shardkit.optim._consolidate as c

    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = _Odd(ref_model.parameters())
    opt = ShardedOptimizer(model.parameters(), optim=_Odd, lr=0.01)
    train(ref_model, ref, 2)
    train(model, opt, 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(c, "_DIRECT_BYTES", 200)
        mp.setattr(c, "_PACK_BYTES", 100)
        if staged:
            mp.setattr(c, "_receives_in_place", lambda device: False)
        opt.consolidate_state_dict(recipient_rank=recipient)
    if recipient in (-1, dist.get_rank()):
        sd = opt.state_dict()
        assert_state_equal(sd, ref.state_dict())
        # the result is a snapshot: it does not alias live state
        train(model, opt, 1, start=2)
        train(ref_model, ref, 1, start=2)
        assert not torch.equal(sd["state"][0]["acc"], ref.state_dict()["state"][0]["acc"])
    else:
        train(model, opt, 1, start=2)


@world(2)
def test_bad_arguments_on_one_rank_raise_on_every_rank() -> None:
    model = _model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.01, momentum=0.9)
    train(model, opt, 1)
    rank = dist.get_rank()
    if rank == 0:
        with pytest.raises(TypeError, match=r"skip must be a callable.*str: 'experts'"):
            opt.consolidate_state_dict(skip="experts")  # type: ignore[arg-type]
    else:
        # the first failing rank's error type, on every rank
        with pytest.raises(TypeError, match=r"rank 0 .*skip must be"):
            opt.consolidate_state_dict()

    def broken(p: torch.Tensor) -> bool:
        raise KeyError("no such expert")

    with pytest.raises((KeyError, ValueError), match="no such expert"):
        opt.consolidate_state_dict(skip=broken if rank == 1 else None)
    with pytest.raises(ValueError, match="recipient_rank must be"):
        opt.consolidate_state_dict(recipient_rank=5 if rank == 0 else 0)
    opt.consolidate_state_dict(recipient_rank=1)  # still usable afterwards
    if rank == 1:
        assert len(opt.state_dict()["state"]) == 6


@world(2)
def test_moe_experts_in_a_world_size_1_group(tmp_path: Any) -> None:
    """The MoE pattern: dense params sharded over the world, each rank's own experts in a
    ShardedOptimizer over a world-size-1 group. Consolidating the experts is local (rank 1 does
    it alone; any cross-rank communication would hang), the dense state is gathered on rank 0,
    and reloading both continues exactly like an uninterrupted run."""
    rank = dist.get_rank()
    solo, _ = dist.new_subgroups(group_size=1)
    path = tmp_path / f"experts_rank{rank}.pt"  # tmp_path differs per rank only by this name

    def build() -> tuple[nn.Module, nn.Module, ShardedOptimizer, ShardedOptimizer]:
        dense = _model()
        expert = _model(seed=100 + rank)  # experts differ per rank
        d = ShardedOptimizer(dense.parameters(), optim=torch.optim.Adam, lr=0.01)
        e = ShardedOptimizer(expert.parameters(), optim=torch.optim.Adam, lr=0.01, group=solo)
        assert e.world_size == 1
        return dense, expert, d, e

    def train_both(
        parts: tuple[nn.Module, nn.Module, ShardedOptimizer, ShardedOptimizer], n: int, start: int
    ) -> None:
        dense, expert, d, e = parts
        train(dense, d, n, start)
        train(expert, e, n, start)

    ref = build()
    train_both(ref, 4, 0)
    run = build()
    train_both(run, 2, 0)
    dense_sd = run[2].state_dict(all_ranks=True)  # gathered (every rank, to reload below)
    if rank == 1:
        run[3].consolidate_state_dict(recipient_rank=0)  # alone: no other rank participates
        torch.save(run[3].state_dict(), path)
    dist.barrier()
    if rank == 0:
        run[3].consolidate_state_dict(recipient_rank=0)
        torch.save(run[3].state_dict(), path)
    saved_models = (copy.deepcopy(run[0].state_dict()), copy.deepcopy(run[1].state_dict()))
    resumed = build()
    resumed[0].load_state_dict(saved_models[0])
    resumed[1].load_state_dict(saved_models[1])
    resumed[2].load_state_dict(dense_sd)
    resumed[3].load_state_dict(torch.load(path))
    train_both(resumed, 2, 2)
    for m_ref, m_res in ((ref[0], resumed[0]), (ref[1], resumed[1])):
        for a, b in zip(m_ref.parameters(), m_res.parameters(), strict=True):
            assert torch.equal(a, b)


@world(2)
def test_skipped_state_saved_per_rank_round_trips(tmp_path: Any) -> None:
    """The documented recipe: consolidate with skip=, save the skipped state per rank, resume
    by merging each rank's file into the consolidated dict: identical continuation."""
    rank = dist.get_rank()
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(ref_model, ref, 4)
    train(model, opt, 2)
    big = {id(p) for p in model[2].parameters()}  # the middle Linear: global indices 2, 3
    opt.consolidate_state_dict(recipient_rank=0, skip=lambda p: id(p) in big)
    params = [p for g in opt.param_groups for p in g["params"]]
    local = opt.local_state_dict()["state"]
    torch.save(
        {i: st for i, st in local.items() if id(params[i]) in big}, tmp_path / f"skipped{rank}.pt"
    )
    if rank == 0:
        sd = opt.state_dict()
        assert sd["state"].keys() == set(range(6))
        for i in (2, 3):
            assert sd["state"][i]["exp_avg"].shape == params[i].shape
        torch.save(sd, tmp_path / "optim.pt")
    dist.barrier()
    fresh_model = copy.deepcopy(model)
    fresh = ShardedOptimizer(fresh_model.parameters(), optim=torch.optim.Adam, lr=0.01)
    sd = torch.load(tmp_path / "optim.pt")
    sd["state"].update(torch.load(tmp_path / f"skipped{rank}.pt"))
    fresh.load_state_dict(sd)
    train(fresh_model, fresh, 2, start=2)
    for a, b in zip(ref_model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
