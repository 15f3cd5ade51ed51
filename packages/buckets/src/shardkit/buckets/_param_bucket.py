"""``ParamBucket``: parameters as views of one flat buffer."""

from __future__ import annotations

import torch
from shardkit.buckets._base import _FlatBucket, _is_slot_view
from shardkit.buckets._validation import (
    _check_flat_candidate,
    _check_name,
    _describe,
)

__all__ = ["ParamBucket"]


class ParamBucket(_FlatBucket):
    """A flat buffer whose slots back the ``.data`` of a set of parameters.

    ``add_param(p)`` copies ``p``'s current value into the next slot and sets ``p.data`` to a
    view of that slot (see [Note: Bucket views]). Afterwards every in-place update of the
    params (optimizer steps) is an update of ``buffer`` and vice versa, so one collective on
    ``buffer`` (broadcast, all-gather of shards) updates all the params at once.

    Args:
        size: Capacity in elements.
        dtype: dtype of the buffer; every param added must have this dtype.
        device: Device of the buffer; every param added must live on it.
        alignment: Each slot starts at a multiple of this many elements (default 1: packed).
        pad_to_multiple: ``buffer.numel()`` is ``size`` rounded up to a multiple of this
            (use the world size to make the buffer split evenly into per-rank shards).

    Example::

        bucket = ParamBucket(sum(p.numel() for p in model.parameters()), torch.float32, "cpu")
        for p in model.parameters():
            bucket.add_param(p)
        dist.broadcast(bucket.buffer, src=0)  # one call syncs every param
    """

    @torch.no_grad()
    def add_param(self, param: torch.Tensor, *, name: str | None = None) -> None:
        """Copy ``param``'s value into the next slot and make ``param.data`` a view of it.

        Args:
            param: A dense, contiguous leaf tensor (usually an ``nn.Parameter``) with the
                bucket's dtype and device.
            name: Optional name used in error messages (e.g. from ``named_parameters()``).

        Raises:
            TypeError: ``param`` is not a tensor, or its dtype differs from the bucket's.
            ValueError: ``param`` is sparse, non-contiguous, not a leaf, on another device,
                already in the bucket, or does not fit in the remaining capacity.
        """
        what = "ParamBucket.add_param"
        name = _check_name(name)
        param = _check_flat_candidate(param, name, what=what)
        if param.dtype != self.dtype:
            raise TypeError(
                f"{what}: {_describe(param, name)} has dtype {param.dtype} but the bucket holds "
                f"{self.dtype}; put params of each dtype in their own bucket (plan_buckets "
                f"groups them by (device, dtype))."
            )
        if param.device != self.device:
            raise ValueError(
                f"{what}: {_describe(param, name)} is on {param.device} but the bucket is on "
                f"{self.device}; move the param (or create the bucket on its device) first."
            )
        offset = self._reserve(param, name, what)
        view = self._buffer.narrow(0, offset, param.numel()).view(param.shape)
        view.copy_(param)
        param.data = view
        self._commit(param, name, offset)

    @property
    def attached(self) -> bool:
        """Whether every registered param's ``.data`` is still the view of its slot."""
        return all(
            _is_slot_view(p, self._buffer, off, p.shape)
            for p, off in zip(self._params, self._offsets, strict=True)
        )

    @torch.no_grad()
    def reattach(self) -> None:
        """Make every registered param a view of its slot again.

        A param whose ``.data`` was replaced (for example by ``module.to()`` or
        ``to(keep_param_alignment=False)``) has its *current value* copied into its slot
        (cast to the bucket's dtype and moved to its device) before being re-pointed; params
        that are still views are left alone.

        Raises:
            ValueError: Re-pointing would change the dtype or device of a param that has a
                ``.grad`` (the grad would no longer match its param).
        """
        self._check_grads_allow(self._buffer, "ParamBucket.reattach")
        for idx, param in enumerate(self._params):
            if not _is_slot_view(param, self._buffer, self._offsets[idx], param.shape):
                view = self._view(self._buffer, idx)
                view.copy_(param)
                param.data = view

    @torch.no_grad()
    def to(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> ParamBucket:
        """Move and/or cast the whole buffer (one copy), and re-point the params.

        Args:
            device: Target device; ``None`` keeps the current one.
            dtype: Target dtype; ``None`` keeps the current one.
            non_blocking: Passed to ``Tensor.to``.
            keep_param_alignment: If ``True`` (default) every param becomes a view of the new
                buffer, so params and buffer keep sharing storage (and the params change
                device/dtype with it). If ``False`` the params keep their current tensors and
                the bucket is detached from them (``attached`` is ``False``) until
                ``reattach()``, which copies the params' values back in.

        Returns:
            ``self``.

        Raises:
            ValueError: With ``keep_param_alignment=True``, the move would change the dtype or
                device of a param that has a ``.grad``. Set grads to ``None`` first
                (``optimizer.zero_grad(set_to_none=True)``).
        """
        probe = self._target_probe(device, dtype, keep_param_alignment)
        if keep_param_alignment:
            self._check_grads_allow(probe, "ParamBucket.to")
        old = self._buffer
        new = old.to(device=probe.device, dtype=probe.dtype, non_blocking=non_blocking)
        self._buffer = new
        if keep_param_alignment:
            for idx, param in enumerate(self._params):
                if _is_slot_view(param, old, self._offsets[idx], param.shape):
                    param.data = self._view(new, idx)
                else:
                    view = self._view(new, idx)
                    view.copy_(param, non_blocking=non_blocking)
                    param.data = view
        return self

    def _check_grads_allow(self, target: torch.Tensor, what: str) -> None:
        """Raise if re-pointing params to ``target``'s dtype/device would orphan a grad."""
        for idx, param in enumerate(self._params):
            if param.grad is None:
                continue
            if param.device != target.device or param.dtype != target.dtype:
                raise ValueError(
                    f"{what}: {self._label(idx)} has a .grad ({param.grad.dtype}, "
                    f"{param.grad.device}); moving it to ({target.dtype}, {target.device}) would "
                    f"leave the grad on the old dtype/device. Set grads to None first "
                    f"(optimizer.zero_grad(set_to_none=True)), or pass "
                    f"keep_param_alignment=False."
                )
