"""The Adam / AdamW step on compact state, as a pure function of what it is given (issue 40).

:func:`compact_adam_step` steps a list of params (or block-aligned pieces of params: it never
needs the whole param) whose moments are :class:`~shardkit.optim._compact.CompactTensor` (or
plain tensors, for params that keep full-precision state), with torch's own functional Adam
(``torch.optim.adam.adam`` / ``torch.optim.adamw.adamw``), so the fp32 math is torch's:
single-tensor, foreach or fused, as the caller picks. It knows nothing of ranks, buckets or
checkpoints; the engine (``ShardStepper`` / ``ShardedOptimizer``) will own the state and call it.

[Note: Compact step by chunks]
The params' element ranges are cut into *items* of at most ``chunk`` elements, at multiples of
``chunk`` (a multiple of every block size, so every item holds whole blocks: see [Note: Blocks
on the global flat index] in ``_compact.py``), and items are packed into *batches* of at most
``chunk`` elements. Per batch:

1. each compact moment of each item is dequantized into its slice of an fp32 scratch buffer
   (one per moment, ``chunk`` elements, allocated once per :class:`StepScratch`); plain moments
   are passed as views of themselves;
2. the value stepped is the tensor itself: an fp32 param, or the fp32 master of a bf16/fp16
   one (the masters of ``_master_set.py`` hand the optimizer their master, its upcast
   gradient already multiplied by the pending factors, and cast or split the new value back
   after the step: [Note: Master weights]);
3. torch's functional Adam runs once on the batch's lists, with one step tensor per item,
   copied from the param's step count before the call (torch increments it in the call), so
   each item gets its param's own bias correction;
4. the moments are quantized back from scratch.

After the last batch each stepped param's step count is incremented once. Params whose gradient
is ``None`` are skipped: state, step count and value unchanged. So the result equals, bit for
bit, torch's optimizer on the dequantized moments followed by quantizing them (the reference
of ``tests/test_compact_step.py``): every op is element-wise, and the chunks are views.

Transient memory: the scratch (``4 * chunk`` bytes per buffer: 2 moments, 3 with ``amsgrad``),
torch's temporaries for one batch, and the quantizer's for one item (see [Note: Bounded
transient memory] in ``_compact.py``). Measured
(``test_compact_step.py::test_step_transient_memory``, live tensor storages at their peak, any
inner implementation): 20 bytes per chunk element, 1.3 MiB at the default chunk of 64 Ki
elements, whatever the params' sizes (the masters' upcast gradients and joined remainder
masters are their own scratch: ``_master_set.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from shardkit.optim._compact import CHUNK, CompactFormat, CompactTensor, moment_formats
from shardkit.optim._compact_fused import fused_eligible, fused_param_step
from shardkit.optim._compact_kernel import kernel_eligible, kernel_hypers, kernel_param_step
from shardkit.optim._profiling import profiler_range
from torch.optim.adam import adam
from torch.optim.adamw import adamw

__all__ = ["AdamState", "StepScratch", "compact_adam_step"]

Impl = Literal["single", "foreach", "fused"]
Moment = CompactTensor | torch.Tensor


@dataclass(frozen=True, eq=False)
class AdamState:
    """The Adam / AdamW state of one param (or piece), compact or full precision."""

    step: torch.Tensor
    """0-d float32 step count, where torch keeps it (CPU; the param's device for ``fused``)."""
    exp_avg: Moment
    """First moment: compact (signed map) or a tensor of the stepped value's shape."""
    exp_avg_sq: Moment
    """Second moment: compact (unsigned map) or a tensor."""
    max_exp_avg_sq: Moment | None = None
    """``amsgrad``'s running maximum of the second moment (second moment's format), else None."""

    @classmethod
    def zeros(
        cls,
        like: torch.Tensor,
        kind: str | None,
        *,
        amsgrad: bool = False,
        fused: bool = False,
    ) -> AdamState:
        """Fresh state for stepping ``like`` (the fp32 value stepped: param or master).

        Args:
            like: the tensor the step updates (shape, device; its dtype for plain moments).
            kind: ``"int8"``, ``"int4"`` or ``None`` (full precision, as torch keeps it).
                Decide it with :func:`~shardkit.optim._compact.compact_formats` on the param's
                *global* size ([Note: One compact decider]).
            amsgrad: also keep ``max_exp_avg_sq``.
            fused: place the step count on ``like``'s device, as torch's fused Adam does.
        """
        step = torch.zeros((), dtype=torch.float32, device=like.device if fused else "cpu")
        if kind is None:

            def plain() -> torch.Tensor:
                return torch.zeros_like(like, memory_format=torch.preserve_format)

            return cls(step, plain(), plain(), plain() if amsgrad else None)
        first, second = moment_formats(kind)
        shape = tuple(like.shape)

        def compact(fmt: CompactFormat) -> CompactTensor:
            return CompactTensor.zeros(shape, fmt, like.device)

        return cls(step, compact(first), compact(second), compact(second) if amsgrad else None)

    def moments(self) -> list[tuple[str, Moment]]:
        """``(name, moment)`` of the moments it holds, in torch's state-dict key names."""
        out: list[tuple[str, Moment]] = [("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]
        if self.max_exp_avg_sq is not None:
            out.append(("max_exp_avg_sq", self.max_exp_avg_sq))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of its moments (codes and scales for compact ones), step count excluded."""
        return sum(
            m.nbytes if isinstance(m, CompactTensor) else m.numel() * m.element_size()
            for _, m in self.moments()
        )


@dataclass
class StepScratch:
    """fp32 scratch of :func:`compact_adam_step`, reusable across steps (one per device)."""

    chunk: int = CHUNK
    """Elements per buffer: the batch size of [Note: Compact step by chunks]."""
    buffers: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict)
    """Allocated on first use: ``(role, device) -> fp32 (chunk,)``."""
    steps: dict[torch.device, list[torch.Tensor]] = field(default_factory=dict)
    """Per-item step-count copies, per device of the step counts."""

    def buffer(self, role: str, device: torch.device) -> torch.Tensor:
        """The ``role`` buffer on ``device``."""
        key = (role, device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(self.chunk, dtype=torch.float32, device=device)
        return self.buffers[key]

    def step_copies(self, device: torch.device, n: int) -> list[torch.Tensor]:
        """``n`` 0-d float32 tensors on ``device``."""
        have = self.steps.setdefault(device, [])
        while len(have) < n:
            have.append(torch.zeros((), dtype=torch.float32, device=device))
        return have[:n]


@dataclass(frozen=True)
class _Item:
    index: int  # which param
    lo: int  # element range [lo, hi) of it
    hi: int


def _items(
    numels: Sequence[int],
    stepped: Sequence[int],
    chunk: int,
    starts: dict[int, int] | None = None,
) -> Iterator[list[_Item]]:
    """Batches of items (of each param from its element ``starts[i]``, default 0): see [Note:
    Compact step by chunks]."""
    batch: list[_Item] = []
    size = 0
    for i in stepped:
        start = 0 if starts is None else starts.get(i, 0)
        for lo in range(start, numels[i], chunk):
            hi = min(lo + chunk, numels[i])
            if size + hi - lo > chunk:
                yield batch
                batch, size = [], 0
            batch.append(_Item(i, lo, hi))
            size += hi - lo
    if batch:
        yield batch


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (a param or a piece of a flat buffer)")
    return t.view(-1)


def _check_inputs(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    states: Sequence[AdamState],
    chunk: int,
    impl: str,
    amsgrad: bool,
) -> None:
    n = len(params)
    for name, seq in (("grads", grads), ("states", states)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries, params {n}: one per param")
    if impl not in ("single", "foreach", "fused"):
        raise ValueError(f"impl must be 'single', 'foreach' or 'fused', got {impl!r}")
    if not isinstance(chunk, int) or chunk <= 0 or chunk % 256:
        raise ValueError(f"chunk must be a positive multiple of 256 elements, got {chunk!r}")
    for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
        if g is not None and (g.shape != p.shape or g.is_sparse):
            raise ValueError(
                f"param {i}: gradient must be dense with the param's shape {tuple(p.shape)}, got "
                f"{'sparse ' if g.is_sparse else ''}{tuple(g.shape)}"
            )
        if amsgrad and g is not None and st.max_exp_avg_sq is None:
            raise ValueError(
                f"param {i}: amsgrad=True needs max_exp_avg_sq in its state "
                f"(AdamState.zeros(..., amsgrad=True))"
            )
        for name, mom in st.moments():
            if isinstance(mom, CompactTensor):
                if mom.numel != p.numel():
                    raise ValueError(
                        f"param {i}: {name} stands for {mom.numel} elements, the param has "
                        f"{p.numel()}"
                    )
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"param {i}: compact moments step an fp32 value, but the param is "
                        f"{p.dtype}; give it an fp32 master (step the master: "
                        f"ShardedOptimizer(master_dtype=torch.float32)) or keep its state full "
                        f"precision"
                    )
            elif not isinstance(mom, torch.Tensor) or mom.shape != p.shape:
                raise ValueError(
                    f"param {i}: {name} must be a CompactTensor or a tensor of shape "
                    f"{tuple(p.shape)}, got {type(mom).__name__}"
                )


def compact_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    states: Sequence[AdamState],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    amsgrad: bool = False,
    maximize: bool = False,
    impl: Impl = "foreach",
    scratch: StepScratch | None = None,
    compiled: bool = False,
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step of ``params``, in place.

    See [Note: Compact step by chunks]. Hyper-parameters are torch's ``Adam`` / ``AdamW``
    ones (one param group per call).

    Args:
        params: the tensors stepped in place (params, fp32 masters, or contiguous pieces of
            them); compact state needs fp32 ones.
        grads: their gradients (``None``: not stepped, state unchanged).
        states: their state (:meth:`AdamState.zeros` before the first step).
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.Adam``.
        decoupled_weight_decay: AdamW's weight decay (``torch.optim.AdamW``).
        impl: which of torch's implementations steps each batch: ``"single"``
            (``foreach=False``), ``"foreach"`` or ``"fused"``.
        scratch: buffers to reuse across calls (a new one per call when ``None``).
        compiled: step the params whose moments are all compact with ``torch.compile``-d
            kernels. On the CPU they dequantize and requantize around the same torch Adam
            call: the same bytes as ``False`` (see [Note: Compiled step, same bytes] in
            ``_compact_fused.py``); on a GPU one kernel per chunk does the whole step, within
            a few ulps of ``False`` (see [Note: One kernel on a GPU] in
            ``_compact_kernel.py``). Compiled on first use, once per process and variant;
            where compilation fails, the eager step runs (logged once).
    """
    n = len(params)
    scratch = StepScratch() if scratch is None else scratch
    _check_inputs(params, grads, states, scratch.chunk, impl, amsgrad)
    stepped = [i for i in range(n) if grads[i] is not None]
    if not stepped:
        return
    functional = adamw if decoupled_weight_decay else adam
    kwargs: dict[str, Any] = dict(
        foreach=impl == "foreach",
        fused=impl == "fused",
        capturable=False,
        differentiable=False,
        amsgrad=amsgrad,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
    )
    stepped_eager: list[int] = stepped
    starts: dict[int, int] = {}
    if compiled:
        stepped_eager, starts = _step_compiled(
            stepped, params, grads, states, scratch, functional, kwargs, decoupled_weight_decay
        )
    numels = [p.numel() for p in params]
    for batch in _items(numels, stepped_eager, scratch.chunk, starts):
        _step_batch(batch, params, grads, states, scratch, functional, kwargs)
    for i in stepped:
        states[i].step.add_(1)


def _step_compiled(
    stepped: list[int],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    states: Sequence[AdamState],
    scratch: StepScratch,
    functional: Callable[..., None],
    kwargs: dict[str, Any],
    decoupled: bool,
) -> tuple[list[int], dict[int, int]]:
    """Steps what the compiled kernels can step; returns the params left to the eager step
    and, for those the compiled step began, the element the eager step continues from."""
    left: list[int] = []
    starts: dict[int, int] = {}
    amsgrad = bool(kwargs["amsgrad"])
    one_kernel: dict[torch.device, list[tuple[int, list[CompactTensor]]]] = {}
    for i in stepped:
        p, g, st = params[i], grads[i], states[i]
        assert g is not None  # only params with a gradient are stepped
        moments = [mom for _, mom in st.moments()[: 3 if amsgrad else 2]]
        compact = [mom for mom in moments if isinstance(mom, CompactTensor)]
        if kernel_eligible(p, g, moments):
            one_kernel.setdefault(p.device, []).append((i, compact))
            continue
        if not fused_eligible(p, g, moments):
            left.append(i)
            continue
        with profiler_range("shardkit.compact.compiled"):
            done = fused_param_step(
                _flat(p, f"param {i}"),
                _flat(g, f"grad {i}"),
                compact,
                st.step,
                scratch.step_copies(st.step.device, 1)[0],
                functional,
                kwargs,
            )
        if done < p.numel():
            left.append(i)
            starts[i] = done
    kernel_kwargs = dict(kwargs, decoupled=decoupled)
    for device, items in one_kernel.items():
        with profiler_range("shardkit.compact.compiled"):
            hypers = kernel_hypers([states[i].step for i, _ in items], kernel_kwargs, device)
            for (i, compact), hyper in zip(items, hypers, strict=True):
                g = grads[i]
                assert g is not None
                done = kernel_param_step(
                    _flat(params[i], f"param {i}"), _flat(g, f"grad {i}"), compact, hyper,
                    kernel_kwargs,
                )  # fmt: skip
                if done < params[i].numel():
                    left.append(i)
                    starts[i] = done
    return left, starts


def _step_batch(
    batch: list[_Item],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    states: Sequence[AdamState],
    scratch: StepScratch,
    functional: Callable[..., None],
    kwargs: dict[str, Any],
) -> None:
    """Steps 1-4 of [Note: Compact step by chunks] for one batch."""
    amsgrad = bool(kwargs["amsgrad"])
    values: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    moments: dict[str, list[torch.Tensor]] = {"exp_avg": [], "exp_avg_sq": [], "max_exp_avg_sq": []}
    steps: list[torch.Tensor] = []
    offsets: list[int] = []
    off = 0
    with profiler_range("shardkit.compact.dequantize"):
        for item in batch:
            i, lo, hi = item.index, item.lo, item.hi
            p, st = params[i], states[i]
            device = p.device
            sl = slice(off, off + hi - lo)
            value = _flat(p, f"param {i}")[lo:hi]
            grad = grads[i]
            assert grad is not None  # only stepped params make items
            g = _flat(grad, f"grad {i}")[lo:hi]
            for name, mom in st.moments()[: 3 if amsgrad else 2]:
                if isinstance(mom, CompactTensor):
                    buf = scratch.buffer(name, device)[sl]
                    mom.dequantize_range(lo, hi, buf)
                    moments[name].append(buf)
                else:
                    moments[name].append(_flat(mom, f"{name} of param {i}")[lo:hi])
            values.append(value)
            gs.append(g)
            offsets.append(off)
            off += hi - lo
        for item, copy in zip(batch, _step_copies(batch, states, scratch), strict=True):
            copy.copy_(states[item.index].step)
            steps.append(copy)
    with profiler_range("shardkit.compact.adam"):
        functional(
            values,
            gs,
            moments["exp_avg"],
            moments["exp_avg_sq"],
            moments["max_exp_avg_sq"],
            steps,
            has_complex=any(torch.is_complex(v) for v in values),
            **kwargs,
        )
    with profiler_range("shardkit.compact.quantize"):
        for k, item in enumerate(batch):
            i, lo, hi = item.index, item.lo, item.hi
            for name, mom in states[i].moments()[: 3 if amsgrad else 2]:
                if isinstance(mom, CompactTensor):
                    mom.quantize_range_(lo, moments[name][k])


def _step_copies(
    batch: list[_Item], states: Sequence[AdamState], scratch: StepScratch
) -> list[torch.Tensor]:
    """One step-count copy per item, on its step count's device."""
    out: list[torch.Tensor] = []
    used: dict[torch.device, int] = {}
    for item in batch:
        device = states[item.index].step.device
        k = used.get(device, 0)
        out.append(scratch.step_copies(device, k + 1)[k])
        used[device] = k + 1
    return out
