"""Optimizer state dicts of ``ShardedDataParallel``: plain torch format, both ways.

[Note: Optimizer state format]
``full_state_dict`` returns, on every rank, what a plain optimizer of the same class stepping
every param would hold: ``{"state": {global index: {...}}, "param_groups": [...]}`` with global
indices over the sharded optimizer's param groups flattened, plus shardkit-optim's
``"master_params"`` (global index -> master tensor) when ``master_dtype`` is set. That is the
format of ``ShardedOptimizer.state_dict()`` after consolidation, so either loads the other's
dicts, and so does a plain torch optimizer (extra keys are ignored).

A fragment bucket's state tensors (one per key, shaped like the rank's range) are all-gathered
into the bucket's layout and cut per param; scalar state (``step``) is the same for every param
of a fragment bucket, since they are stepped together. Whole-param state travels as objects
from its owner. Loading cuts each rank's range out of the per-param tensors; a fragment bucket
needs the same scalar state for all its params (a dict saved by a plain optimizer whose params
were stepped a different number of times cannot be sharded this way: it raises).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from shardkit.ddp._comm import _all_gather
from shardkit.ddp._layout import _Bucket
from shardkit.ddp._stepper import _Entry, _Stepper, hyperparams
from shardkit.partition import all_gather_objects

__all__: list[str] = []

MASTER_KEY = "master_params"


def _index(param_groups: Sequence[dict[str, Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for g in param_groups:
        for p in g["params"]:
            out[id(p)] = len(out)
    return out


def _groups_with_indices(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out, j = [], 0
    for g in param_groups:
        n = len(g["params"])
        out.append({**copy.deepcopy(hyperparams(g)), "params": list(range(j, j + n))})
        j += n
    return out


def full_state_dict(
    stepper: _Stepper,
    buckets: Sequence[_Bucket],
    param_groups: Sequence[dict[str, Any]],
    group: dist.ProcessGroup,
) -> dict[str, Any]:
    """The plain-torch optimizer state dict, on every rank. Collective.

    See [Note: Optimizer state format].
    """
    index = _index(param_groups)
    world = dist.get_world_size(group)
    local = stepper.local
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    frag = {id(e.bucket): e for e in stepper.all_entries() if e.position < 0}
    # agree on the keys of each fragment bucket's state (equal on every rank by construction)
    keys = {
        b.index: sorted(local.state.get(frag[id(b)].opt, {})) if local is not None else []
        for b in buckets
        if b.elementwise
    }
    all_keys = all_gather_objects(keys, group)
    if any(k != all_keys[0] for k in all_keys):
        raise RuntimeError(
            f"ShardedDataParallel: ranks hold different optimizer state keys per bucket "
            f"({all_keys}); the ranks did not step the same buckets"
        )
    whole: dict[int, dict[str, Any]] = {}
    whole_masters: dict[int, torch.Tensor] = {}
    for b in buckets:
        if not b.elementwise:
            continue
        e = frag[id(b)]
        st = local.state.get(e.opt, {}) if local is not None else {}
        full: dict[str, Any] = {}
        for k in keys[b.index]:
            v = st[k]
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.shard:
                full[k] = _gather(v, world, group)
            else:
                full[k] = v
        mfull = _gather(e.master, world, group) if e.master is not None else None
        for p, off in zip(b.params, b.offsets, strict=True):
            gi = index[id(p)]
            entry = {
                k: (
                    v[off : off + p.numel()].view(p.shape).clone()
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.numel
                    else copy.deepcopy(v)
                )
                for k, v in full.items()
            }
            if entry:
                state[gi] = entry
            if mfull is not None:
                masters[gi] = mfull[off : off + p.numel()].view(p.shape).clone()
    for e in stepper.all_entries():
        if e.position >= 0:
            gi = index[id(e.tensor)]
            if local is not None and local.state.get(e.opt):
                whole[gi] = {
                    k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in local.state[e.opt].items()
                }
            if e.master is not None:
                whole_masters[gi] = e.master.detach().cpu().clone()
    if any(not b.elementwise for b in buckets):
        device = buckets[0].device
        for states, ms in all_gather_objects((whole, whole_masters), group):
            for gi, st in states.items():
                state[gi] = {k: _to(v, device) for k, v in st.items()}
            for gi, m in ms.items():
                masters[gi] = m.to(device)
    out: dict[str, Any] = {
        "state": dict(sorted(state.items())),
        "param_groups": _groups_with_indices(param_groups),
    }
    if stepper.master_dtype is not None:
        out[MASTER_KEY] = dict(sorted(masters.items()))
    return out


def _to(v: Any, device: torch.device) -> Any:
    return v.to(device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v


def _gather(t: torch.Tensor, world: int, group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
    _all_gather(out, t.detach().contiguous(), group=group)
    return out


def load_full_state_dict(
    stepper: _Stepper,
    buckets: Sequence[_Bucket],
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
) -> None:
    """Loads a plain-torch optimizer state dict into this rank's shards (not collective).

    Raises:
        ValueError: the dict does not match the params (group count/sizes, shapes), or a
            fragment bucket's params have different scalar state.
    """
    if (
        not isinstance(state_dict, dict)
        or "state" not in state_dict
        or "param_groups" not in state_dict
    ):
        raise ValueError(
            "load_state_dict expects a plain torch optimizer state dict with 'state' and "
            f"'param_groups' keys, got {type(state_dict).__name__} with keys "
            f"{sorted(state_dict) if isinstance(state_dict, dict) else '-'}"
        )
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in param_groups]
    if [len(g["params"]) for g in saved_groups] != sizes:
        raise ValueError(
            f"the state dict has param groups of sizes {[len(g['params']) for g in saved_groups]}"
            f" but the optimizer's are {sizes}: it was saved for another model or grouping"
        )
    # See [Note: Saved param ids] in shardkit.optim._state: global indices, or the fully
    # qualified names torch.distributed.checkpoint.state_dict writes, matched by position.
    position = {k: i for i, k in enumerate(k for g in saved_groups for k in g["params"])}
    saved_state = {position.get(k, k): v for k, v in state_dict["state"].items()}
    saved_masters = {position.get(k, k): v for k, v in state_dict.get(MASTER_KEY, {}).items()}
    index = _index(param_groups)
    for g, sg in zip(param_groups, saved_groups, strict=True):
        g.update(copy.deepcopy(hyperparams(sg)))
    local = stepper.local
    if local is not None:
        for wg, lg in zip(param_groups, local.param_groups, strict=True):
            lg.update(hyperparams(wg))
    for e in stepper.all_entries():
        b = e.bucket
        if e.position >= 0:
            p = b.params[e.position]
            gi = index[id(p)]
            if local is not None:
                local.state[e.opt] = {
                    k: _like(v, e.opt, k) for k, v in saved_state.get(gi, {}).items()
                }
            _load_master(e, saved_masters.get(gi), None)
            continue
        start, end = b.range_of(stepper.rank)
        entries = [saved_state.get(index[id(p)], {}) for p in b.params]
        new: dict[str, Any] = {}
        for k in sorted({k for st in entries for k in st}):
            values = [st.get(k) for st in entries]
            first = values[0]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                full = torch.zeros(b.numel, dtype=first.dtype, device=e.opt.device)
                for p, off, v in zip(b.params, b.offsets, values, strict=True):
                    if not isinstance(v, torch.Tensor) or v.numel() != p.numel():
                        raise ValueError(
                            f"state of param {index[id(p)]} key {k!r} is {v!r:.80} but a tensor "
                            f"of shape {tuple(p.shape)} was expected"
                        )
                    full[off : off + p.numel()].copy_(v.reshape(-1))
                new[k] = _like(full[start:end].clone(), e.opt, k)
            else:
                if any(_scalar(v) != _scalar(first) for v in values):
                    raise ValueError(
                        f"the params of bucket {b.index} have different {k!r} values "
                        f"({[_scalar(v) for v in values]}); ShardedDataParallel steps a bucket's "
                        f"params together and needs one value per bucket"
                    )
                new[k] = copy.deepcopy(first)
        if local is not None:
            local.state[e.opt] = new
        _load_master(e, None, [saved_masters.get(index[id(p)]) for p in b.params])


def _scalar(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def _like(v: Any, t: torch.Tensor, key: str) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if key == "step" or not v.is_floating_point():
        return v.clone()
    return v.to(device=t.device, dtype=t.dtype).clone()


def _load_master(
    e: _Entry, whole: torch.Tensor | None, parts: list[torch.Tensor | None] | None
) -> None:
    """Master values from the dict, or from the live (just loaded model) values."""
    if e.master is None:
        return
    with torch.no_grad():
        e.master.copy_(e.tensor)
        if whole is not None:
            e.master.copy_(whole.reshape(e.master.shape))
        elif parts is not None and any(v is not None for v in parts):
            b = e.bucket
            full = b.flat.to(e.master.dtype)
            for p, off, v in zip(b.params, b.offsets, parts, strict=True):
                if v is not None:
                    full[off : off + p.numel()].copy_(v.reshape(-1))
            start, end = b.range_of(_rank_of(e))
            e.master.copy_(full[start:end])


def _rank_of(e: _Entry) -> int:
    """The rank whose range ``e`` (a fragment entry) is: from its storage offset."""
    b = e.bucket
    return (e.tensor.storage_offset() - b.flat.storage_offset()) // b.shard


# [Note: DCP sharded checkpoints]
# shardkit-optim's ``save_sharded`` writes ``optimizer.local_state_dict()`` of every rank (per
# rank disjoint global indices, plain per-param state) and ``load_sharded`` reads the indices
# the optimizer names for this rank, then calls ``optimizer.load_state_dict``. Under
# ShardedDataParallel a param's state is split at element ranges across ranks, so the
# optimizer's ``ShardOwner`` (``shardkit.ddp._unit._Unit``) answers both:
#
# - ``checkpoint_state_dict`` is ``checkpoint_shard`` of the full state dict (collective:
#   ``save_sharded`` calls it once on every rank at the same point): rank ``r`` writes the
#   whole-param state of the indices ``i % N == r``, so the checkpoint is the plain format
#   ``load_sharded`` of any ShardedOptimizer reads, at any world size;
# - ``checkpoint_indices`` names every param on every rank (each rank steps a range of every
#   element-wise bucket), so ``load_sharded`` reads the full state on every rank and hands it
#   to ``load_full_state_dict``, which cuts this rank's ranges (not collective).
#
# The cost: every rank reads the whole optimizer state at load time (as ``load_state_dict``
# of a consolidated dict does).
def checkpoint_shard(full: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's part of a full state dict for ``save_sharded`` (indices ``i % world ==
    rank``); see [Note: DCP sharded checkpoints]."""
    out: dict[str, Any] = {
        "state": {i: st for i, st in full["state"].items() if i % world == rank},
        "param_groups": full["param_groups"],
    }
    if MASTER_KEY in full:
        out[MASTER_KEY] = {i: m for i, m in full[MASTER_KEY].items() if i % world == rank}
    return out
