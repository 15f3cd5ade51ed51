"""Scheduling: which slice is resident when, the forward/backward loops and the autograd glue."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from shardkit.offload._storage import _SliceStore
from shardkit.offload._streams import _Streams
from torch import nn
from torch.func import functional_call
from torch.profiler import record_function

__all__: list[str] = []

Boundary = tuple[torch.Tensor, ...]


# [Note: Prefetch and residency]
# Forward visits slices 0..S-1, backward S-1..0. On entering slice i the engine makes sure i is
# loaded (normally prefetched already), then immediately issues the load of the next slice in
# visiting order (i+1 forward, i-1 backward) before enqueuing slice i's compute, so the copy
# runs on the h2d stream while slice i computes. Slice i is evicted right after its compute is
# enqueued. Before a load, every resident slice other than the one computing is evicted, so at
# most two slices are ever resident (the one computing and the one being copied in). The last
# slice stays resident after a forward that expects a backward, which starts with it; any
# other leftover is evicted when the next forward starts and after each backward. The order
# is checked on CPU through `trace`; the stream side is [Note: Copy stream ordering].


@dataclass(frozen=True)
class _AutocastState:
    """Autocast settings captured at forward, re-entered for recomputation."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @staticmethod
    def capture(device_type: str) -> _AutocastState:
        return _AutocastState(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )

    def context(self) -> contextlib.AbstractContextManager[Any]:
        # cache_enabled=False: autocast caches casts of leaf tensors that require grad until the
        # region exits, which would keep every slice's low-precision weights on the device.
        if not self.enabled:
            return torch.autocast(self.device_type, enabled=False)
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)


