"""ZeRO-1's masters of bf16 params kept as int16 remainders (``master_remainder=True``).

[Note: Remainder masters under ZeRO-1]
With ``ShardedOptimizer(..., master_dtype=torch.float32, master_remainder=True)`` the exact fp32
master of each owned bf16 param is the param itself (its high 16 bits) plus a persistent int16
remainder (see [Note: Exact 16-bit remainder masters] in ``_remainder.py``): 2 bytes per owned
param instead of 4. Params of other dtypes (fp16: no exact 16-bit scheme) keep a full
``master_dtype`` master as in [Note: Master weights]. The wrapped optimizer stays a plain torch
optimizer class that keys its state by tensor object, so each bf16 param has a persistent fp32
*handle* in the wrapped optimizer's groups, which holds no memory of its own outside the step:
it is a stride-0 view of one fp32 element per device (right shape, dtype and device: torch's
``load_state_dict`` and the compact class read those), so reading it outside the step gives
zeros, not the master. A step, per chunk of [Note: Master weights]:

1. the chunk's grads are upcast as for fp32 masters; for each bf16 param with a gradient,
   ``join_master(param, remainder)`` is written into a second per-device fp32 scratch buffer
   (the size of the largest chunk, like the gradients' one) and the handle is re-pointed at
   its slice (``Tensor.set_``);
2. the wrapped optimizer steps the chunk (the handles are the exact fp32 masters);
3. ``split_master`` writes the new value back into the param (rounded to nearest, ties away
   from zero) and its remainder, in place, and the handle goes back to the empty view.

So the updates are bit for bit those of ``master_dtype=torch.float32`` and the params too except
at exact ties (the Note in ``_remainder.py``). The joins and splits run on blocks of
``_BLOCK`` elements, so their int32 temporaries stay bounded whatever the param's size. At rest a
rank holds 2 bytes per owned bf16 param plus the step's scratch: chunks count a remainder param's
gradient and joined master together (:meth:`RemainderMasters.step_bytes`), so for a bf16 model
the two buffers hold ``master_grad_bucket_bytes`` together, as fp32 masters' gradients alone
would (up to 1.5 times that when fp16 params with full masters fill other chunks); with
``master_grad_bucket_bytes=None`` (one chunk) the scratch is as large as all of them, and the
saving is gone at the step's peak.

Everything that reads or writes a master goes through :meth:`value` / :meth:`set`: state dicts,
consolidation, repartition, ``master_model_state_dict`` and sharded checkpoints carry the
joined, exact fp32 value (the ``"master_params"`` of an fp32-master run, interchangeable with
it), and a loaded fp32 master is split once: exact, but the owned param is written (rounded
ties away from zero) since it is the master's high half. Written params ([Note: Params written
outside the optimizer]): a write replaces the high half, and what the old master was cannot be
told from the remainder alone, so on a changed version counter the remainder is reset to 0 and
the master is exactly the written bf16 value, even where the same values were written (they
lose their low 16 bits: at most half a bf16 unit). So load the model's weights *before* the
optimizer state (a load writes the params as the masters' rounding anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from shardkit.optim._master import _Chunk, _Masters, needs_master
from shardkit.optim._remainder import join_master, split_master
from shardkit.optim._torch_compat import tensor_version

__all__ = ["RemainderMasters"]

logger = logging.getLogger("shardkit.optim")
_logged_full = False

_BLOCK = 1 << 20
"""Elements per join / split call (bounds their temporaries at about 20 bytes per element)."""


def _blocks(param: torch.Tensor, *others: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """Matching flat slices of ``param`` and ``others`` (one shape), at most ``_BLOCK``
    elements each; the whole tensors when one is not contiguous."""
    if not all(t.is_contiguous() for t in (param, *others)):
        yield (param, *others)
        return
    flat = [t.view(-1) for t in (param, *others)]
    n = param.numel()
    for lo in range(0, n, _BLOCK):
        yield tuple(t[lo : lo + _BLOCK] for t in flat)


def _point(handle: torch.Tensor, at: torch.Tensor) -> None:
    """Re-points ``handle`` at ``at``'s memory, shape and strides (``Tensor.set_``)."""
    handle.set_(at.untyped_storage(), at.storage_offset(), at.shape, at.stride())


