"""``GradBucket``: gradients as views of one flat buffer, with check-in state for hooks."""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
from shardkit.buckets._base import _align_up, _FlatBucket, _is_slot_view
from shardkit.buckets._validation import (
    _check_dtype,
    _check_flat_candidate,
    _check_int,
    _check_name,
    _describe,
)

__all__ = ["GradBucket"]

logger = logging.getLogger("shardkit.buckets")
_logged_copied_grads = False


def _allowed_grad_dtype(param: torch.Tensor) -> torch.dtype | None:
    """dtype autograd accepts for ``param.grad`` (``None``: any).

    ``Tensor.grad_dtype`` exists in recent torch; before it, a grad had to match its param.
    """
    allowed: torch.dtype | None = getattr(param, "grad_dtype", param.dtype)
    return allowed


# [Note: Grad views and autograd]
# Once ``p.grad`` is a defined tensor, autograd's AccumulateGrad adds each new gradient into it
# in place (``grad += new``) instead of allocating, so after ``add_grad(p)`` every backward
# accumulates straight into the bucket's buffer. This holds only while ``p.grad`` *is* the view:
#   * ``optimizer.zero_grad(set_to_none=True)`` (the default since torch 2.0) sets
#     ``p.grad = None``; the next backward then allocates a fresh, unrelated tensor. Either
#     zero with ``GradBucket.zero_()`` (one fill of the buffer, views kept) or
#     ``zero_grad(set_to_none=False)``, or call ``reattach()`` after the fresh grads exist (it
#     copies them into their slots and re-points ``p.grad``; cost: one copy per param).
#   * ``collapse()`` drops the views (``p.grad = None``) so the memory can actually be freed;
#     ``rebuild()`` restores zeroed views and keeps any grad produced in between.
#   * backward with ``create_graph=True`` replaces grads out of place (autograd's rule), which
#     also detaches them.
# ``attached`` tells whether every param's grad is still its view; see [Note: Bucket views].