@dataclass
class _RngState:
    """CPU (and CUDA) generator states before one slice/micro-batch forward."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


@dataclass
class _RunState:
    """Everything one forward keeps for its backward."""

    input_needs_grad: list[bool]
    autocast: _AutocastState
    # non-checkpointed: per slice, per micro-batch (detached inputs, outputs) of the slice graph
    graphs: list[list[tuple[Boundary, Boundary]]] = field(default_factory=list)
    # checkpointed: per slice, per micro-batch, the slice input (on the offload device for i > 0)
    saved: list[list[Boundary]] = field(default_factory=list)
    rng: list[list[_RngState]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # structure of each slice's input
    # per input / output tensor, the dim-0 size of each micro-batch (See [Note: Micro-batches])
    in_sizes: list[list[int]] = field(default_factory=list)
    out_sizes: list[list[int]] = field(default_factory=list)
    loaded: dict[int, list[Boundary]] = field(default_factory=dict)
    loaded_ready: dict[int, torch.cuda.Event | None] = field(default_factory=dict)


class _Engine:
    """Runs a sequence of slices with offloaded parameters. Shared by all public entry points."""

    def __init__(
        self,
        slices: Sequence[nn.Module],
        device: torch.device,
        offload_device: torch.device,
        checkpoint: bool,
        num_microbatches: int,
        staged: bool,
    ) -> None:
        self.slices = list(slices)
        self.device = device
        self.offload_device = offload_device
        self.checkpoint = checkpoint
        self.num_microbatches = num_microbatches
        self.streams = _Streams(device)
        self.stores = [_SliceStore(m, device, offload_device, staged) for m in self.slices]
        self.staged = staged
        self.trace: list[tuple[str, int]] | None = None
        self._current: int | None = None
        # upstream[i]: some slice before i has a parameter requiring grad
        self._param_upstream = [False] * len(self.slices)
        for i in range(1, len(self.slices)):
            self._param_upstream[i] = self._param_upstream[i - 1] or bool(
                self.stores[i - 1].host_params()
            )

    # ---------------------------------------------------------------- residency

    def _log(self, what: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((what, i))

    def _load(self, i: int) -> None:
        for j, store in enumerate(self.stores):
            if store.resident and j != self._current and j != i:
                self._evict(j)
        self._log("load", i)
        with record_function("shardkit.offload.load"):  # See [Note: Offload profiler ranges]
            self.stores[i].load(self.streams)

    def _evict(self, i: int) -> None:
        self._log("evict", i)
        with record_function("shardkit.offload.evict"):
            self.stores[i].evict(self.streams)

    def acquire(self, i: int) -> None:
        """Make slice ``i`` the computing slice; see [Note: Prefetch and residency]."""
        self._current = i
        store = self.stores[i]
        if not store.resident:
            self._load(i)
        self.streams.compute_wait(store.ready)

    def prefetch(self, i: int) -> None:
        if 0 <= i < len(self.stores) and not self.stores[i].resident:
            self._load(i)

    def release(self, i: int) -> None:
        if self.stores[i].resident:
            self._evict(i)
        if self._current == i:
            self._current = None

    def release_all(self) -> None:
        self._current = None
        for i, store in enumerate(self.stores):
            if store.resident:
                self._evict(i)

    # ---------------------------------------------------------------- compute

    def run_slice(
        self, i: int, x: Boundary, kind: str, recompute: bool = False
    ) -> tuple[Boundary, str]:
        """Run slice ``i`` on ``x`` with its resident tensors; returns the output and its kind."""
        self._log("compute", i)
        arg = _from_boundary(x, kind)
        tensors = self.stores[i].call_tensors(recompute)
        with record_function(
            "shardkit.offload.recompute" if recompute else "shardkit.offload.compute"
        ):
            if tensors is None:
                out = self.slices[i](arg)
            else:
                out = functional_call(self.slices[i], tensors, (arg,))
        return _as_boundary(out, f"the output of slice {i}")

    def save_boundary(self, i: int, x: Boundary) -> Boundary:
        """Keep slice ``i``'s input for recomputation, on the offload device for ``i > 0``."""
        if i == 0 or not self.staged:
            return x
        out = []
        with self.streams.on_d2h():
            for t in x:
                h = torch.empty(
                    t.shape,
                    dtype=t.dtype,
                    device=self.offload_device,
                    pin_memory=self.stores[i].pin,
                )
                h.copy_(t, non_blocking=True)
                self.streams.used_by_d2h(t)
                out.append(h)
        return tuple(out)

    def load_boundaries(self, run: _RunState, i: int) -> None:
        """Issue the loads of slice ``i``'s saved inputs (checkpointing) on the h2d stream."""
        if not self.checkpoint or i < 0 or i in run.loaded:
            return
        if i == 0 or not self.staged:
            run.loaded[i] = run.saved[i]
            return
        loaded: list[Boundary] = []
        with self.streams.on_h2d():
            for x in run.saved[i]:
                d = []
                for h in x:
                    t = torch.empty(h.shape, dtype=h.dtype, device=self.device)
                    t.copy_(h, non_blocking=True)
                    d.append(t)
                loaded.append(tuple(d))
            run.loaded_ready[i] = self.streams.record_h2d()
        run.loaded[i] = loaded

    # ---------------------------------------------------------------- loops

    # [Note: Offload profiler ranges]
    # ``torch.profiler.record_function`` ranges name the phases in a profiler trace:
    # ``shardkit.offload.forward`` / ``shardkit.offload.backward`` around the loops,
    # ``shardkit.offload.load`` / ``shardkit.offload.evict`` around a slice's transfers (their
    # launch, on CUDA: the copies run on the h2d/d2h streams), ``shardkit.offload.compute`` and
    # ``shardkit.offload.recompute`` around a slice's forward (first run / checkpoint replay).
    def forward(self, inputs: Boundary, kind: str, run: _RunState | None) -> tuple[Boundary, str]:
        """The forward loop; ``run`` is where state for backward goes (``None``: no backward)."""
        with record_function("shardkit.offload.forward"):
            return self._forward(inputs, kind, run)

    def _forward(self, inputs: Boundary, kind: str, run: _RunState | None) -> tuple[Boundary, str]:
        num_slices = len(self.slices)
        mbs = _split(inputs, self.num_microbatches)
        if run is not None:
            run.in_sizes = _sizes(mbs)
        self.release_all()
        wrote_back = False
        for i in range(num_slices):
            self.acquire(i)
            self.prefetch(i + 1)
            outs: list[Boundary] = []
            out_kind = ""
            if run is not None:
                run.kinds.append(kind)
                run.graphs.append([])
                run.saved.append([])
                run.rng.append([])
            for x in mbs:
                if run is None:
                    y, yk = self.run_slice(i, x, kind)
                elif self.checkpoint:
                    run.saved[i].append(self.save_boundary(i, x))
                    run.rng[i].append(self._capture_rng())
                    with run.autocast.context():
                        y, yk = self.run_slice(i, x, kind)
                else:
                    xd = self._grad_inputs(run, i, x)
                    with torch.enable_grad(), run.autocast.context():
                        y, yk = self.run_slice(i, xd, kind)
                    run.graphs[i].append((xd, y))
                    y = tuple(t.detach() for t in y)
                if out_kind and (yk != out_kind or len(y) != len(outs[0])):
                    raise RuntimeError(
                        f"slice {i} returned a different structure for different micro-batches "
                        f"({out_kind} of {len(outs[0])} vs {yk} of {len(y)}); a slice must "
                        "return the same structure for every micro-batch"
                    )
                out_kind = yk
                outs.append(y)
            wrote_back |= self.stores[i].write_back_buffers(self.streams)
            if run is None or i + 1 < num_slices:
                self.release(i)
            mbs = outs
            kind = out_kind
        if wrote_back:
            self.streams.synchronize(self.streams.record_d2h())
        out = _cat(mbs)
        if run is not None:
            run.out_sizes = _sizes(mbs)
        return out, kind

    def backward(
        self, run: _RunState, grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The backward loop: returns (input gradients, host parameter gradients)."""
        with record_function("shardkit.offload.backward"):
            return self._backward(run, grads)

    def _backward(
        self, run: _RunState, grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        num_slices = len(self.slices)
        grad_mbs: list[list[torch.Tensor | None]] = _split_grads(grads, run.out_sizes)
        host_grads: list[list[torch.Tensor | None]] = [[] for _ in range(num_slices)]
        self.load_boundaries(run, num_slices - 1)
        for i in reversed(range(num_slices)):
            self.acquire(i)
            self.prefetch(i - 1)
            self.load_boundaries(run, i - 1)
            store = self.stores[i]
            grads_in: list[list[torch.Tensor | None]] = []
            if self.checkpoint:
                self.streams.compute_wait(run.loaded_ready.pop(i, None))
            for m, go in enumerate(grad_mbs):
                if self.checkpoint:
                    x = self._grad_inputs(run, i, run.loaded[i][m])
                    with (
                        torch.enable_grad(),
                        self._restore_rng(run.rng[i][m]),
                        run.autocast.context(),
                    ):
                        y, _ = self.run_slice(i, x, run.kinds[i], recompute=True)
                else:
                    x, y = run.graphs[i][m]
                pairs = [
                    (t, g) for t, g in zip(y, go, strict=True) if t.requires_grad and g is not None
                ]
                gin, param_grads = store.backward(
                    pairs, x, self.streams, first=m == 0, last=m == len(grad_mbs) - 1
                )
                grads_in.append(gin)
                if param_grads is not None:
                    host_grads[i] = param_grads
            if self.checkpoint:
                for x in run.loaded.pop(i):
                    for t in x:
                        self.streams.used_by_compute(t)
                run.saved[i] = []
            else:
                run.graphs[i] = []
            self.release(i)
            grad_mbs = grads_in
        self.release_all()
        self.streams.synchronize(self.streams.record_d2h())
        input_grads = _cat_grads(grad_mbs, run.in_sizes)
        return input_grads, [g for per_slice in host_grads for g in per_slice]

    # ---------------------------------------------------------------- helpers

    def _grad_inputs(self, run: _RunState, i: int, x: Boundary) -> Boundary:
        """Detached copies of slice ``i``'s input, requiring grad where a gradient is needed."""
        out = []
        for k, t in enumerate(x):
            d = t.detach()
            if i == 0:
                need = run.input_needs_grad[k]
            else:
                need = (any(run.input_needs_grad) or self._param_upstream[i]) and (
                    d.is_floating_point() or d.is_complex()
                )
            out.append(d.requires_grad_(need))
        return tuple(out)

    def _capture_rng(self) -> _RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return _RngState(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def _restore_rng(self, state: _RngState) -> Iterator[None]:
        devices = [self.device] if state.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state.cpu)
            if state.cuda is not None:
                torch.cuda.set_rng_state(state.cuda, self.device)
            yield


# -------------------------------------------------------------------- boundary values


def _as_boundary(value: object, what: str) -> tuple[Boundary, str]:
    """Flatten a slice input/output (a Tensor or a tuple/list of Tensors) to a tuple."""
    if isinstance(value, torch.Tensor):
        return (value,), "tensor"
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return tuple(value), "list" if isinstance(value, list) else "tuple"
    if isinstance(value, (tuple, list)):
        types = [type(v).__name__ for v in value]
        got = f"a {type(value).__name__} of {types}"
    else:
        got = f"{type(value).__name__} {value!r}"[:200]
    raise TypeError(
        f"{what} must be a Tensor or a non-empty tuple/list of Tensors (the values passed "
        f"between offloaded slices), got {got}; return tensors only, or keep layers that "
        "exchange other values inside one slice"
    )


def _from_boundary(
    x: Boundary, kind: str
) -> torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]:
    if kind == "tensor":
        return x[0]
    return list(x) if kind == "list" else x


