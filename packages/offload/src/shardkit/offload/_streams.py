"""The stream/event layer: CUDA copy streams and events, a no-op on CPU.

Everything above this module (loading, eviction, prefetch order, gradient copies) is the same
code on CPU and CUDA; only these primitives differ. On CPU every "stream" is the calling thread,
so each operation is complete when it returns and every wait is a no-op.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch

__all__: list[str] = []


# [Note: Copy stream ordering]
# Three streams take part on CUDA: the compute stream (whatever stream is current when the
# forward or backward runs), an h2d stream for parameter/activation loads and a d2h stream for
# gradient/buffer/activation copies back to the host (separate so both PCIe directions overlap).
#
# 1. Use after copy: every load records a `ready` event on the h2d stream; the compute stream
#    waits on it before any kernel reads the loaded tensors. Gradients and outputs are copied
#    to the host only after the d2h stream waits on an event recorded on the compute stream
#    after the kernels that produced them.
# 2. Early reuse: slice parameters live in device storages allocated on the h2d stream. An
#    eviction records a `done` event on the compute stream after the slice's last kernel and
#    frees the storage (resize to 0). The caching allocator may hand that block to the next
#    h2d-stream allocation at once, so before any load allocates, the h2d stream waits on every
#    pending `done` event: the new copy cannot start writing while old kernels still read.
#    This bounds residency to two slices without record_stream's delayed reuse.
# 3. Tensors produced on one stream and consumed on another that we do not manage this way
#    (gradients read by the d2h stream, activations re-loaded for recompute) are protected with
#    Tensor.record_stream, so the allocator keeps their blocks until the consumer finishes.
# 4. Host visibility: the CPU reads host memory written by the d2h stream only after
#    synchronising the last d2h event (end of backward for gradients, end of forward for
#    buffers written back), and the h2d stream waits on the d2h stream before every load, so
#    a load never reads host memory that a write-back has not finished.
# 5. Gradients in flight: on a GPU, backward produces gradients far faster than PCIe drains
#    them, and a gradient block handed to the d2h stream is only reusable once its copy ran, so
#    without a limit every gradient of a slice would pile up on the device. `throttle_d2h`
#    blocks the calling thread (autograd's, inside the gradient hook) until the gradient bytes
#    queued on the d2h stream are within a limit, keeping the device bound deterministic:
#    the limit is one (the largest) gradient, so at most that one is copying while the next is
#    produced. The copy engine stays busy, and backward on such a model is PCIe-bound anyway.


class _Streams:
    """CUDA streams and events for one device; every method is a no-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._h2d: torch.cuda.Stream | None = None
        self._d2h: torch.cuda.Stream | None = None
        self._pending_done: list[torch.cuda.Event] = []
        self._inflight: deque[tuple[torch.cuda.Event, int]] = deque()
        self._inflight_bytes = 0
        if self.is_cuda:
            self._h2d = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._d2h = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on_h2d(self) -> Iterator[None]:
        """Run the body on the h2d stream, after pending evictions and write-backs.

        See [Note: Copy stream ordering], points 2 and 4.
        """
        if self._h2d is None or self._d2h is None:
            yield
            return
        for event in self._pending_done:
            self._h2d.wait_event(event)
        self._pending_done.clear()
        self._h2d.wait_stream(self._d2h)
        with torch.cuda.stream(self._h2d):
            yield

    @contextlib.contextmanager
    def on_d2h(self) -> Iterator[None]:
        """Run the body on the d2h stream, after all compute enqueued so far."""
        if self._d2h is None:
            yield
            return
        self._d2h.wait_stream(self._compute())
        with torch.cuda.stream(self._d2h):
            yield

    def record_h2d(self) -> torch.cuda.Event | None:
        """Event marking completion of the loads enqueued so far."""
        if self._h2d is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._h2d)
        return event

    def record_d2h(self) -> torch.cuda.Event | None:
        """Event marking completion of the host copies enqueued so far."""
        if self._d2h is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._d2h)
        return event

    def compute_wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for ``event`` (a load). See the Note, point 1."""
        if event is not None:
            self._compute().wait_event(event)

    def evicted(self) -> None:
        """Record that storages used by the compute stream so far were just freed.

        See [Note: Copy stream ordering], point 2.
        """
        if self.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._compute())
            self._pending_done.append(event)

    def used_by_d2h(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s block alive until the d2h stream has read it (point 3)."""
        if self._d2h is not None and tensor.device.type == "cuda":
            tensor.record_stream(self._d2h)

    def used_by_compute(self, tensor: torch.Tensor) -> None:
        """Keep an h2d-allocated ``tensor`` alive until compute has used it (point 3)."""
        if self.is_cuda and tensor.device.type == "cuda":
            tensor.record_stream(self._compute())

    def throttle_d2h(self, nbytes: int, limit: int) -> None:
        """Account ``nbytes`` just queued on the d2h stream; wait while more than ``limit``
        bytes are in flight (the newest copy always stays queued). See the Note, point 5."""
        if self._d2h is None:
            return
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._d2h)
        self._inflight.append((event, nbytes))
        self._inflight_bytes += nbytes
        while len(self._inflight) > 1 and self._inflight_bytes > limit:
            oldest, size = self._inflight.popleft()
            oldest.synchronize()
            self._inflight_bytes -= size

    def synchronize(self, event: torch.cuda.Event | None) -> None:
        """Block the calling thread until ``event`` completed (point 4)."""
        if event is not None:
            event.synchronize()
        while self._inflight and self._inflight[0][0].query():  # type: ignore[no-untyped-call]
            self._inflight_bytes -= self._inflight.popleft()[1]
