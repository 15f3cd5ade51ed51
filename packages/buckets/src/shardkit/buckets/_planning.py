"""``plan_buckets``: DDP-style assignment of params to size-capped flat buckets."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from shardkit.buckets._base import _align_up
from shardkit.buckets._validation import _check_flat_candidate, _check_int

__all__ = ["BucketPlan", "BucketSpec", "plan_buckets"]


@dataclass(frozen=True)
class BucketSpec:
    """One planned bucket: which params go in it and where."""

    indices: tuple[int, ...]
    """Positions of the bucket's params in the sequence given to ``plan_buckets``, in slot
    order (reverse registration order)."""

    offsets: tuple[int, ...]
    """Start offset (in elements) of each param's slot, aligned to the plan's ``alignment``;
    these are exactly the offsets a bucket of the plan's layout assigns when the params are
    added in ``indices`` order."""

    numel: int
    """Elements used: end of the last slot. Pass it as the bucket's ``size``."""

    padded_numel: int
    """``numel`` rounded up to the plan's ``pad_to_multiple``: the bucket's ``buffer.numel()``."""

    dtype: torch.dtype
    """dtype shared by all the bucket's params."""

    device: torch.device
    """Device shared by all the bucket's params."""

    @property
    def nbytes(self) -> int:
        """Bytes of the (padded) buffer."""
        return self.padded_numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class BucketPlan:
    """The result of ``plan_buckets``: an immutable, deterministic bucket layout."""

    buckets: tuple[BucketSpec, ...]
    """Planned buckets, in the order their first param is reached walking the params in
    reverse registration order (roughly the order backward produces grads)."""

    cap_bytes: int
    """Cap of every bucket but the first of each (device, dtype) group."""

    first_bucket_cap_bytes: int
    """Cap of the first bucket of each (device, dtype) group."""

    alignment: int
    """Slot start alignment in elements."""

    pad_to_multiple: int
    """Each bucket's buffer length is a multiple of this."""

    assignment: tuple[tuple[int, int], ...] = field(repr=False)
    """``assignment[i] == (bucket, slot)`` for the i-th param given to ``plan_buckets``."""

    @property
    def bucket_indices(self) -> tuple[tuple[int, ...], ...]:
        """Each bucket's param positions (like DDP's ``bucket_indices``)."""
        return tuple(b.indices for b in self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def bucket_of(self, index: int) -> tuple[int, int]:
        """``(bucket, slot)`` of the ``index``-th param given to ``plan_buckets``."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"bucket_of: index must be an int; got {type(index).__name__}.")
        if not 0 <= index < len(self.assignment):
            raise ValueError(
                f"bucket_of: index {index} is out of range for a plan of "
                f"{len(self.assignment)} params."
            )
        return self.assignment[index]

    def fingerprint(self) -> str:
        """A stable hex digest of the layout (device *types*, not indices, so ranks on
        ``cuda:0`` and ``cuda:1`` agree). Equal plans on every rank <=> equal digests."""
        h = hashlib.sha256()
        h.update(f"{self.alignment}|{self.pad_to_multiple}|".encode())
        for b in self.buckets:
            h.update(
                f"{b.indices}|{b.offsets}|{b.numel}|{b.padded_numel}|{b.dtype}|"
                f"{b.device.type};".encode()
            )
        return h.hexdigest()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass
class _OpenBucket:
    dtype: torch.dtype
    device: torch.device
    first: bool
    indices: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    fill: int = 0


def _unpack(item: object) -> tuple[str | None, object]:
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return item[0], item[1]
    return None, item


def plan_buckets(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    cap_bytes: int,
    first_bucket_cap_bytes: int | None = None,
    *,
    alignment: int = 1,
    pad_to_multiple: int = 1,
) -> BucketPlan:
    """Assign params to size-capped buckets, DDP style.

    Params are walked in *reverse* registration order (backward produces grads roughly in
    that order, so bucket 0 fills first) and grouped by ``(device, dtype)``; each group fills
    its current bucket until adding the next param would exceed the cap, then opens a new
    one. The first bucket of each group uses ``first_bucket_cap_bytes`` (small, so the first
    reduction can start early), later ones ``cap_bytes``. Unlike DDP, a bucket never exceeds
    its cap, except a bucket holding one param that alone is larger than the cap.

    The plan depends only on the params' order, shapes, dtypes and devices, so every rank of
    a data-parallel job computes the same one (``BucketPlan.fingerprint()`` checks it).

    Args:
        params: Tensors (e.g. ``model.parameters()``) or ``(name, tensor)`` pairs (e.g.
            ``model.named_parameters()``; names are used in errors). Each must be a dense,
            contiguous leaf tensor, given once. Filter out what you do not want bucketed
            (for grad buckets: params with ``requires_grad=False``).
        cap_bytes: Bucket cap in bytes (slot alignment gaps count, final padding does not).
        first_bucket_cap_bytes: Cap of the first bucket of each group; ``None`` means
            ``cap_bytes``.
        alignment: Slot start alignment in elements (see ``ParamBucket``).
        pad_to_multiple: Pad each bucket's buffer to a multiple of this (e.g. world size).

    Returns:
        A frozen ``BucketPlan``.

    Raises:
        TypeError: An item is not a tensor / ``(name, tensor)`` pair, or a cap is not an int.
        ValueError: A cap is not positive; a param is sparse, non-contiguous, not a leaf, or
            appears twice.
    """
    cap_bytes = _check_int(cap_bytes, "plan_buckets: cap_bytes", minimum=1)
    first_cap = (
        cap_bytes
        if first_bucket_cap_bytes is None
        else _check_int(first_bucket_cap_bytes, "plan_buckets: first_bucket_cap_bytes", minimum=1)
    )
    alignment = _check_int(alignment, "plan_buckets: alignment", minimum=1)
    pad_to_multiple = _check_int(pad_to_multiple, "plan_buckets: pad_to_multiple", minimum=1)
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "plan_buckets: params must be an iterable of tensors (e.g. model.parameters()); got "
            "a single Tensor. Wrap it in a list."
        )

    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    for position, item in enumerate(params):
        name, obj = _unpack(item)
        label = name if name is not None else f"#{position}"
        tensor = _check_flat_candidate(obj, label, what="plan_buckets")
        first = seen.get(id(tensor))
        if first is not None:
            raise ValueError(
                f"plan_buckets: param {label!r} (position {position}) is the same tensor as "
                f"position {first}; pass each param once (model.parameters() already "
                f"de-duplicates shared params)."
            )
        seen[id(tensor)] = position
        tensors.append(tensor)

    opened: list[_OpenBucket] = []
    current: dict[tuple[torch.device, torch.dtype], _OpenBucket] = {}
    for position in reversed(range(len(tensors))):
        tensor = tensors[position]
        key = (tensor.device, tensor.dtype)
        itemsize = tensor.element_size()
        bucket = current.get(key)
        if bucket is not None:
            offset = _align_up(bucket.fill, alignment)
            limit = first_cap if bucket.first else cap_bytes
            if bucket.indices and (offset + tensor.numel()) * itemsize > limit:
                bucket = None
        if bucket is None:
            bucket = _OpenBucket(tensor.dtype, tensor.device, first=key not in current)
            opened.append(bucket)
            current[key] = bucket
        offset = _align_up(bucket.fill, alignment)
        bucket.indices.append(position)
        bucket.offsets.append(offset)
        bucket.fill = offset + tensor.numel()

    specs = tuple(
        BucketSpec(
            indices=tuple(b.indices),
            offsets=tuple(b.offsets),
            numel=b.fill,
            padded_numel=_align_up(b.fill, pad_to_multiple),
            dtype=b.dtype,
            device=b.device,
        )
        for b in opened
    )
    assignment = [(0, 0)] * len(tensors)
    for bucket_index, spec in enumerate(specs):
        for slot, position in enumerate(spec.indices):
            assignment[position] = (bucket_index, slot)
    return BucketPlan(
        buckets=specs,
        cap_bytes=cap_bytes,
        first_bucket_cap_bytes=first_cap,
        alignment=alignment,
        pad_to_multiple=pad_to_multiple,
        assignment=tuple(assignment),
    )
