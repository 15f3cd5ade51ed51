"""Host and device storage of one slice: flat host buffers, device staging, gradients."""

from __future__ import annotations

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


@dataclass
class _Group:
    """Parameters (or buffers) of one dtype of a slice, packed in one flat host buffer."""

    is_param: bool
    dtype: torch.dtype
    entries: list[_Entry]
    host: torch.Tensor
    device_flat: torch.Tensor | None = None  # owns the device storage (resized to 0 if evicted)
    device_views: list[torch.Tensor] | None = None

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
                        is_param, dtype, [(n, t) for n, t in named if t.dtype == dtype]
                    )
                )

    def _make_group(
        self, is_param: bool, dtype: torch.dtype, named: list[tuple[str, torch.Tensor]]
    ) -> _Group:
        total = sum(t.numel() for _, t in named)
        host = torch.empty(total, dtype=dtype, device=self.offload_device, pin_memory=self.pin)
        entries: list[_Entry] = []
        offset = 0
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
            entries.append(
                _Entry(
                    name,
                    owner,
                    attr,
                    offset,
                    t.numel(),
                    t.shape,
                    is_param and t.requires_grad,
                    host_tensor,
                )
            )
            offset += t.numel()
        group = _Group(is_param, dtype, entries, host)
        if self.staged:
            flat = torch.empty(total, dtype=dtype, device=self.device)
            flat.untyped_storage().resize_(0)
            alias = torch.empty(0, dtype=dtype, device=self.device).set_(
                flat.untyped_storage(), 0, (total,), (1,)
            )
            views = []
            for e in entries:
                v = alias[e.offset : e.offset + e.numel].view(e.shape).detach()
                v.requires_grad_(e.requires_grad)
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

    def grads_to_host(
        self, grads: list[torch.Tensor | None], streams: _Streams
    ) -> list[torch.Tensor | None]:
        """Copy device gradients (in :meth:`grad_leaves` order) into fresh host tensors.

        One flat copy per dtype group; the returned host gradients are views of it and are
        complete only after the d2h stream is synchronised (see [Note: Copy stream ordering]).
        """
        if not self.staged:
            return grads
        out: list[torch.Tensor | None] = [None] * len(grads)
        k = 0
        for g in self.groups:
            if not g.is_param:
                continue
            idx: list[int] = []
            for e in g.entries:
                if e.requires_grad:
                    if grads[k] is not None:
                        idx.append(k)
                    k += 1
            if not idx:
                continue
            parts = [grads[j] for j in idx]
            flat = torch.cat([p.reshape(-1) for p in parts if p is not None])
            host = torch.empty(
                flat.numel(), dtype=flat.dtype, device=self.offload_device, pin_memory=self.pin
            )
            with streams.on_d2h():
                host.copy_(flat, non_blocking=True)
                streams.used_by_d2h(flat)
            offset = 0
            for j in idx:
                gj = grads[j]
                assert gj is not None  # idx holds only defined gradients
                out[j] = host[offset : offset + gj.numel()].view(gj.shape)
                offset += gj.numel()
        return out