class GradBucket(_FlatBucket):
    """A flat buffer whose slots are the ``.grad`` of a set of parameters.

    ``add_grad(p)`` makes ``p.grad`` a view of the next slot, so backward accumulates
    straight into ``buffer`` and one collective on ``buffer`` reduces every grad in it. For
    reduce hooks the bucket counts params *checked in* (``check_in(p)``, e.g. from
    ``register_post_accumulate_grad_hook``) and reports ``full`` when all are in.

    Args:
        size: Capacity in elements.
        dtype: dtype of the buffer. Each param's allowed grad dtype (``p.grad_dtype``, by
            default ``p.dtype``) must equal it; set ``p.grad_dtype = torch.float32`` on a bf16
            param to accumulate its grads in an fp32 bucket.
        device: Device of the buffer; params must live on it.
        destination: Rank that receives this bucket's reduction (``dist.reduce(...,
            dst=destination)``), or ``None`` when every rank gets it (all-reduce).
        alignment: Each slot starts at a multiple of this many elements (default 1).
        pad_to_multiple: ``buffer.numel()`` is ``size`` rounded up to a multiple of this (use
            the world size for reduce-scatter).

    See [Note: Grad views and autograd] for what keeps ``p.grad`` a view.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: torch.device | str | int,
        destination: int | None = None,
        *,
        alignment: int = 1,
        pad_to_multiple: int = 1,
    ) -> None:
        dtype = _check_dtype(dtype, "GradBucket: dtype")
        if not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(
                f"GradBucket: dtype must be a floating point or complex dtype (gradients); got "
                f"{dtype}."
            )
        super().__init__(size, dtype, device, alignment=alignment, pad_to_multiple=pad_to_multiple)
        if destination is not None:
            destination = _check_int(destination, "GradBucket: destination (a rank)", minimum=0)
        self._destination = destination
        self._collapsed = False
        self._checked_in: list[bool] = []
        self._num_checked_in = 0

    # ------------------------------------------------------------------ state
    @property
    def destination(self) -> int | None:
        """Rank receiving this bucket's reduction, or ``None`` for all ranks."""
        return self._destination

    @property
    def collapsed(self) -> bool:
        """Whether the buffer is released (between ``collapse()`` and ``rebuild()``)."""
        return self._collapsed

    @property
    def params_checked_in(self) -> int:
        """How many registered params were checked in since the last ``reset_checked_in()``."""
        return self._num_checked_in

    @property
    def full(self) -> bool:
        """Whether every registered param is checked in (vacuously true when empty)."""
        return self._num_checked_in == len(self._params)

    @property
    def attached(self) -> bool:
        """Whether every registered param's ``.grad`` is still the view of its slot.

        ``False`` while collapsed, after ``zero_grad(set_to_none=True)``, or after
        ``to(keep_param_alignment=False)``; ``reattach()`` fixes it.
        """
        if self._collapsed:
            return False
        return all(
            _is_slot_view(p.grad, self._buffer, off, p.shape)
            for p, off in zip(self._params, self._offsets, strict=True)
        )

    # ------------------------------------------------------------------ registration
    @torch.no_grad()
    def add_grad(self, param: torch.Tensor, *, name: str | None = None) -> None:
        """Make ``param.grad`` a view of the next slot.

        An existing ``param.grad`` is copied into the slot (no accumulated value is lost); if
        ``param.grad`` is ``None`` the slot is zero.

        Args:
            param: A dense, contiguous leaf tensor with ``requires_grad=True`` on the bucket's
                device whose allowed grad dtype is the bucket's dtype.
            name: Optional name used in error messages.

        Raises:
            TypeError: ``param`` is not a tensor, or its grad dtype differs from the bucket's.
            ValueError: ``param`` does not require grad, is sparse, non-contiguous, not a
                leaf, on another device, already in the bucket, or does not fit.
            RuntimeError: The bucket is collapsed.
        """
        what = "GradBucket.add_grad"
        name = _check_name(name)
        param = _check_flat_candidate(param, name, what=what)
        if self._collapsed:
            raise RuntimeError(f"{what}: the bucket is collapsed; call rebuild() first.")
        if not param.requires_grad:
            raise ValueError(
                f"{what}: {_describe(param, name)} has requires_grad=False, so autograd never "
                f"writes its grad; leave frozen params out of grad buckets (e.g. "
                f"`[p for p in model.parameters() if p.requires_grad]`)."
            )
        self._check_param_matches(param, name, self.dtype, self.device, what)
        offset = self._reserve(param, name, what)
        view = self._buffer.narrow(0, offset, param.numel()).view(param.shape)
        self._copy_into(view, param, name, what)
        param.grad = view
        self._commit(param, name, offset)
        self._checked_in.append(False)

    # ------------------------------------------------------------------ check-in
    def check_in(self, param: torch.Tensor) -> bool:
        """Record that ``param``'s grad is ready; return ``True`` if the bucket is now full.

        Meant for ``param.register_post_accumulate_grad_hook``: when it returns ``True`` the
        whole bucket can be reduced.

        Raises:
            ValueError: ``param`` is not in this bucket.
            RuntimeError: ``param`` was already checked in since the last
                ``reset_checked_in()``, or the bucket is collapsed.
        """
        idx = self.index(param)
        if self._collapsed:
            raise RuntimeError(
                "GradBucket.check_in: the bucket is collapsed; call rebuild() before backward."
            )
        if self._checked_in[idx]:
            raise RuntimeError(
                f"GradBucket.check_in: {self._label(idx)} was already checked in "
                f"({self._num_checked_in}/{len(self._params)} in); call reset_checked_in() "
                f"after each reduction (e.g. before the next backward when accumulating)."
            )
        self._checked_in[idx] = True
        self._num_checked_in += 1
        return self._num_checked_in == len(self._params)

    def reset_checked_in(self) -> None:
        """Forget all check-ins (start of the next backward)."""
        self._checked_in = [False] * len(self._params)
        self._num_checked_in = 0

    # ------------------------------------------------------------------ buffer lifecycle
    @torch.no_grad()
    def zero_(self) -> GradBucket:
        """Zero every grad with one fill of the buffer (views are kept). No-op when collapsed.

        Returns:
            ``self``.
        """
        if not self._collapsed:
            self._buffer.zero_()
        return self

    @torch.no_grad()
    def collapse(self) -> None:
        """Release the buffer's memory; the bucket needs ``rebuild()`` before the next backward.

        Every param whose ``.grad`` is still its view gets ``p.grad = None`` (the values are
        dropped), so nothing the bucket knows about keeps the storage alive. Grads the user
        replaced are left alone (``rebuild()`` will copy them in). Check-ins are reset.

        Warns:
            ResourceWarning: Some other tensor still views the buffer (e.g. ``g = p.grad``
                kept around), so the memory is only freed when that reference goes.
        """
        if self._collapsed:
            return
        old = self._buffer
        for idx, param in enumerate(self._params):
            if _is_slot_view(param.grad, old, self._offsets[idx], param.shape):
                param.grad = None
        self._buffer = torch.empty(0, dtype=old.dtype, device=old.device)
        self._collapsed = True
        self.reset_checked_in()
        alive = weakref.ref(old)
        del old
        # Views keep their base alive (``view._base``), so a live base means a live view.
        if alive() is not None and self._size > 0:
            warnings.warn(
                f"GradBucket.collapse(): the buffer ({self._size} x {self.dtype}) is still "
                f"referenced elsewhere (a view such as a saved p.grad), so its memory is not "
                f"freed until that reference is dropped.",
                ResourceWarning,
                stacklevel=2,
            )

    @torch.no_grad()
    def rebuild(self) -> None:
        """Allocate a zeroed buffer again and re-attach every grad view (no-op if not collapsed).

        A param that got a ``.grad`` while collapsed has it copied into its slot.
        """
        if not self._collapsed:
            return
        self._buffer = torch.zeros(
            _align_up(self._size, self._pad_to_multiple), dtype=self.dtype, device=self.device
        )
        self._collapsed = False
        self._attach_all(previous=None)

    @torch.no_grad()
    def reattach(self) -> None:
        """Make every registered param's ``.grad`` the view of its slot again.

        * ``p.grad is None`` (after ``zero_grad(set_to_none=True)``): its slot is zeroed and
          ``p.grad`` becomes the view.
        * ``p.grad`` is another tensor (a backward ran after ``set_to_none``): its value is
          copied into the slot, then ``p.grad`` becomes the view.
        * ``p.grad`` is already the view: untouched.

        Raises:
            RuntimeError: The bucket is collapsed (use ``rebuild()``).
        """
        if self._collapsed:
            raise RuntimeError("GradBucket.reattach: the bucket is collapsed; call rebuild().")
        self._attach_all(previous=self._buffer)

    @torch.no_grad()
    def to(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> GradBucket:
        """Move and/or cast the whole buffer (one copy) and re-point the grads.

        On a collapsed bucket this only changes where ``rebuild()`` will allocate.

        Args:
            device: Target device; ``None`` keeps the current one.
            dtype: Target dtype; ``None`` keeps the current one.
            non_blocking: Passed to ``Tensor.to``.
            keep_param_alignment: If ``True`` (default) every ``p.grad`` becomes the view of
                the new buffer (params must accept grads of that dtype/device). If ``False``
                the grads keep their current tensors and the bucket is detached from them
                (``attached`` is ``False``) until ``reattach()``, which copies them back in.

        Returns:
            ``self``.

        Raises:
            ValueError: With ``keep_param_alignment=True``, a param cannot take a grad of the
                target dtype or device.
        """
        probe = self._target_probe(device, dtype, keep_param_alignment)
        if keep_param_alignment:
            for idx, param in enumerate(self._params):
                self._check_param_matches(
                    param, self._names[idx], probe.dtype, probe.device, "GradBucket.to"
                )
        if self._collapsed:
            self._buffer = probe
            return self
        old = self._buffer
        self._buffer = old.to(device=probe.device, dtype=probe.dtype, non_blocking=non_blocking)
        if keep_param_alignment:
            self._attach_all(previous=old)
        return self

    # ------------------------------------------------------------------ helpers
    def _attach_all(self, previous: torch.Tensor | None) -> None:
        """Point every ``p.grad`` at its slot of ``self._buffer``.

        Grads that are views of ``previous`` at the same slot already have their values in
        ``self._buffer`` (same buffer, or a copy of it made by ``to()``); ``None`` grads get a
        zeroed slot; any other grad is copied in. See [Note: Grad views and autograd].
        """
        global _logged_copied_grads
        buffer = self._buffer
        copied = []
        for idx, param in enumerate(self._params):
            grad = param.grad
            offset = self._offsets[idx]
            if _is_slot_view(grad, buffer, offset, param.shape):
                continue
            view = self._view(buffer, idx)
            if previous is not None and _is_slot_view(grad, previous, offset, param.shape):
                pass
            elif grad is None:
                view.zero_()
            else:
                self._copy_into(view, param, self._names[idx], "GradBucket.reattach")
                copied.append(self._label(idx))
            param.grad = view
        if copied and not _logged_copied_grads:
            _logged_copied_grads = True
            logger.info(
                "GradBucket: %d grad(s) were not views of the bucket (replaced since they were "
                "attached, e.g. by assigning p.grad) and were copied back into it: %s (logged "
                "once; each such grad costs a copy and twice its memory until then)",
                len(copied),
                ", ".join(copied[:5]) + (" ..." if len(copied) > 5 else ""),
            )

    @staticmethod
    def _check_param_matches(
        param: torch.Tensor,
        name: str | None,
        dtype: torch.dtype,
        device: torch.device,
        what: str,
    ) -> None:
        allowed = _allowed_grad_dtype(param)
        if allowed is not None and allowed != dtype:
            raise TypeError(
                f"{what}: {_describe(param, name)} takes grads of dtype {allowed} but the "
                f"bucket holds {dtype}; use a bucket of dtype {allowed}, or set "
                f"`param.grad_dtype = {dtype}` to accumulate its grads in {dtype}."
            )
        if param.device != device:
            raise ValueError(
                f"{what}: {_describe(param, name)} is on {param.device} but the bucket is on "
                f"{device}; a grad must live on its param's device."
            )

    @staticmethod
    def _copy_into(view: torch.Tensor, param: torch.Tensor, name: str | None, what: str) -> None:
        """Copy ``param.grad`` (if any) into ``view``, else zero ``view``."""
        grad = param.grad
        if grad is None:
            view.zero_()
            return
        if grad.layout != torch.strided:
            raise ValueError(
                f"{what}: {_describe(param, name)} has a {grad.layout} grad; a flat bucket "
                f"holds dense grads only. Use dense gradients (e.g. nn.Embedding(sparse=False))."
            )
        if grad.shape != param.shape:
            raise ValueError(
                f"{what}: {_describe(param, name)} has a grad of shape {tuple(grad.shape)}; "
                f"expected {tuple(param.shape)}."
            )
        view.copy_(grad)
