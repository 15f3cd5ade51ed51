"""The options of the ZeRO-2 engine (:class:`EngineOptions`), as the module adapter resolved them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from shardkit.optim._codecs import BlockFormat

__all__ = ["EngineOptions"]


@dataclass(frozen=True)
class EngineOptions:
    """What the ZeRO-2 engine (:class:`~shardkit.optim.Zero2Engine`) needs to know of its
    adapter's options; shardkit-ddp builds one from its ``ShardedDataParallelConfig``."""

    wire_dtype: torch.dtype | None = None
    """The dtype gradients are staged and reduce-scattered in (``None``: each bucket's own);
    see [Note: Reduce dtype] in ``shardkit.optim._reducer``."""
    overlap_param_gather: bool = True
    """Leave the param all-gathers of ``step()`` in flight until the next forward needs them
    (see [Note: Deferred param gather] in ``shardkit.optim._gather``)."""
    keep_staging_buffers: bool = True
    """Keep the staging pool between steps (see [Note: Staging lifetime] in
    ``shardkit.optim._reducer``)."""
    gradient_as_bucket_view: bool = False
    """Let backward accumulate gradients straight into the staging buffers (see [Note:
    Gradients as bucket views] in ``shardkit.optim._reducer``)."""
    grad_wire: BlockFormat | None = None
    """The block format gradients are reduce-scattered in (``None``: exact); see [Note:
    Quantized reduce-scatter] in ``shardkit.optim._wire``."""
    param_wire: BlockFormat | None = None
    """The block format params are all-gathered in, as weight deltas (``None``: exact); see
    [Note: Weight deltas] in ``shardkit.optim._wire``."""

    def __post_init__(self) -> None:
        if self.wire_dtype is not None and not isinstance(self.wire_dtype, torch.dtype):
            raise TypeError(
                f"wire_dtype must be None or a torch.dtype, got {type(self.wire_dtype).__name__}: "
                f"{self.wire_dtype!r}"
            )
        for name in ("grad_wire", "param_wire"):
            fmt = getattr(self, name)
            if fmt is not None and not isinstance(fmt, BlockFormat):
                raise TypeError(
                    f"{name} must be None or a shardkit.optim BlockFormat, got "
                    f"{type(fmt).__name__}: {fmt!r}"
                )
        if self.grad_wire is not None and self.wire_dtype is not None:
            raise ValueError(
                f"grad_wire={self.grad_wire.name} quantizes the gradients on the wire and "
                f"wire_dtype={self.wire_dtype} casts them: choose one (drop reduce_dtype / "
                f"reduce_fp16, or the quantized wire)"
            )
        for name in ("overlap_param_gather", "keep_staging_buffers", "gradient_as_bucket_view"):
            flag = getattr(self, name)
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{name} must be a bool, got {type(flag).__name__}: {flag!r}; pass True or "
                    f"False"
                )
