"""Checks of ``ShardedDataParallel``: arguments, params, the cross-rank agreement on the
module's structure and the bucket plan, and the agreed call names of its collective phases."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim import (
    ShardedOptimizer,
    agree_values,
    global_params,
    register_call,
)
from torch import nn

__all__: list[str] = []

_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# [Note: Wrapper agreements]
# Every collective phase of the wrapper starts with shardkit-optim's bounded call agreement
# (its [Note: Call agreement]), so ranks that are not in the same phase raise on every rank,
# naming the phases, within ``collective_timeout`` (default 30 s), instead of pairing
# mismatched collectives (a Gloo abort) or waiting for the process group's timeout:
# the buffer broadcast before a forward, the first gradient of every synchronised backward
# (which also agrees on how many ``no_sync()`` blocks each rank entered since the last
# reduction), ``reduce()``, ``clip_grad_norm_()``, ``optimizer_state_dict()`` (all but the
# buffer broadcast registered by the engine, shardkit-optim's ``_engine`` and ``_bucket_group``); the step agrees through
# ``ShardedOptimizer.check_step``. Each is one exchange on the c10d store
# (shardkit-optim's [Note: Agreement over the store]): no collective, nothing left pending
# when it raises, so a rank that raised can exit.
FORWARD = register_call("ShardedDataParallel forward (buffer broadcast)")
REFRESH = register_call("ShardedDataParallel.refresh_trainable()")


def optimizers_of(given: object) -> list[ShardedOptimizer]:
    items: list[object] = list(given) if isinstance(given, (list, tuple)) else [given]
    if not items:
        raise ValueError("sharded_optimizer is an empty list: pass at least one ShardedOptimizer")
    opts: list[ShardedOptimizer] = []
    for k, opt in enumerate(items):
        if not isinstance(opt, ShardedOptimizer):
            raise TypeError(
                f"sharded_optimizer[{k}] must be a shardkit.optim.ShardedOptimizer (or OSS), got "
                f"{type(opt).__name__}; wrap the params with ShardedOptimizer(params, optim=...)"
            )
        if opt.driver is not None:
            raise ValueError(
                f"sharded_optimizer[{k}] is already driven by {opt.driver.name}; an optimizer can "
                f"be wrapped by one ShardedDataParallel (or overlap hook) only"
            )
        if opts and opt.group is not opts[0].group:
            raise ValueError(
                f"sharded_optimizer[{k}] shards over another process group than "
                f"sharded_optimizer[0]; build every optimizer with the same group="
            )
        if any(opt is o for o in opts):
            raise ValueError(f"sharded_optimizer[{k}] is given twice")
        opts.append(opt)
    return opts


def reduce_dtype_of(reduce_fp16: object, reduce_dtype: object) -> torch.dtype | None:
    if not isinstance(reduce_fp16, bool):
        raise TypeError(f"reduce_fp16 must be a bool, got {type(reduce_fp16).__name__}")
    if reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES:
        raise ValueError(
            f"reduce_dtype must be None or one of {[str(d) for d in _REDUCE_DTYPES]}, got "
            f"{reduce_dtype!r}"
        )
    if reduce_fp16:
        if reduce_dtype not in (None, torch.float16):
            raise ValueError(
                f"reduce_fp16=True means reduce_dtype=torch.float16, but reduce_dtype="
                f"{reduce_dtype} was given too; pass one of them"
            )
        return torch.float16
    return reduce_dtype if isinstance(reduce_dtype, torch.dtype) else None


def cap_bytes(elements: int | None, mb: float, name: str) -> int:
    if elements is not None:
        if isinstance(elements, bool) or not isinstance(elements, int) or elements < 0:
            raise ValueError(
                f"reduce_buffer_size must be a non-negative int (elements) or None, got "
                f"{type(elements).__name__}: {elements!r}"
            )
        return max(1, elements * 4)
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
        raise ValueError(f"{name} must be a positive number of MiB, got {mb!r}")
    return max(1, int(mb * (1 << 20)))


def check_params(module: nn.Module, per_opt: list[list[dict[str, Any]]]) -> None:
    mine = {id(p) for p in module.parameters()}
    seen: dict[int, int] = {}
    for k, groups in enumerate(per_opt):
        ps = global_params(groups)
        foreign = [i for i, p in enumerate(ps) if id(p) not in mine]
        if foreign:
            raise ValueError(
                f"optimizer {k}'s params {foreign[:5]} (global indices) are not params of the "
                f"module; build the ShardedOptimizer over module.parameters()"
            )
        for i, p in enumerate(ps):
            if id(p) in seen:
                raise ValueError(
                    f"param {i} of optimizer {k} (shape {tuple(p.shape)}) is also in optimizer "
                    f"{seen[id(p)]}; give every param to one optimizer only"
                )
            seen[id(p)] = k
    params = [p for groups in per_opt for p in global_params(groups)]
    given = {id(p) for p in params}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in given]
    if missing:
        raise ValueError(
            f"trainable params {missing[:5]} of the module are in no optimizer: their "
            f"gradients would never be reduced. Pass every trainable param to a "
            f"ShardedOptimizer, or freeze them with requires_grad_(False) first."
        )
    for i, p in enumerate(params):
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(f"param {i} (shape {tuple(p.shape)}) is not contiguous")


def agree_plan(prints: list[str], group: dist.ProcessGroup) -> None:
    agree_values(
        prints,
        group,
        "the gradient bucket plan (fingerprints per param group): build the model, the "
        "optimizer's param groups and ShardedDataParallel's bucket caps identically on every "
        "rank",
    )


def _structure(module: nn.Module) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(kind, name, shape, dtype) of every param and buffer, in registration order."""
    return [
        *(("param", n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()),
        *(("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()),
    ]


def _first_difference(gathered: list[Any]) -> str:
    """The first (kind, name, shape, dtype) that differs between rank 0 and another rank."""
    ref = gathered[0]
    for r, mine in enumerate(gathered[1:], start=1):
        for i in range(max(len(ref), len(mine))):
            a = ref[i] if i < len(ref) else None
            b = mine[i] if i < len(mine) else None
            if a != b:

                def show(x: Any) -> str:
                    return "nothing" if x is None else f"{x[0]} {x[1]!r} {list(x[2])} {x[3]}"

                return (
                    f"entry {i} is {show(a)} on rank 0 but {show(b)} on rank {r} "
                    f"(rank 0 has {len(ref)} params and buffers, rank {r} has {len(mine)})"
                )
    return "the structures differ"


def agree_structure(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Raises ``ValueError`` on every rank if ranks' modules differ in the count, names,
    shapes or dtypes of their params or buffers (torch DDP's own check, with the first
    difference named), before any broadcast could pair mismatched tensors."""
    agree_values(
        _structure(module),
        group,
        "the module's structure (params and buffers: names, shapes, dtypes); build the same "
        "model on every rank. First difference",
        describe=_first_difference,
    )
