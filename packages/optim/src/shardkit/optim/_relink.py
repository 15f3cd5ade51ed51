"""Params whose storage left their bucket: found before the next step and put back.

[Note: Params that left their bucket]
Under ZeRO-2 every trainable param is a view of its bucket's flat buffer ([Note:
Owner-contiguous buckets] in ``shardkit.optim._flat``): the local step writes the buffer and the
all-gather fills it. Some user code replaces a param's storage instead of writing into it:
``p.data = t``, ``model.double(); model.float()`` (``nn.Module._apply`` sets ``p.data``),
``torch.nn.utils.vector_to_parameters``, ``p.data = p.data.clone()``. The param then reads the
new tensor while the optimizer goes on updating the bucket, and training would silently stop.
Under DDP the same code keeps training: the optimizer holds the same ``Parameter`` object and
steps whatever storage it has.

So at every local step (the check before the step's agreement; the relink after the step has
waited for the param gathers, so nothing writes the bucket), the owner of the buckets checks each param's storage: its ``data_ptr()`` must be
its offset in the flat buffer (one pointer comparison per param, a few microseconds for a
hundred params). A param that moved is *re-linked*: its current values (the user's, as DDP's
optimizer would step them) are copied into its range of the flat buffer and ``p.data`` is set
back to that view, in its bucket's dtype; its ``Parameter`` object, hooks and optimizer state
are untouched, and a master copy (``master_dtype``) takes the new values, as the master of a
param written in place does ([Note: Params written outside the optimizer]). Each relink is
logged once per process. A param whose new storage cannot go back (another shape, dtype or
device: ``model.double()`` without ``.float()`` again, where DDP would train in fp64) makes the
step raise a ``RuntimeError`` on every rank before anything moves (the step's agreement carries
this rank's reason), naming the param, what changed and how to fix it.

The check needs no collective: a replacement that DDP users make on every rank alike is
re-linked on every rank alike. A new ``Parameter`` object in the module
(``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``) is a different
case: the optimizer still holds the old one, under DDP as here. It is refused at the next
training forward with :class:`ParamStorageError` (see ``shardkit.ddp``'s ``forward``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from shardkit.optim._flat import FlatBucket

__all__ = ["ParamStorageError", "refusal", "relink"]

logger = logging.getLogger("shardkit.optim")
_logged = False


class ParamStorageError(RuntimeError):
    """The module of a ``ShardedDataParallel`` holds a new ``Parameter`` object.

    Raised by the next training forward when a wrapped param was replaced by a new object
    (``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``): the optimizer
    holds the old one and would not train the new one (under DDP neither). See [Note: Params
    that left their bucket].
    """


def refusal(moved: Sequence[tuple[FlatBucket, int]], shapes: dict[int, torch.Size]) -> str | None:
    """This rank's reason to refuse the step: a moved param whose new storage its bucket
    cannot hold (another shape, dtype or device), else ``None``. The step's agreement raises
    it on every rank (see [Note: Params that left their bucket])."""
    for b, i in moved:
        p = b.params[i]
        shape = shapes[id(p)]
        if p.shape != shape or p.device != b.device or p.dtype != b.dtype:
            return (
                f"a param wrapped by ShardedDataParallel (bucket {b.index}, position {i}) now "
                f"has shape {tuple(p.shape)}, {p.dtype} on {p.device}; it was laid out as "
                f"shape {tuple(shape)}, {b.dtype} on {b.device}. Its storage was replaced "
                f"(p.data = t, model.to(...), model.double()) by a tensor the bucket cannot "
                f"hold. Replace it with a tensor of the same shape, dtype and device (a dtype "
                f"round trip such as model.double(); model.float() is fine), or build a new "
                f"ShardedOptimizer and ShardedDataParallel around the changed model"
            )
    return None


def relink(
    moved: Sequence[tuple[FlatBucket, int]],
    reseed: Callable[[torch.Tensor], None],
) -> None:
    """Copies each moved param's values into its range of the flat buffer and points it back
    there; ``reseed(param)`` then refreshes its master. See [Note: Params that left their
    bucket].

    Args:
        moved: ``(bucket, position)`` of each moved param (``FlatBucket.moved``), every one
            of which :func:`refusal` accepted.
        reseed: Called with each re-linked param.
    """
    global _logged
    with torch.no_grad():
        for b, i in moved:
            p = b.params[i]
            view = b.flat[b.offsets[i] : b.offsets[i] + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view
            reseed(p)
    if moved and not _logged:
        _logged = True
        logger.info(
            "ShardedDataParallel: %d param(s) whose storage was replaced (p.data = t, a dtype "
            "round trip, vector_to_parameters) were copied back into their buckets before the "
            "step, as DDP would step them ([Note: Params that left their bucket]); logged once",
            len(moved),
        )
