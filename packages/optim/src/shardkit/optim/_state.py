"""The global parameter numbering, plain torch optimizer state dicts <-> the local
optimizer's state, keyed by global index, and the local optimizer's Adam moments in one
allocation.

See [Note: Global parameter index] and [Note: Moments in one allocation].
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch
from shardkit.optim._compact import CompactTensor
from shardkit.optim._driver import ShardLayout
from torch.optim import Optimizer

__all__ = [
    "GroupView",
    "allocate_moments",
    "global_index",
    "global_params",
    "group_ranges",
    "numbered_groups",
    "saved_by_index",
    "share_hyperparams",
]


# [Note: Global parameter index]
# A parameter's *global index* is its position when the wrapper's param groups are flattened in
# order, exactly as ``torch.optim.Optimizer.state_dict`` numbers them. It is the key of every
# state entry that leaves this package (consolidated dicts, DCP checkpoints), which is what makes
# those independent of the world size: any partition at any world size maps the same index to the
# same parameter. Owners are ranks of the optimizer's group (see [Note: Rank numbering]).
# Trainable parameters are partitioned by shardkit-partition; frozen ones are never stepped nor
# synchronised, and are given a round-robin owner only so that state they carried from a time they
# were trainable has a home. Every list of the params in that order, every ``id(param) -> global
# index`` map and every group's range of indices is made by this module's functions.


def global_params(param_groups: Iterable[Mapping[str, Any]]) -> list[torch.Tensor]:
    """Every param of ``param_groups``, in global-index order (the groups flattened in order).

    See [Note: Global parameter index]: position ``i`` of the list is the param that a plain
    torch optimizer state dict of these groups names ``i``.

    Args:
        param_groups: An optimizer's ``param_groups`` (dicts with a ``"params"`` list).

    Returns:
        A new list; element ``i`` is the param of global index ``i``.
    """
    return [p for g in param_groups for p in g["params"]]


def global_index(param_groups: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """``id(param) -> global index`` for every param of ``param_groups``.

    See [Note: Global parameter index]. The map is keyed by ``id`` (tensors hash by identity
    too, but comparing them may not); the params must stay alive while it is used.

    Args:
        param_groups: An optimizer's ``param_groups`` (dicts with a ``"params"`` list).

    Returns:
        A new dict over the params of :func:`global_params`.
    """
    return {id(p): i for i, p in enumerate(global_params(param_groups))}


def group_ranges(param_groups: Iterable[Mapping[str, Any]]) -> list[range]:
    """The global indices of each group's params, one range per group, in order."""
    out: list[range] = []
    start = 0
    for g in param_groups:
        out.append(range(start, start + len(g["params"])))
        start += len(g["params"])
    return out