class RemainderMasters(_Masters):
    """:class:`_Masters` whose bf16 params keep an int16 remainder instead of an fp32 master;
    see [Note: Remainder masters under ZeRO-1]."""

    def __init__(self, chunk_bytes: int | None) -> None:
        super().__init__(torch.float32, chunk_bytes)
        self._rem: dict[int, torch.Tensor] = {}
        """``id(param) -> its int16 remainder`` (bf16 params only)."""
        self._values: dict[torch.device, torch.Tensor] = {}
        """Per device, the flat fp32 scratch of a chunk's joined masters, reused."""
        self._empty: dict[torch.device, torch.Tensor] = {}
        """Per device, the one fp32 element every idle handle is a stride-0 view of."""

    def _idle(self, like: torch.Tensor) -> torch.Tensor:
        base = self._empty.get(like.device)
        if base is None:
            base = self._empty[like.device] = torch.zeros(1, device=like.device)
        idle: torch.Tensor = base.as_strided(like.shape, (0,) * like.dim())
        return idle

    def add(self, p: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        """``p``'s handle (bf16) or master (other dtypes), from ``value`` or the live param."""
        global _logged_full
        if p.dtype != torch.bfloat16:
            if not _logged_full:
                _logged_full = True
                logger.info(
                    "master_remainder=True: %s params have no exact 16-bit remainder scheme and "
                    "keep full fp32 masters (only bf16 params get remainders; logged once)",
                    p.dtype,
                )
            return super().add(p, value)
        handle = torch.empty(0, dtype=torch.float32, device=p.device)
        _point(handle, self._idle(p))
        self._master[id(p)] = handle
        self._param[id(handle)] = p
        self._rem[id(p)] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        self.set(p, value)
        return handle

    def value(self, p: torch.Tensor) -> torch.Tensor | None:
        r = self._rem.get(id(p))
        if r is None:
            return super().value(p)
        out = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        with torch.no_grad():
            for hi, lo, o in _blocks(p.detach(), r, out):
                join_master(hi, lo, out=o)
        return out

    def set(self, p: torch.Tensor, value: torch.Tensor | None) -> None:
        """Sets ``p``'s master exactly: a bf16 param's is split into the param (written) and
        its remainder; ``None``: the live param, remainder 0."""
        r = self._rem.get(id(p))
        if r is None:
            super().set(p, value)
            return
        with torch.no_grad():
            if value is None:
                r.zero_()
            else:
                v = value.detach().to(p.device, torch.float32)
                for m, hi, lo in _blocks(v.contiguous(), p.detach(), r):
                    split_master(m, param_out=hi, remainder_out=lo)
        self.versions[id(p)] = tensor_version(p)

    def mirror(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """A bf16 param another rank owns gets the rounding its owner's :meth:`set` writes."""
        if p.dtype != torch.bfloat16 or not needs_master(p, self.dtype):
            return
        with torch.no_grad():
            v = value.detach().to(p.device, torch.float32).contiguous()
            for m, hi in _blocks(v, p.detach()):
                split_master(m, param_out=hi)

    def reseed_written(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """[Note: Params written outside the optimizer] for remainders: a written bf16 param's
        master becomes the written value (remainder 0); other masters as for fp32 masters."""
        params = list(params)
        out = super().reseed_written(p for p in params if id(p) not in self._rem)
        for p in params:
            r = self._rem.get(id(p))
            if r is None:
                continue
            seen, now = self.versions.get(id(p)), tensor_version(p)
            if seen is not None and seen != now:
                with torch.no_grad():
                    r.zero_()
                self.versions[id(p)] = now
                out.append(p)
        return out

    def step_bytes(self, p: torch.Tensor) -> int:
        """A bf16 param's joined master sits beside its upcast gradient in the step: twice
        the bytes, so a chunk of ``master_grad_bucket_bytes`` holds both."""
        return super().step_bytes(p) * (2 if id(p) in self._rem else 1)

    def load_grads(self, chunk: _Chunk) -> list[torch.Tensor]:
        """Step 1: the upcast grads, and the joined masters in the handles."""
        flats = super().load_grads(chunk)
        pairs = [
            (p, self._rem[id(p)]) for p in chunk.params if id(p) in self._rem and p.grad is not None
        ]
        with torch.no_grad():
            for device in dict.fromkeys(p.device for p, _ in pairs):
                on = [(p, r) for p, r in pairs if p.device == device]
                numel = sum(p.numel() for p, _ in on)
                kept = self._values.get(device)
                if kept is None or kept.numel() < numel:
                    kept = self._values[device] = torch.empty(numel, device=device)
                off = 0
                for p, r in on:
                    view = kept[off : off + p.numel()].view(p.shape)
                    for hi, lo, o in _blocks(p.detach(), r, view):
                        join_master(hi, lo, out=o)
                    _point(self._master[id(p)], view)
                    off += p.numel()
        return flats

    def write_back(self, chunk: _Chunk) -> None:
        """Step 3: split the stepped masters into the params and remainders."""
        with torch.no_grad():
            for p in chunk.params:
                r = self._rem.get(id(p))
                handle = self._master.get(id(p))
                if r is None or handle is None or handle.grad is None:
                    continue
                for m, hi, lo in _blocks(handle, p.detach(), r):
                    split_master(m, param_out=hi, remainder_out=lo)
                handle.grad = None
                _point(handle, self._idle(p))
                self.versions[id(p)] = tensor_version(p)
        super().write_back(chunk)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``"remainders"``, ``"masters"`` (full fp32 ones, non-bf16 params) and
        ``"scratch"`` (both chunk buffers and the handles' element)."""
        full = sum(m.nbytes for k, m in self._master.items() if k not in self._rem)
        scratch = [*self._values.values(), *self._grads.values(), *self._empty.values()]
        return {
            "remainders": sum(r.nbytes for r in self._rem.values()),
            "masters": full,
            "scratch": sum(t.nbytes for t in scratch),
        }
