"""The one place shardkit-optim reads torch internals: registered optimizer step hooks.

``torch.optim.Optimizer`` keeps per-instance step hooks in ``_optimizer_step_pre_hooks`` /
``_optimizer_step_post_hooks`` and global ones in ``torch.optim.optimizer``'s
``_global_optimizer_pre_hooks`` / ``_global_optimizer_post_hooks``; there is no public way to ask
whether any are registered. The cache-blocked step (see ``_blocked.py``) runs the optimizer class
on slice views, which hooks would observe, so it steps aside when any hook exists.
``tests/test_blocked.py::test_step_hooks_are_detected`` pins this.
"""

from __future__ import annotations

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