def _hyperparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def numbered_groups(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` as a plain state dict's: deep-copied hyper-parameters (nothing may alias
    them), params numbered by global index (see [Note: Global parameter index])."""
    return [
        {**copy.deepcopy(_hyperparams(g)), "params": list(ids)}
        for g, ids in zip(groups, group_ranges(groups), strict=True)
    ]


def _local_groups(layout: ShardLayout, rank: int, n_groups: int) -> list[list[torch.Tensor]]:
    """The params of each wrapper group owned by ``rank`` (one list per group, maybe empty)."""
    groups: list[list[torch.Tensor]] = [[] for _ in range(n_groups)]
    for i in layout.owned(rank):
        groups[layout.group_index[i]].append(layout.params[i])
    return groups


def _owned_state(
    optim_state: Mapping[torch.Tensor, Any],
    layout: ShardLayout,
    rank: int,
    key: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[int, dict[str, Any]]:
    """Live (not copied) state of this rank's params, keyed by global index.

    ``key`` maps a param to the tensor the optimizer's state is keyed by (its master, see
    [Note: Master weights]); the param itself when ``None``.
    """
    out: dict[int, dict[str, Any]] = {}
    for i in layout.owned(rank):
        p = layout.params[i]
        st = optim_state.get(p if key is None else key(p))
        if st:
            out[i] = dict(st)
    return out


# [Note: Saved param ids]
# A plain torch optimizer state dict names its params in ``param_groups[*]["params"]`` and keys
# ``state`` by those names; ``Optimizer.load_state_dict`` matches them to its own params by
# position (param groups flattened), whatever the names are. ShardedOptimizer writes the global
# indices 0..n-1; torch.distributed.checkpoint.state_dict rewrites them into fully qualified
# param names before saving and hands those back to ``load_state_dict``. Both load the same way:
# a name's position in the flattened saved groups is the global index of the param it belongs to.


def saved_by_index(state_dict: Mapping[str, Any]) -> dict[int, Any]:
    """A validated plain state dict's ``"state"`` keyed by global index: see [Note: Saved param
    ids]."""
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    position = {k: i for i, k in enumerate(saved)}
    return {position[k]: v for k, v in state_dict["state"].items()}


def _validate_plain_state_dict(state_dict: Any, param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Raises if ``state_dict`` is not a plain torch optimizer dict for these param groups."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_state_dict expects a dict with 'state' and 'param_groups' (the format of "
            f"torch.optim.Optimizer.state_dict()), got {type(state_dict).__name__}"
        )
    missing = {"state", "param_groups"} - set(state_dict)
    if missing:
        raise ValueError(
            f"optimizer state dict is missing {sorted(missing)}; got keys {sorted(state_dict)}. "
            f"Pass the dict returned by ShardedOptimizer.state_dict() after "
            f"consolidate_state_dict(), or by a plain torch optimizer's state_dict()."
        )
    saved_groups = state_dict["param_groups"]
    lens = [len(g["params"]) for g in param_groups]
    if not isinstance(saved_groups, Sequence) or isinstance(saved_groups, (str, bytes)):
        raise ValueError(
            f"state dict param groups must be a list of param groups, got "
            f"{type(saved_groups).__name__}: it was saved for a different model or param group "
            f"layout."
        )
    saved_lens = [len(g["params"]) for g in saved_groups]
    if saved_lens != lens:
        raise ValueError(
            f"the state dict's {len(saved_lens)} param groups of sizes {saved_lens} do not hold "
            f"the params of this optimizer's, of sizes {lens}: it was saved for a different model "
            f"or param group layout."
        )
    expected = list(range(sum(lens)))
    flat = [i for g in saved_groups for i in g["params"]]
    # See [Note: Saved param ids]: ints 0..n-1, or unique names (torch.distributed.checkpoint).
    named = not all(isinstance(i, int) for i in flat)
    if named:
        if not all(isinstance(i, str) for i in flat) or len(set(flat)) != len(flat):
            raise ValueError(
                f"state dict param ids must be the ints 0..{len(expected) - 1} or unique names "
                f"(fully qualified param names, as torch.distributed.checkpoint.state_dict "
                f"writes them), in param-group order; got {flat[:10]}"
                f"{'...' if len(flat) > 10 else ''}"
            )
    elif sorted(flat) != expected:
        raise ValueError(
            f"state dict param indices must be 0..{len(expected) - 1} in param-group order, got "
            f"{flat[:10]}{'...' if len(flat) > 10 else ''}"
        )
    position = {key: pos for pos, key in enumerate(flat)}
    params = global_params(param_groups)
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict['state'] must be a dict, got {type(state).__name__}")
    for key, entry in state.items():
        if isinstance(key, bool) or key not in position or named != isinstance(key, str):
            raise ValueError(
                f"state dict has a state entry for param {key!r} ({type(key).__name__}); expected "
                f"one of the param ids of its param_groups ("
                f"{'names' if named else f'int indices in [0, {len(params)})'}). It was saved "
                f"for a different model."
            )
        p = params[position[key]]
        for name, value in dict(entry).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            # As many elements as the param: the same shape, exactly (see [Note: Load
            # validation]); other state (factored statistics) may broadcast against it.
            exact = value.numel() == p.numel()
            if (exact and value.shape != p.shape) or (
                not exact
                and value.dim() == p.dim()
                and any(a != b and a != 1 for a, b in zip(value.shape, p.shape, strict=True))
            ):
                raise ValueError(
                    f"state dict entry {key}[{name!r}] has shape {tuple(value.shape)} but "
                    f"param {key} has shape {tuple(p.shape)}: it was saved for a different "
                    f"model."
                )


def _local_load_dict(
    state_dict: Mapping[str, Any],
    layout: ShardLayout,
    rank: int,
    n_groups: int,
    current: Mapping[torch.Tensor, Any],
) -> dict[str, Any]:
    """The dict to feed the local optimizer's ``load_state_dict``.

    Tensors are cloned so the caller's dict is never aliased by live optimizer state; entries
    whose tensors are ``meta`` placeholders (params skipped at consolidation) keep this rank's
    current state.
    """
    groups = _local_groups(layout, rank, n_groups)
    index = layout.index_of()
    saved_groups = state_dict["param_groups"]
    # The saved dict may number params in any order inside a group: map by position.
    state_in = saved_by_index(state_dict)
    local_state: dict[int, dict[str, Any]] = {}
    local_groups: list[dict[str, Any]] = []
    j = 0
    for gi, params in enumerate(groups):
        ids = []
        for p in params:
            entry = state_in.get(index[id(p)])
            if entry is not None:
                if any(isinstance(v, torch.Tensor) and v.is_meta for v in entry.values()):
                    if current.get(p):
                        local_state[j] = dict(current[p])
                else:
                    local_state[j] = {
                        k: v.detach().clone()
                        if isinstance(v, torch.Tensor)
                        else (v.clone() if isinstance(v, CompactTensor) else v)
                        for k, v in entry.items()
                    }
            ids.append(j)
            j += 1
        local_groups.append({**_hyperparams(saved_groups[gi]), "params": ids})
    return {"state": local_state, "param_groups": local_groups}


# [Note: State truthiness]
# ``opt.state`` is the wrapped optimizer's state: only the params this rank owns. Code written
# for plain optimizers tests it for emptiness to decide whether to run a step first, the same
# on every rank: torch.distributed.checkpoint.state_dict runs a zero-gradient, zero-lr
# ``step()`` when ``not optimizer.state``, to create the state it is about to save or load into.
# A rank owning no stateful param (a frozen or a stateless shard) would take that collective
# step alone and hang. So the state mapping's truth value is one flag every rank agrees on
# without communication: whether this optimizer has stepped or loaded state (both collective)
# since it was built, not whether this rank's own shard is empty.
class _StateFlag:
    """Whether the optimizer has stepped or loaded state; the same on every rank."""

    def __init__(self) -> None:
        self.value = False


# [Note: Optimizer state under ZeRO-2]
# Under ZeRO-2 the optimizer's state is held by its attached ``ShardOwner`` (the bucket group),
# stepped by a local optimizer on this rank's pieces of the params. ``ShardedOptimizer.state``
# then shows that state the way torch's ZeroRedundancyOptimizer shows its local optimizer's:
# keyed by the (whole) param, for each param with a piece on this rank, the live state dict
# of that piece (``exp_avg`` of an element-range piece is 1-D, of a whole param owned here its
# shape; compact moments are shown as stored: codes and scales). It is a read-only live view
# (:class:`_OwnerState`): each access asks the owner, so it follows steps, loads and layout
# rebuilds; writing to a shown tensor in place writes the state; a param with no piece here
# reads as an empty dict, as under ZeRO-1. Its truth value is the flag
# of [Note: State truthiness], like ZeRO-1's. The full state of every param, in plain torch
# format, is the collective ``consolidate_state_dict`` / ``optimizer_state_dict()``.
class _OwnerState(Mapping[torch.Tensor, Any]):
    """``ShardedOptimizer.state`` under a ``ShardOwner``; see [Note: Optimizer state under
    ZeRO-2]."""

    def __init__(self, owner: Any, flag: _StateFlag) -> None:
        self.owner = owner
        self.flag = flag

    def __getitem__(self, param: torch.Tensor) -> Any:
        # a param with no piece here reads as an empty dict, as ZeRO-1's defaultdict shows a
        # param this rank does not own (nothing is stored)
        return self.owner.shard_state().get(param, {})

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.owner.shard_state())

    def __len__(self) -> int:
        return len(self.owner.shard_state())

    def __contains__(self, param: object) -> bool:
        return param in self.owner.shard_state()

    def __bool__(self) -> bool:
        return self.flag.value

    def __repr__(self) -> str:
        return f"ShardState({dict(self.owner.shard_state())!r})"


class _ShardState(defaultdict[torch.Tensor, Any]):
    """The wrapped optimizer's state; truthy iff ``flag`` is set. See [Note: State truthiness]."""

    flag: _StateFlag | None = None

    def __bool__(self) -> bool:
        return self.flag.value if self.flag is not None else len(self) > 0


def _install_state(optim: Any, flag: _StateFlag) -> _ShardState:
    """Replaces ``optim.state`` (a plain dict after its ``load_state_dict``) by a ``_ShardState``."""
    state = optim.state
    if not isinstance(state, _ShardState) or state.flag is not flag:
        state = _ShardState(dict, state)
        state.flag = flag
        optim.state = state
    return state


# [Note: One owner of hyper-parameters]
# The hyper-parameters of a sharded optimizer live in one place: the front's param groups
# (``ShardedOptimizer.param_groups``), which LR schedulers, the user, the state dicts and the
# per-step agreement read and write. The wrapped optimizer that steps this rank's shard
# (ZeRO-1's ``LocalShards.optim``, or a ``ShardStepper``'s under ZeRO-2) holds ``GroupView``
# groups: its own ``"params"`` (the shard) and every other key read from and written to the
# front's group, so nothing is copied in either direction around a step. A scheduler's new lr is
# what the next local step reads, and an optimizer that writes its group inside ``step`` (apex's
# ``FusedAdam`` counts ``group["step"]`` there) writes the front's group, where the next per-step
# agreement sees it. ``Optimizer.load_state_dict`` replaces the groups with plain dicts: the owner
# of the wrapped optimizer calls :func:`share_hyperparams` again after loading.
class GroupView(MutableMapping[str, Any]):
    """A param group of a wrapped optimizer: own ``"params"``, the front group's other keys.

    See [Note: One owner of hyper-parameters].
    """

    def __init__(self, front: dict[str, Any], params: list[torch.Tensor]) -> None:
        self.front = front
        """The front's param group (the one owner of the hyper-parameters)."""
        self.params = params
        """The tensors the wrapped optimizer steps for this group."""

    def __getitem__(self, key: str) -> Any:
        return self.params if key == "params" else self.front[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            self.params = value
        else:
            self.front[key] = value

    def __delitem__(self, key: str) -> None:
        if key == "params":
            raise KeyError("a param group keeps its 'params'")
        del self.front[key]

    def __iter__(self) -> Iterator[str]:
        yield "params"
        yield from (k for k in self.front if k != "params")

    def __len__(self) -> int:
        return 1 + sum(1 for k in self.front if k != "params")

    def __repr__(self) -> str:
        return f"GroupView({len(self.params)} params, {_hyperparams(self.front)!r})"


def share_hyperparams(front_groups: Sequence[dict[str, Any]], optim: Optimizer) -> None:
    """Makes ``optim``'s groups views of ``front_groups`` (one each, in order).

    Keys the wrapped optimizer filled in itself (its defaults) and the front lacks are added to
    the front first; the front's values win otherwise. See [Note: One owner of hyper-parameters].
    """
    views: list[dict[str, Any]] = []
    for front, local in zip(front_groups, optim.param_groups, strict=True):
        for k, v in local.items():
            if k != "params":
                front.setdefault(k, v)
        # Typed as dicts by torch; every access torch makes is through the mapping protocol.
        views.append(cast(dict[str, Any], GroupView(front, list(local["params"]))))
    optim.param_groups = views


# [Note: Moments in one allocation]
# torch's Adam / AdamW create a param's state at its first step, one ``zeros_like`` per moment.
# A rank's stepped tensors are pieces of its grad shards: at world 2 a 16 MiB weight leaves an
# 8 MiB piece, and CUDA's caching allocator serves a request under 10 MiB from a 20 MiB segment
# it splits, or from a split of a freed block of autograd's gradients; the rest of the segment
# stays reserved and mostly unused (measured on an H200: 2.6 bytes per param of the 33.6M-param
# benchmark model reserved and not allocated at world 2, ``max_memory_reserved`` 17.2 against
# an allocated peak of 14.1). So, before the first step of the tensors that have no state yet,
# the stepper makes that state itself, exactly as torch's ``_init_group`` would (the same keys
# in the same order, ``step`` on the device and in the dtype torch picks, zero moments of each
# tensor's shape and dtype), with every moment a view of one zeroed buffer per (device, dtype):
# one allocation, one segment, no split. Only for the exact classes ``torch.optim.Adam`` and
# ``torch.optim.AdamW`` (a subclass may keep other state), groups that are not
# ``differentiable``, real floating contiguous tensors, and, with ``fused=True``, the dtypes
# and devices torch's fused kernels take (torch's own check runs only when it makes the state);
# anything else keeps torch's own initialisation. The values are the same zeros, so every step
# gives the same bits (``tests/test_moments.py`` pins the state against torch's own, for each
# option). A checkpoint load replaces the views with the loaded tensors, as it replaces torch's.
# Alone it does not lower the reserved peak (17.5 -> 17.3 bytes per param: the blocks the
# params left stay cached beside the new one); with the engine's release of those blocks
# ([Note: The parameters' old blocks go back] in ``shardkit.optim._engine``) it falls to 14.9.
# The stepper does this for CUDA tensors only: on CPU, glibc serves torch's lazily made moments
# from the gradient memory it kept after freeing it, and one fresh buffer raised the peak
# resident set (measured with ``bench_memory``, world 2, interleaved runs: 12.75 -> 13.75
# bytes per param fp32, 13.0-13.5 -> 14.0 bf16 + masters).

_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FUSED_DEVICES = ("cpu", "cuda")


def _step_tensor(group: dict[str, Any], device: torch.device) -> torch.Tensor:
    """A new ``step`` as torch's Adam makes it: on the param's device with ``capturable`` or
    ``fused`` (fp32 when fused), else a CPU scalar of the default dtype's precision."""
    if group.get("capturable") or group.get("fused"):
        dtype = torch.float32 if group.get("fused") else _scalar_dtype()
        return torch.zeros((), dtype=dtype, device=device)
    return torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _eligible(group: dict[str, Any], t: torch.Tensor) -> bool:
    if group.get("differentiable") or t.is_complex() or not t.is_floating_point():
        return False
    if not t.is_contiguous() or t.is_sparse or t.numel() == 0:
        return False
    if group.get("fused"):
        return t.dtype in _FUSED_DTYPES and t.device.type in _FUSED_DEVICES
    return True


def allocate_moments(optimizer: Optimizer, tensors: Sequence[torch.Tensor]) -> None:
    """Makes the Adam state of those of ``tensors`` that have none yet, each moment a view of
    one buffer per (device, dtype) ([Note: Moments in one allocation]); a no-op for other
    optimizer classes and for tensors that already have state.

    Args:
        optimizer: The local optimizer (``tensors`` are params of its groups).
        tensors: The tensors about to be stepped (with a gradient this step).
    """
    if type(optimizer) not in _CLASSES:
        return
    wanted = {id(t) for t in tensors if not optimizer.state.get(t)}  # after the first step: none
    if not wanted:
        return
    fresh: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, dict[str, Any]]]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in wanted and _eligible(group, p):
                fresh.setdefault((p.device, p.dtype), []).append((p, group))
    for (device, dtype), items in fresh.items():
        counts = [2 + int(bool(g.get("amsgrad"))) for _, g in items]
        total = sum(p.numel() * c for (p, _), c in zip(items, counts, strict=True))
        flat = torch.zeros(total, dtype=dtype, device=device)
        off = 0
        for (p, group), count in zip(items, counts, strict=True):
            n = p.numel()
            state: dict[str, Any] = {"step": _step_tensor(group, device)}
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[:count]:
                state[key] = flat[off : off + n].view_as(p)
                off += n
            optimizer.state[p] = state
