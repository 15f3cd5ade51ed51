"""Host and device storage of one slice: flat host buffers, device staging, gradients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from shardkit.offload._streams import _Streams
from torch import nn

__all__: list[str] = []


@dataclass
class _Entry:
    """One parameter or buffer of a slice, stored at ``offset`` in its group's flat buffer."""

    name: str
    owner: nn.Module
    attr: str
    offset: int
    numel: int
    shape: torch.Size
    requires_grad: bool
    host_tensor: torch.Tensor  # the module's parameter (a view of the flat host buffer) or buffer
    grad_offset: int  # offset in the group's flat host gradient (-1: no gradient)


@dataclass
class _Group:
    """Parameters (or buffers) of one dtype of a slice, packed in one flat host buffer."""

    is_param: bool
    dtype: torch.dtype
    entries: list[_Entry]
    host: torch.Tensor
    device_flat: torch.Tensor | None = None  # owns the device storage (resized to 0 if evicted)
    device_views: list[torch.Tensor] | None = None
    grad_numel: int = 0  # elements of the parameters that require grad

    @property
    def numel(self) -> int:
        return self.host.numel()


# [Note: Flat storage and staging]
# At construction every parameter and buffer of a slice is moved into a flat buffer per
# (kind, dtype) on the offload device (pinned when the compute device is CUDA) and the
# module's tensors become views into it: `param.data` is re-pointed so parameter identity is
# kept and an optimizer built before or after wrapping steps the host copy in place.
#
# When the compute device differs from the offload device (or `stage_on_same_device` is set,
# which is how CPU tests exercise this path), each group also owns a device flat tensor whose
# storage is resized to 0 while the slice is not resident and back to full size on load (one
# allocation and one copy per group). The tensors the slice computes with are detached views
# of a second tensor sharing that storage, created once: autograd graphs that saved them stay
# valid across evict/reload (the storage object is the same, only its memory comes and goes),
# and since the views do not share a version counter with the tensor the loads copy into,
# reloading does not trip autograd's in-place checks. A use of a non-resident slice reads a
# 0-byte storage and fails loudly instead of reading stale memory.
#
# Otherwise (compute device == offload device, e.g. CPU training) the slice computes with the
# host tensors directly ("aliased"): loads and evictions are bookkeeping only.

# [Note: Streamed gradients]
# A staged slice's backward runs `torch.autograd.backward(..., inputs=...)` into the device
# views' `.grad`, so gradients accumulate over micro-batches on the device as autograd's own
# AccumulateGrad does (same additions in the same order as a plain model). On the last
# micro-batch a post-accumulate-grad hook on each view copies its finished gradient into a
# pinned host buffer on the d2h stream as soon as autograd produces it and drops `.grad`
# (record_stream keeps the block until the copy is done); the hook waits while more than the
# slice's largest gradient is queued (see [Note: Copy stream ordering], point 5). So at most
# two gradients are on the device at once instead of the whole slice's (plus its
# concatenation): device memory in backward is the two resident slices plus two gradients. Views
# that got a gradient without their hook running are flushed the same way at the end. Aliased
# slices use `torch.autograd.grad` and accumulate the micro-batches' results in `_acc`.


