"""The one place shardkit-optim reads torch internals.

Registered optimizer step hooks (below) and storage reference counts (``_storage_use_count``).

``torch.optim.Optimizer`` keeps per-instance step hooks in ``_optimizer_step_pre_hooks`` /
``_optimizer_step_post_hooks`` and global ones in ``torch.optim.optimizer``'s
``_global_optimizer_pre_hooks`` / ``_global_optimizer_post_hooks``; there is no public way to ask
whether any are registered. The cache-blocked step (see ``_blocked.py``) runs the optimizer class
on slice views, which hooks would observe, so it steps aside when any hook exists.
``tests/test_blocked.py::test_step_hooks_are_detected`` pins this.

One internal is overridden rather than read: ``torch.amp.GradScaler._unscale_grads_(optimizer,
inv_scale, found_inf, allow_fp16) -> {device: found_inf}``, which ``GradScaler.unscale_`` calls
and whose result becomes the optimizer's found-inf flags. ``ShardedGradScaler`` overrides it to
unscale master-weight gradients in fp32 (see [Note: Master weights]);
``tests/test_master.py::test_grad_scaler_unscale_hook_pin`` pins the call.
"""

from __future__ import annotations

import torch
import torch.optim.optimizer as _optimizer_module
from torch.optim import Optimizer

__all__: list[str] = []


def _has_step_hooks(optim: Optimizer) -> bool:
    """Whether any step pre/post hook (on ``optim`` or global) is registered."""
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        hooks = getattr(optim, name, None)
        if hooks is None or len(hooks):
            return True  # unknown layout: assume hooks
    for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        hooks = getattr(_optimizer_module, name, None)
        if hooks is None or len(hooks):
            return True
    return False


def _storage_use_count(t: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share ``t``'s storage; ``None`` if unknown.

    Reads ``torch._C._storage_Use_Count``, the reference count of the C++ ``StorageImpl``.
    Used by [Note: Copy-on-write consolidation]; ``None`` makes the caller copy instead.
    ``tests/test_consolidate_cow.py::test_storage_use_count_pin`` pins its behaviour.
    """
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    try:
        return int(fn(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return None
