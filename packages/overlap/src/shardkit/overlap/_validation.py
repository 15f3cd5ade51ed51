"""Registration-time checks: everything that could otherwise fail (or hang) mid-training."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer
from torch.nn.parallel import DistributedDataParallel

__all__: list[str] = []


def _check_types(hook: Any, ddp: Any, zero: Any, shard_buckets: Any) -> None:
    if not callable(hook):
        raise TypeError(
            f"hook must be a DDP comm hook, a callable (state, GradBucket) -> Future, e.g. "
            f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook; got "
            f"{type(hook).__name__}: {hook!r}"
        )
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"ddp must be a torch.nn.parallel.DistributedDataParallel, got "
            f"{type(ddp).__name__}. Wrap the model first: ddp = DistributedDataParallel(model)."
        )
    if not isinstance(zero, ShardedOptimizer):
        raise TypeError(
            f"zero must be a shardkit.optim.ShardedOptimizer, got {type(zero).__name__}. Build "
            f"it over the DDP's params: ShardedOptimizer(ddp.parameters(), torch.optim.Adam, "
            f"group=ddp.process_group, lr=...)."
        )
    if not isinstance(shard_buckets, bool):
        raise TypeError(
            f"shard_buckets must be a bool, got {type(shard_buckets).__name__}: {shard_buckets!r}"
        )


def _check_supported(zero: ShardedOptimizer, grad_scaler: Any, max_grad_norm: Any) -> None:
    """Refuses the combinations whose result would be wrong with a per-bucket step."""
    if grad_scaler is not None and getattr(grad_scaler, "is_enabled", lambda: True)():
        raise ValueError(
            f"an enabled gradient scaler ({type(grad_scaler).__name__}) cannot be combined with "
            f"the overlap hooks: the step would run on scaled gradients before the scaler has "
            f"checked every bucket for inf/nan. Use bf16 autocast (no scaler needed), or train "
            f"without the hooks: ShardedGradScaler + ShardedOptimizer.step()."
        )
    if max_grad_norm is not None:
        raise ValueError(
            f"max_grad_norm={max_grad_norm!r}: clipping by the global gradient norm needs every "
            f"gradient before the first bucket is stepped, which defeats the overlap. Train "
            f"without the hooks (ShardedOptimizer.clip_grad_norm + step), or pass "
            f"max_grad_norm=None."
        )
    if zero.broadcast_fp16:
        raise ValueError(
            "ShardedOptimizer(broadcast_fp16=True) is not supported by the overlap hooks (they "
            "broadcast the updated params in their own dtype); build it with "
            "broadcast_fp16=False."
        )
    if isinstance(zero.optim, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS needs a closure re-evaluating the whole model, which a per-bucket "
            "step inside backward cannot provide; use it without the overlap hooks."
        )


def _check_groups(ddp: DistributedDataParallel, zero: ShardedOptimizer) -> None:
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    zero_ranks = dist.get_process_group_ranks(zero.group)
    if ddp_ranks != zero_ranks:
        raise ValueError(
            f"the DDP's process group has global ranks {ddp_ranks} but the ShardedOptimizer's "
            f"has {zero_ranks}: both must shard/reduce over the same ranks. Build it with "
            f"ShardedOptimizer(..., group=ddp.process_group)."
        )


def _check_params(
    ddp_named: list[tuple[str, torch.nn.Parameter]], zero: ShardedOptimizer
) -> None:
    zero_params = list(zero._layout.params)
    in_zero = {id(p) for p in zero_params}
    missing = [name for name, p in ddp_named if id(p) not in in_zero]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable DDP param(s) are not in the ShardedOptimizer (first: "
            f"{missing[:5]}); their updates would be lost. Build the optimizer over "
            f"ddp.parameters() (or every trainable param of ddp.module)."
        )
    in_ddp = {id(p) for _, p in ddp_named}
    extra = [
        i for i, p in enumerate(zero_params) if p.requires_grad and id(p) not in in_ddp
    ]
    if extra:
        shapes = [tuple(zero_params[i].shape) for i in extra[:5]]
        raise ValueError(
            f"{len(extra)} trainable ShardedOptimizer param(s) are not reduced by this DDP "
            f"(global indices {extra[:5]}, shapes {shapes}): the hooks would never step them. "
            f"Give the optimizer exactly the DDP's trainable params, or freeze those params."
        )


def _check_agreement(
    zero: ShardedOptimizer, ddp: DistributedDataParallel, hook: Callable[..., Any],
    interleaved: bool, shard_buckets: bool,
) -> None:
    """All ranks must register the same thing, or all raise (no hang later)."""
    mine = (
        interleaved,
        shard_buckets,
        getattr(hook, "__qualname__", type(hook).__qualname__),
        bool(ddp.find_unused_parameters),
        bool(ddp.static_graph),
        bool(ddp.gradient_as_bucket_view),
        hashlib.sha1(
            repr([(tuple(p.shape), str(p.dtype)) for p in zero._layout.params]).encode()
        ).hexdigest(),
    )
    gathered: list[Any] = [None] * zero.world_size
    dist.all_gather_object(gathered, mine, group=zero.group)
    if any(g != gathered[0] for g in gathered):
        detail = ", ".join(f"rank {r}: {g!r}" for r, g in enumerate(gathered))
        raise ValueError(
            f"ranks disagree on the overlap registration (interleaved, shard_buckets, hook, "
            f"find_unused_parameters, static_graph, gradient_as_bucket_view, params hash): "
            f"{detail}. Every rank must register the same hook on the same model."
        )