class _SliceStore:
    """Parameters and buffers of one slice, on the host and (while resident) on the device."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        offload_device: torch.device,
        staged: bool,
    ) -> None:
        self.module = module
        self.device = device
        self.offload_device = offload_device
        self.staged = staged
        self.pin = device.type == "cuda" and offload_device.type == "cpu"
        self.resident = False
        self.ready: torch.cuda.Event | None = None
        self.groups: list[_Group] = []
        # gradient state of one backward, see [Note: Streamed gradients]
        self._acc: list[torch.Tensor | None] | None = None
        self._streaming: _Streams | None = None
        self._host_flat: dict[int, torch.Tensor] = {}
        self._host_grads: dict[tuple[int, int], torch.Tensor] = {}
        params = list(module.named_parameters())
        buffers = list(module.named_buffers())
        for is_param, named in ((True, params), (False, buffers)):
            dtypes: list[torch.dtype] = []
            for _, t in named:
                if t.dtype not in dtypes:
                    dtypes.append(t.dtype)
            for dtype in dtypes:
                self.groups.append(
                    self._make_group(
                        len(self.groups),
                        is_param,
                        dtype,
                        [(n, t) for n, t in named if t.dtype == dtype],
                    )
                )
        self._largest_grad_bytes = max(
            (
                e.numel * g.host.element_size()
                for g in self.groups
                for e in g.entries
                if e.requires_grad
            ),
            default=0,
        )
        self._leaf_keys = [
            (gi, k)
            for gi, g in enumerate(self.groups)
            if g.is_param
            for k, e in enumerate(g.entries)
            if e.requires_grad
        ]

    def _make_group(
        self, gi: int, is_param: bool, dtype: torch.dtype, named: list[tuple[str, torch.Tensor]]
    ) -> _Group:
        total = sum(t.numel() for _, t in named)
        host = torch.empty(total, dtype=dtype, device=self.offload_device, pin_memory=self.pin)
        entries: list[_Entry] = []
        offset = grad_offset = 0
        for name, t in named:
            owner_name, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            view = host[offset : offset + t.numel()].view(t.shape)
            with torch.no_grad():
                view.copy_(t.detach())
            if is_param:
                t.data = view
                host_tensor = t
            else:
                setattr(owner, attr, view)
                host_tensor = view
            needs_grad = is_param and t.requires_grad
            entries.append(
                _Entry(
                    name,
                    owner,
                    attr,
                    offset,
                    t.numel(),
                    t.shape,
                    needs_grad,
                    host_tensor,
                    grad_offset if needs_grad else -1,
                )
            )
            offset += t.numel()
            grad_offset += t.numel() if needs_grad else 0
        group = _Group(is_param, dtype, entries, host, grad_numel=grad_offset)
        if self.staged:
            flat = torch.empty(total, dtype=dtype, device=self.device)
            flat.untyped_storage().resize_(0)
            alias = torch.empty(0, dtype=dtype, device=self.device).set_(
                flat.untyped_storage(), 0, (total,), (1,)
            )
            views = []
            for k, e in enumerate(entries):
                v = alias[e.offset : e.offset + e.numel].view(e.shape).detach()
                v.requires_grad_(e.requires_grad)
                if e.requires_grad:
                    v.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda _v, gi=gi, k=k: self._on_grad(gi, k)
                    )
                views.append(v)
            group.device_flat = flat
            group.device_views = views
        return group

    # ---------------------------------------------------------------- residency

    def load(self, streams: _Streams) -> None:
        """Copy the slice to the device (asynchronously on CUDA). See [Note: Copy stream ordering]."""
        if self.staged:
            with streams.on_h2d():
                for g in self.groups:
                    assert g.device_flat is not None  # set when staged
                    g.device_flat.untyped_storage().resize_(g.numel * g.host.element_size())
                    g.device_flat.copy_(g.host, non_blocking=True)
                self.ready = streams.record_h2d()
        self.resident = True

    def evict(self, streams: _Streams) -> None:
        """Free the device copy once the compute enqueued so far is done with it."""
        if self.staged:
            for g in self.groups:
                assert g.device_flat is not None  # set when staged
                g.device_flat.untyped_storage().resize_(0)
            streams.evicted()
        self.ready = None
        self.resident = False

    def write_back_buffers(self, streams: _Streams) -> bool:
        """Copy device buffers (possibly updated in place by forward) to the host copy."""
        if not self.staged:
            return False
        wrote = False
        with streams.on_d2h():
            for g in self.groups:
                if not g.is_param and g.device_flat is not None:
                    g.host.copy_(g.device_flat, non_blocking=True)
                    wrote = True
        return wrote

    # ---------------------------------------------------------------- compute

    def call_tensors(self, recompute: bool) -> dict[str, torch.Tensor] | None:
        """Tensors to run the slice with (``functional_call``), or ``None`` to call it as is.

        A recompute must not update buffers a second time (BatchNorm running statistics): aliased
        slices get clones of their buffers, staged ones write nothing back from a recompute.
        """
        if not self.staged:
            if not recompute:
                return None
            return {
                e.name: e.host_tensor.clone()
                for g in self.groups
                if not g.is_param
                for e in g.entries
            }
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            assert g.device_views is not None  # set when staged
            for e, v in zip(g.entries, g.device_views, strict=True):
                out[e.name] = v
        return out

    def grad_leaves(self) -> list[torch.Tensor]:
        """The tensors the slice computes with that gradients are taken with respect to."""
        leaves: list[torch.Tensor] = []
        for g in self.groups:
            if not g.is_param:
                continue
            for k, e in enumerate(g.entries):
                if not e.requires_grad:
                    continue
                if g.device_views is not None:
                    leaves.append(g.device_views[k])
                else:
                    leaves.append(e.host_tensor)
        return leaves

    def host_params(self) -> list[torch.Tensor]:
        """The host parameters that require grad, in :meth:`grad_leaves` order."""
        return [
            e.host_tensor for g in self.groups if g.is_param for e in g.entries if e.requires_grad
        ]

    # ---------------------------------------------------------------- backward

    def backward(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        inputs: Sequence[torch.Tensor],
        streams: _Streams,
        first: bool,
        last: bool,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None] | None]:
        """Backpropagate one micro-batch through the slice's graph.

        Args:
            pairs: (output, gradient) pairs of the slice's outputs that need a gradient.
            inputs: The slice's (detached) inputs; those requiring grad get one.
            streams: The stream layer (gradient copies go on its d2h stream).
            first: Whether this is the first micro-batch: gradient state left over from an
                earlier backward that raised half-way is dropped.
            last: Whether this is the last micro-batch of the backward: the parameter gradients
                accumulated over the micro-batches are then handed out.

        Returns:
            The input gradients (``None`` where not required or unused) and, when ``last``, the
            parameter gradients in :meth:`grad_leaves` order (host tensors, complete once the
            d2h stream is synchronised), else ``None``. See [Note: Streamed gradients].
        """
        leaves = self.grad_leaves()
        if first:
            self._reset_grads(leaves)
        x_req = [k for k, t in enumerate(inputs) if t.requires_grad]
        input_grads: list[torch.Tensor | None] = [None] * len(inputs)
        if not self.staged:
            targets = [inputs[k] for k in x_req] + leaves
            res: Sequence[torch.Tensor | None] = [None] * len(targets)
            if pairs and targets:
                res = torch.autograd.grad(
                    [t for t, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
                )
            if self._acc is None:
                self._acc = [None] * len(leaves)
            for j, r in enumerate(res[len(x_req) :]):
                if r is not None:
                    prev = self._acc[j]
                    self._acc[j] = r if prev is None else prev + r
        else:
            if last:
                self._streaming = streams
            targets = [inputs[k] for k in x_req] + leaves
            if pairs and targets:
                torch.autograd.backward(
                    [t for t, _ in pairs], [g for _, g in pairs], inputs=targets
                )
            res = []
            for k in x_req:
                res.append(inputs[k].grad)
                inputs[k].grad = None
        for k, r in zip(x_req, res[: len(x_req)], strict=True):
            input_grads[k] = r
        if not last:
            return input_grads, None
        if not self.staged:
            acc, self._acc = self._acc, None
            return input_grads, acc
        for gi, g in enumerate(self.groups):  # leaves with a gradient whose hook did not fire
            for k, v in enumerate(g.device_views or []):
                if v.grad is not None:
                    self._stream_out(gi, k)
        out = [self._host_grads.get(key) for key in self._leaf_keys]
        self._reset_grads([])
        return input_grads, out

    def _reset_grads(self, leaves: list[torch.Tensor]) -> None:
        self._acc = None
        self._streaming = None
        self._host_flat.clear()
        self._host_grads.clear()
        if self.staged:
            for v in leaves:
                v.grad = None

    def _on_grad(self, gi: int, k: int) -> None:
        """Post-accumulate-grad hook of a device view: stream it out on the last micro-batch."""
        if self._streaming is not None:
            self._stream_out(gi, k)

    def _stream_out(self, gi: int, k: int) -> None:
        """Copy device view ``k`` of group ``gi``'s gradient to the host and free it."""
        streams = self._streaming
        g = self.groups[gi]
        assert streams is not None and g.device_views is not None  # staged, last micro-batch
        view = g.device_views[k]
        grad = view.grad
        if grad is None:
            return
        view.grad = None
        host = self._host_flat.get(gi)
        if host is None:
            host = torch.empty(
                g.grad_numel, dtype=g.dtype, device=self.offload_device, pin_memory=self.pin
            )
            self._host_flat[gi] = host
        e = g.entries[k]
        dst = host[e.grad_offset : e.grad_offset + e.numel].view(e.shape)
        with streams.on_d2h():
            dst.copy_(grad, non_blocking=True)
            streams.used_by_d2h(grad)
        streams.throttle_d2h(grad.numel() * grad.element_size(), self._largest_grad_bytes)
        self._host_grads[(gi, k)] = dst
