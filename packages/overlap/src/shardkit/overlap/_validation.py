"""Registration-time checks: everything that could otherwise fail (or hang) mid-training."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim import (
    ShardedOptimizer,
    agree_outcome,
    describe_difference,
    hyperparam_digest,
    hyperparams,
)
from shardkit.partition import all_gather_objects
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
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


def _check_supported(zero: ShardedOptimizer, grad_scaler: Any, max_grad_norm: Any) -> bool:
    """Refuses what would be wrong with a per-bucket step; returns whether the loop must step.

    See [Note: Step placement]: an enabled scaler or global-norm clipping moves the step to the
    loop (exact, not overlapped).
    """
    scaler_on = False
    if grad_scaler is not None:
        if not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler (e.g. "
                f"shardkit.optim.ShardedGradScaler) or None, got "
                f"{type(grad_scaler).__name__}: {grad_scaler!r}"
            )
        scaler_on = grad_scaler.is_enabled()
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
            raise TypeError(
                f"max_grad_norm must be a number or None, got "
                f"{type(max_grad_norm).__name__}: {max_grad_norm!r}"
            )
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
    if zero.broadcast_fp16:
        raise ValueError(
            "ShardedOptimizer(broadcast_fp16=True) is not supported by the overlap hooks: a "
            "receiver's param would hold the fp16 rounding while its owner keeps fp32, and the "
            "hooks sync bucket by bucket while other buckets are still being stepped. Build it "
            "with broadcast_fp16=False."
        )
    if isinstance(zero.optim, torch.optim.LBFGS):
        raise ValueError(
            "torch.optim.LBFGS needs a closure re-evaluating the whole model, which a per-bucket "
            "step inside backward cannot provide; use it without the overlap hooks."
        )
    return scaler_on or max_grad_norm is not None


def _check_reduce_to_owner(reduce_to_owner: Any, hook: Any, loop_step: bool) -> None:
    """Refuses what reduce-to-owner cannot do. See [Note: Reduce to owner]."""
    if not isinstance(reduce_to_owner, bool):
        raise TypeError(
            f"reduce_to_owner must be a bool, got {type(reduce_to_owner).__name__}: "
            f"{reduce_to_owner!r}"
        )
    if not reduce_to_owner:
        return
    if hook is not allreduce_hook:
        raise ValueError(
            f"reduce_to_owner=True replaces the gradient all-reduce by reduces to the owners, "
            f"so it only works with the default allreduce_hook; got hook "
            f"{getattr(hook, '__qualname__', type(hook).__qualname__)}. Pass hook=None "
            f"(register_zero_overlap) or allreduce_hook, or use reduce_to_owner=False with a "
            f"custom hook."
        )
    if loop_step:
        raise ValueError(
            "reduce_to_owner=True cannot be combined with an enabled grad_scaler or "
            "max_grad_norm: the loop step needs every reduced gradient on every rank (inf "
            "check, global norm) but each rank only receives the gradients it owns. Use "
            "reduce_to_owner=False for AMP loss scaling or clipping."
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


def _check_params(ddp_named: list[tuple[str, torch.nn.Parameter]], zero: ShardedOptimizer) -> None:
    zero_params = list(zero.shard_layout.params)
    in_zero = {id(p) for p in zero_params}
    missing = [name for name, p in ddp_named if id(p) not in in_zero]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable DDP param(s) are not in the ShardedOptimizer (first: "
            f"{missing[:5]}); their updates would be lost. Build the optimizer over "
            f"ddp.parameters() (or every trainable param of ddp.module)."
        )
    in_ddp = {id(p) for _, p in ddp_named}
    extra = [i for i, p in enumerate(zero_params) if p.requires_grad and id(p) not in in_ddp]
    if extra:
        shapes = [tuple(zero_params[i].shape) for i in extra[:5]]
        raise ValueError(
            f"{len(extra)} trainable ShardedOptimizer param(s) are not reduced by this DDP "
            f"(global indices {extra[:5]}, shapes {shapes}): the hooks would never step them. "
            f"Give the optimizer exactly the DDP's trainable params, or freeze those params."
        )


def _registration_signature(
    zero: ShardedOptimizer,
    ddp: DistributedDataParallel,
    hook: Callable[..., Any],
    interleaved: bool,
    shard_buckets: bool,
    loop_step: bool,
    reduce_to_owner: bool,
) -> tuple[Any, ...]:
    """What this rank registers; every rank must register the same."""
    return (
        interleaved,
        shard_buckets,
        loop_step,
        reduce_to_owner,
        getattr(hook, "__qualname__", type(hook).__qualname__),
        bool(ddp.find_unused_parameters),
        bool(ddp.static_graph),
        bool(ddp.gradient_as_bucket_view),
        hashlib.sha1(
            repr([(tuple(p.shape), str(p.dtype)) for p in zero.shard_layout.params]).encode()
        ).hexdigest(),
    )


# [Note: Registration agreement]
# Registering the overlap is collective (this agreement, then the repartition), but most of its
# checks are local: argument types, a hook already built on this rank, params or groups of
# ``ddp`` and ``zero`` that differ, unsupported combinations. A rank raising alone would leave
# the others waiting in the next collective until the process group's timeout (30 minutes by
# default). So every local check runs first and its error is kept, then ONE all-gather carries
# each rank's (error, what it registers, digest of the optimizer's hyper-parameters), and every
# rank raises the same error: the first failing rank's (its exception type, its message, the
# rank named), else a disagreement on what is registered, else on the hyper-parameters (lr,
# betas, ... changed on one rank since construction). The collective runs over ``zero.group``
# (``ddp.process_group`` if ``zero`` is not a ShardedOptimizer, the default group if neither
# argument has the right type); with no default group either, the error is raised locally.
# ``register_zero_overlap`` agrees once more, the same way, on the result of
# ``ddp.register_comm_hook``.
def _agreement_group(ddp: Any, zero: Any) -> dist.ProcessGroup | None:
    """The group the registration agrees over. See [Note: Registration agreement]."""
    if isinstance(zero, ShardedOptimizer):
        return zero.group
    if isinstance(ddp, DistributedDataParallel):
        group: dist.ProcessGroup = ddp.process_group
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _agree_registration(
    error: Exception | None,
    zero: ShardedOptimizer | None,
    signature: tuple[Any, ...] | None,
    group: dist.ProcessGroup,
) -> None:
    """The one agreement step of a registration. See [Note: Registration agreement].

    Raises:
        TypeError, ValueError, RuntimeError: some rank's local check failed (the type it
            raised), ranks register different things, or their hyper-parameters differ.
    """
    digest = None
    if error is None and zero is not None:
        digest = hyperparam_digest(zero.param_groups)
    agree_outcome(error, group, "the overlap registration")
    gathered = all_gather_objects((signature, digest), group)
    if any(g[0] != gathered[0][0] for g in gathered):
        detail = ", ".join(f"rank {r}: {g[0]!r}" for r, g in enumerate(gathered))
        raise ValueError(
            f"ranks disagree on the overlap registration (interleaved, shard_buckets, loop step "
            f"(scaler/clipping), reduce_to_owner, hook, "
            f"find_unused_parameters, static_graph, gradient_as_bucket_view, params hash): "
            f"{detail}. Every rank must register the same hook on the same model."
        )
    if zero is not None and any(g[1] != gathered[0][1] for g in gathered):
        groups = all_gather_objects([hyperparams(g) for g in zero.param_groups], group)
        raise ValueError(
            f"ranks disagree on the optimizer's hyper-parameters at overlap registration: "
            f"{describe_difference(groups)}. Every rank must step with the same values; set "
            f"them alike on every rank before registering."
        )
