"""``ShardedDataParallel``'s options as data: one frozen, validated config.

The wrapper builds it from its keyword arguments (or takes one as ``config=``), validates it
once here, and hands it to its collaborators (the bucket groups, the backward pass) when it
builds them; none of them is configured after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from shardkit.ddp._checks import cap_bytes, reduce_dtype_of
from shardkit.optim import WIRE_FORMATS, BlockFormat

__all__ = ["ShardedDataParallelConfig"]


@dataclass(frozen=True)
class ShardedDataParallelConfig:
    """The options of :class:`~shardkit.ddp.ShardedDataParallel` (its keyword arguments).

    Validated at construction (``TypeError`` / ``ValueError`` with the argument's name and the
    fix); see the wrapper's docstring for what each option does in context.
    """

    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers before every training forward, like DDP."""
    sync_models_at_startup: bool = True
    """Broadcast rank 0's params and buffers when the wrapper is built."""
    reduce_buffer_size: int | None = None
    """fairscale's bucket size in elements (fp32, 4 bytes each); ``None`` uses
    ``bucket_cap_mb``; ``0`` puts every param in its own bucket."""
    auto_refresh_trainable: bool = True
    """Rebuild the bucket layout at the next training forward after ``requires_grad``
    changed (fairscale's behaviour); ``False``: call ``refresh_trainable()`` yourself."""
    reduce_fp16: bool = False
    """fairscale's flag: ``True`` is ``reduce_dtype=torch.float16``."""
    warn_on_trainable_params_changed: bool = True
    """Accepted for fairscale compatibility."""
    bucket_cap_mb: float = 25.0
    """Bucket cap in MiB (DDP's default 25)."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket of each param group (DDP's 1), so the first reduction starts
    early in backward."""
    elementwise: bool | None = None
    """``None``: fragment buckets for ``ELEMENTWISE_OPTIMIZERS``, whole params otherwise;
    ``True`` / ``False`` forces one way."""
    overlap_param_gather: bool = True
    """Leave the param all-gathers of ``step()`` in flight until the next forward needs them
    (see [Note: Deferred param gather] in ``shardkit.optim._gather``)."""
    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are staged and reduce-scattered in (``None``: each bucket's own);
    see [Note: Reduce dtype] in ``shardkit.optim._reducer``."""
    keep_staging_buffers: bool = True
    """Keep the staging pool between steps (see [Note: Staging lifetime] in
    ``shardkit.optim._reducer``)."""
    gradient_as_bucket_view: bool = False
    """Let backward accumulate gradients straight into the staging buffers (see [Note:
    Gradients as bucket views] in ``shardkit.optim._reducer``)."""

    wire: str | BlockFormat = "exact"
    """How gradients travel, and params too unless ``wire_params`` says otherwise:
    ``"exact"`` (the bucket's dtype or ``reduce_dtype``), ``"int8"`` / ``"int4"`` (block
    quantized; gradients by one all-to-all per bucket, params as weight deltas), or a
    ``shardkit.optim.BlockFormat`` (block size, stochastic rounding). See [Note: Quantized
    reduce-scatter] and [Note: Weight deltas] in ``shardkit.optim._wire``."""
    wire_params: str | BlockFormat | None = None
    """How the param all-gather travels: ``None`` follows ``wire``; ``"exact"``, ``"int8"``,
    ``"int4"`` or a ``BlockFormat`` choose for params alone."""

    def __post_init__(self) -> None:
        reduce_dtype_of(self.reduce_fp16, self.reduce_dtype)
        wire_format(self.wire, "wire")
        if self.wire_params is not None:
            wire_format(self.wire_params, "wire_params")
        if self.grad_wire is not None and self.wire_dtype is not None:
            raise ValueError(
                f"wire={self.grad_wire.name!r} quantizes the gradients on the wire and "
                f"reduce_dtype={self.wire_dtype} casts them: the two do not compose. Drop "
                f"reduce_dtype / reduce_fp16, or keep the exact wire (wire='exact', "
                f"wire_params='int8' quantizes the params alone)"
            )
        for name in ("keep_staging_buffers", "gradient_as_bucket_view"):
            flag = getattr(self, name)
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{name} must be a bool, got {type(flag).__name__}: {flag!r}; pass True or "
                    f"False"
                )
        if self.elementwise is not None and not isinstance(self.elementwise, bool):
            raise TypeError(f"elementwise must be None or a bool, got {self.elementwise!r}")
        cap_bytes(self.reduce_buffer_size, self.bucket_cap_mb, "bucket_cap_mb")
        cap_bytes(None, self.first_bucket_cap_mb, "first_bucket_cap_mb")
        if not isinstance(self.overlap_param_gather, bool):
            raise TypeError(
                f"overlap_param_gather must be a bool, got {self.overlap_param_gather!r}"
            )
        object.__setattr__(self, "broadcast_buffers", bool(self.broadcast_buffers))

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The reduce dtype in effect (``reduce_fp16`` resolved); ``None``: each bucket's."""
        return reduce_dtype_of(self.reduce_fp16, self.reduce_dtype)

    @property
    def grad_wire(self) -> BlockFormat | None:
        """The block format of the gradients' reduce-scatter, or ``None`` (exact)."""
        return wire_format(self.wire, "wire")

    @property
    def param_wire(self) -> BlockFormat | None:
        """The block format of the params' all-gather (weight deltas), or ``None`` (exact)."""
        if self.wire_params is None:
            return self.grad_wire
        return wire_format(self.wire_params, "wire_params")

    @property
    def cap_bytes(self) -> int:
        """The bucket cap in bytes."""
        return cap_bytes(self.reduce_buffer_size, self.bucket_cap_mb, "bucket_cap_mb")

    @property
    def first_cap_bytes(self) -> int:
        """The cap of each param group's first bucket in bytes (at most :attr:`cap_bytes`)."""
        return min(self.cap_bytes, cap_bytes(None, self.first_bucket_cap_mb, "first_bucket_cap_mb"))


def wire_format(value: object, name: str) -> BlockFormat | None:
    """The block format a ``wire`` option names (``None`` for ``"exact"``); raises
    ``TypeError`` / ``ValueError`` naming the option and the choices."""
    if isinstance(value, BlockFormat):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be 'exact', 'int8', 'int4' or a shardkit.optim.BlockFormat, got "
            f"{type(value).__name__}: {value!r}"
        )
    if value == "exact":
        return None
    if value not in WIRE_FORMATS:
        raise ValueError(
            f"{name}={value!r} is not a wire format: choose 'exact', "
            f"{', '.join(repr(k) for k in WIRE_FORMATS)} or a shardkit.optim.BlockFormat"
        )
    return WIRE_FORMATS[value]