# [Note: Micro-batches]
# The batch (dim 0 of every input, all of the same size) is split with ``torch.chunk``, exactly as
# fairscale's OffloadModel does: chunks of ceil(B / n) rows, the last one smaller, and fewer
# than ``n`` chunks when B does not fill them (B=6, n=4 gives 2+2+2; B=3, n=4 gives 1+1+1).
# Every slice runs the same chunks, and the outputs of the last slice are concatenated. The
# dim-0 size of each micro-batch's inputs and outputs is recorded in forward; backward splits
# the output gradients by the recorded output sizes (the exact inverse of the concatenation,
# whatever a layer does to the batch dimension) and builds missing input gradients with the
# recorded input sizes.


def _split(x: Boundary, num: int) -> list[Boundary]:
    """Split every tensor of ``x`` into micro-batches; See [Note: Micro-batches]."""
    if num == 1:
        return [x]
    parts = [torch.chunk(t, num, dim=0) for t in x]
    return [tuple(p[m] for p in parts) for m in range(len(parts[0]))]


def _sizes(mbs: list[Boundary]) -> list[list[int]]:
    """Per tensor position, the dim-0 size of each micro-batch (0 for a 0-dim tensor)."""
    if len(mbs) == 1:
        return []
    return [[mb[k].shape[0] if mb[k].dim() > 0 else 0 for mb in mbs] for k in range(len(mbs[0]))]


