"""The public entry points: torch ``ddp_zero_hook``-compatible builders and a one-call helper."""

from __future__ import annotations

from typing import Any

from shardkit.optim import ShardedOptimizer, agree_outcome
from shardkit.overlap._config import OverlapConfig
from shardkit.overlap._overlap import CommHook, ZeroOverlap
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved", "register_zero_overlap"]


def hook_with_zero_step(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ShardedOptimizer,
    shard_buckets: bool = False,
    *,
    reduce_to_owner: bool = False,
) -> ZeroOverlap:
    """Wraps ``hook`` so that the sharded step runs once the last bucket's reduction is launched.

    At the last bucket, for every bucket in order: wait for its reduction (only on ranks owning
    some of its params), step the owned params, broadcast the bucket's params from their owners;
    the steps overlap the reductions still in flight and the broadcasts already issued. Prefer
    it when communication is slow relative to computation. Collective: call it on every rank,
    then ``ddp.register_comm_hook(state, returned_hook)``.

    Args:
        hook: the DDP comm hook doing the reduction (``allreduce_hook``, ``fp16_compress_hook``,
            ``bf16_compress_hook``, ... or your own ``(state, bucket) -> Future``).
        ddp: the model; its trainable params must be exactly ``zero``'s.
        zero: the sharded optimizer, over the same ranks as ``ddp.process_group``.
        shard_buckets: split each DDP bucket across ranks at param boundaries (balance), or
            give whole buckets to ranks (fewer ranks wait per bucket).
        reduce_to_owner: reduce each gradient only to the rank owning its param instead of
            all-reducing it (~2x instead of ~3x the gradient bytes on the wire with the
            broadcasts); ``hook`` must then be ``allreduce_hook`` and a non-owned ``.grad`` is
            zero after backward. See ``OverlapConfig.reduce_to_owner``.

    Returns:
        The hook (a :class:`ZeroOverlap`), also the handle of the training loop.

    Raises:
        TypeError, ValueError, RuntimeError: see :func:`register_zero_overlap`.
    """
    config = OverlapConfig(
        interleaved=False, shard_buckets=shard_buckets, reduce_to_owner=reduce_to_owner
    )
    return ZeroOverlap(hook, ddp, zero, config)


def hook_with_zero_step_interleaved(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ShardedOptimizer,
    shard_buckets: bool = False,
    *,
    reduce_to_owner: bool = False,
) -> ZeroOverlap:
    """Wraps ``hook`` so that each bucket is stepped and broadcast while backward goes on.

    When bucket ``b``'s reduction has been launched, bucket ``b - 2`` (whose reduction has had
    the time of computing two buckets' gradients to complete) is stepped by its owners and
    broadcast; the remaining buckets are handled in the last bucket's hook call (see
    ``[Note: Interleave lag]``). Prefer it when communication
    is fast relative to computation. Collective, like :func:`hook_with_zero_step`, with the
    same arguments (``reduce_to_owner`` included).
    """
    config = OverlapConfig(
        interleaved=True, shard_buckets=shard_buckets, reduce_to_owner=reduce_to_owner
    )
    return ZeroOverlap(hook, ddp, zero, config)


def register_zero_overlap(
    ddp: DistributedDataParallel,
    zero: ShardedOptimizer,
    hook: CommHook | None = None,
    state: Any = None,
    *,
    interleaved: bool = True,
    shard_buckets: bool = False,
    grad_scaler: Any = None,
    max_grad_norm: float | None = None,
    reduce_to_owner: bool = False,
) -> ZeroOverlap:
    """Builds the overlap hook and registers it on ``ddp`` in one call. Collective.

    Args:
        ddp: the DistributedDataParallel model (no comm hook registered yet).
        zero: the ShardedOptimizer over exactly ``ddp``'s trainable params.
        hook: the reduction hook; default ``allreduce_hook`` (average, like plain DDP).
        state: the hook's state (``allreduce_hook``: the process group, or ``None`` for
            ``ddp.process_group``).
        interleaved: :func:`hook_with_zero_step_interleaved` (default) or
            :func:`hook_with_zero_step`.
        shard_buckets: see :func:`hook_with_zero_step`.
        grad_scaler: the AMP scaler the loop uses (``shardkit.optim.ShardedGradScaler`` or any
            ``torch.amp.GradScaler``). When enabled, the hooks only reduce and the step runs in
            the loop, exactly as without hooks (see [Note: Step placement]). ``None``: none.
        max_grad_norm: clip by the global gradient norm before each step; like a scaler this
            moves the step to the loop, where :meth:`ZeroOverlap.step` clips and steps.
        reduce_to_owner: reduce each gradient to its owner only instead of all-reducing it
            (see :func:`hook_with_zero_step`); needs the default hook and no scaler/clipping.

    Returns:
        The registered :class:`ZeroOverlap`; call its ``step()`` (or ``zero.step()``) where the
        loop steps.

    Raises:
        TypeError: wrong argument types.
        ValueError: params or process groups of ``ddp`` and ``zero`` differ, ranks disagree, or
            an unsupported combination (``broadcast_fp16``, LBFGS, ``max_grad_norm <= 0``,
            ``reduce_to_owner`` with a custom hook, a scaler or clipping).
        RuntimeError: a hook was already built for ``ddp`` or ``zero``, or DDP refuses a
            second comm hook.

    Note:
        Every error is raised on every rank of ``zero.group``, within one collective, whichever
        rank found it (see [Note: Registration agreement]). If DDP refused the hook on some
        ranks only, the others keep it registered but closed: it then only reduces, like the
        hook it wraps, and ``zero.step()`` steps as without hooks.
    """
    overlap = ZeroOverlap(
        allreduce_hook if hook is None else hook,
        ddp,
        zero,
        OverlapConfig(
            interleaved=interleaved, shard_buckets=shard_buckets, reduce_to_owner=reduce_to_owner
        ),
        grad_scaler=grad_scaler,
        max_grad_norm=max_grad_norm,
    )
    error: Exception | None = None
    try:
        ddp.register_comm_hook(state, overlap)
    except Exception as exc:
        error = exc
    try:
        # See [Note: Registration agreement]: a rank whose DDP refuses the hook must not leave
        # the others training with theirs.
        agree_outcome(error, overlap.zero.group, "ddp.register_comm_hook")
    except Exception:
        overlap.close()
        raise
    return overlap
