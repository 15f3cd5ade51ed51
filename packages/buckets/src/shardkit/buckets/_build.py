"""Create the buckets a ``BucketPlan`` describes and register its params in them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from shardkit.buckets._base import _FlatBucket
from shardkit.buckets._grad_bucket import GradBucket
from shardkit.buckets._param_bucket import ParamBucket
from shardkit.buckets._planning import BucketPlan, BucketSpec, _unpack

__all__ = ["build_grad_buckets", "build_param_buckets"]

_Params = Sequence[torch.Tensor] | Sequence[tuple[str, torch.Tensor]]


def _planned(params: _Params, plan: BucketPlan, what: str) -> list[tuple[str | None, torch.Tensor]]:
    if not isinstance(plan, BucketPlan):
        raise TypeError(f"{what}: plan must be a BucketPlan; got {type(plan).__name__}.")
    given: object = params
    if isinstance(given, torch.Tensor) or not isinstance(given, Sequence):
        raise TypeError(
            f"{what}: params must be the same list given to plan_buckets; got "
            f"{type(params).__name__}. Materialise generators with list(...) first."
        )
    if len(params) != len(plan.assignment):
        raise ValueError(
            f"{what}: got {len(params)} params but the plan was made for "
            f"{len(plan.assignment)}; pass the same list that was given to plan_buckets."
        )
    items: list[tuple[str | None, torch.Tensor]] = []
    for position, item in enumerate(params):
        name, obj = _unpack(item)
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"{what}: params[{position}] is a {type(obj).__name__}, not a tensor.")
        items.append((name, obj))
    return items


def _check_spec(
    spec: BucketSpec, position: int, name: str | None, tensor: torch.Tensor, what: str
) -> None:
    if tensor.dtype != spec.dtype or tensor.device != spec.device:
        raise ValueError(
            f"{what}: params[{position}] ({name or 'unnamed'}) is ({tensor.dtype}, "
            f"{tensor.device}) but the plan put it in a ({spec.dtype}, {spec.device}) bucket; "
            f"the params changed since plan_buckets ran, so plan again."
        )


def _fill(
    bucket: _FlatBucket,
    spec: BucketSpec,
    items: list[tuple[str | None, torch.Tensor]],
    add: str,
    what: str,
) -> None:
    for position, offset in zip(spec.indices, spec.offsets, strict=True):
        name, tensor = items[position]
        _check_spec(spec, position, name, tensor, what)
        getattr(bucket, add)(tensor, name=name)
        if bucket.offsets[-1] != offset:
            raise ValueError(
                f"{what}: params[{position}] ({name or 'unnamed'}) landed at offset "
                f"{bucket.offsets[-1]} instead of the planned {offset}; the params' sizes "
                f"changed since plan_buckets ran, so plan again."
            )


def build_param_buckets(params: _Params, plan: BucketPlan) -> list[ParamBucket]:
    """One ``ParamBucket`` per planned bucket, with its params added in slot order.

    Args:
        params: The same sequence that was given to ``plan_buckets``.
        plan: The plan.

    Returns:
        The buckets, in ``plan.buckets`` order; every param's ``.data`` is now a view.
    """
    what = "build_param_buckets"
    items = _planned(params, plan, what)
    buckets: list[ParamBucket] = []
    for spec in plan.buckets:
        bucket = ParamBucket(
            spec.numel,
            spec.dtype,
            spec.device,
            alignment=plan.alignment,
            pad_to_multiple=plan.pad_to_multiple,
        )
        _fill(bucket, spec, items, "add_param", what)
        buckets.append(bucket)
    return buckets


def build_grad_buckets(
    params: _Params,
    plan: BucketPlan,
    destinations: Sequence[int | None] | None = None,
) -> list[GradBucket]:
    """One ``GradBucket`` per planned bucket, with its params' grads added in slot order.

    Args:
        params: The same sequence that was given to ``plan_buckets`` (all must require grad).
        plan: The plan.
        destinations: Optional destination rank per bucket (``None`` entries: all-reduce).

    Returns:
        The buckets, in ``plan.buckets`` order; every param's ``.grad`` is now a view.
    """
    what = "build_grad_buckets"
    items = _planned(params, plan, what)
    if destinations is None:
        dests: Sequence[int | None] = [None] * len(plan.buckets)
    else:
        dests = list(destinations)
        if len(dests) != len(plan.buckets):
            raise ValueError(
                f"{what}: got {len(dests)} destinations for {len(plan.buckets)} buckets; pass "
                f"one per bucket, or None."
            )
    buckets: list[GradBucket] = []
    for spec, dest in zip(plan.buckets, dests, strict=True):
        bucket = GradBucket(
            spec.numel,
            spec.dtype,
            spec.device,
            dest,
            alignment=plan.alignment,
            pad_to_multiple=plan.pad_to_multiple,
        )
        _fill(bucket, spec, items, "add_grad", what)
        buckets.append(bucket)
    return buckets