def _cat(mbs: list[Boundary]) -> Boundary:
    if len(mbs) == 1:
        return mbs[0]
    for k, t in enumerate(mbs[0]):
        if t.dim() == 0:
            raise RuntimeError(
                f"output {k} of the last slice is 0-dimensional, so micro-batch outputs cannot be "
                "concatenated; with num_microbatches > 1 every output needs a batch dimension "
                "(compute reductions such as the loss outside the offloaded model)"
            )
    return tuple(torch.cat([mb[k] for mb in mbs], dim=0) for k in range(len(mbs[0])))


def _split_grads(
    grads: Sequence[torch.Tensor | None], sizes: list[list[int]]
) -> list[list[torch.Tensor | None]]:
    """Split output gradients by the micro-batch output sizes; See [Note: Micro-batches]."""
    if not sizes:
        return [list(grads)]
    num = len(sizes[0])
    out: list[list[torch.Tensor | None]] = [[] for _ in range(num)]
    for g, split in zip(grads, sizes, strict=True):
        parts: Sequence[torch.Tensor | None] = (
            [None] * num if g is None else torch.split(g, split, dim=0)
        )
        for m in range(num):
            out[m].append(parts[m])
    return out


def _cat_grads(
    mbs: list[list[torch.Tensor | None]], sizes: list[list[int]]
) -> list[torch.Tensor | None]:
    if len(mbs) == 1:
        return mbs[0]
    out: list[torch.Tensor | None] = []
    for k in range(len(mbs[0])):
        parts = [mb[k] for mb in mbs]
        if all(p is None for p in parts):
            out.append(None)
            continue
        ref = next(p for p in parts if p is not None)
        out.append(
            torch.cat(
                [
                    ref.new_zeros((sizes[k][m], *ref.shape[1:])) if p is None else p
                    for m, p in enumerate(parts)
                ],
                dim=0,
            )
        )
    return out


# -------------------------------------------------------------------- autograd


class _OffloadFunction(torch.autograd.Function):
    """The whole offloaded sequence as one autograd node.

    Inputs: the engine, the input structure, then the input tensors followed by the host
    parameters that require grad (passed so that outputs require grad exactly when the plain
    model's would, and so that the autograd engine accumulates the host gradients we return).
    """

    @staticmethod
    def forward(
        ctx: Any,
        engine: _Engine,
        kind: str,
        out_kind: list[str],
        num_inputs: int,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.set_materialize_grads(False)
        run = _RunState(
            input_needs_grad=list(ctx.needs_input_grad[4 : 4 + num_inputs]),
            autocast=_AutocastState.capture(engine.device.type),
        )
        out, kind_out = engine.forward(tuple(tensors[:num_inputs]), kind, run)
        out_kind.append(kind_out)
        ctx.engine = engine
        ctx.run = run
        ctx.num_params = len(tensors) - num_inputs
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "OffloadModel does not support double backward (create_graph=True); call "
                "backward without create_graph"
            )
        run: _RunState | None = ctx.run
        if run is None:
            raise RuntimeError(
                "OffloadModel's backward ran twice over the same forward; run the forward again "
                "instead of retain_graph=True"
            )
        ctx.run = None
        engine: _Engine = ctx.engine
        input_grads, param_grads = engine.backward(run, grads)
        if len(param_grads) != ctx.num_params:
            raise RuntimeError(
                f"internal error: {len(param_grads)} parameter gradients for {ctx.num_params} "
                "parameters; the model's parameters changed after wrapping"
            )
        return (None, None, None, None, *input_grads, *param_grads)
