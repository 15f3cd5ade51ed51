"""Large allocations made by a package's own code, counted per operator call.

[Note: Counting our allocations]
A buffer freed and allocated again every step costs resident memory on CPU (glibc keeps the
freed pages and hands out new ones when the sizes interleave) and reserved memory on CUDA.
:class:`LargeAllocations` finds such allocations: it is a dispatch mode, so it sees every
operator the dispatcher runs on this thread, below autograd and in backward hooks too, and
records each new tensor storage of at least ``min_bytes`` (an operator whose output shares the
storage of an input, a view, an in-place or ``out=`` op, allocates nothing) together with the
code that asked for it: the innermost Python frame outside torch. The allocation counts when
that frame belongs to one of ``packages`` (module names), and not when it is anybody else's:

- a kernel of autograd (the gradient of a param, of an activation) runs from the autograd
  engine, whose innermost Python caller is the code that called ``backward()``: not counted;
- the model's own forward runs inside ``nn.Module.__call__``: the walk stops at that frame, so
  the activations of a module that a package's ``forward`` calls are the model's; a hook the
  package registers on a module runs inside that frame and is the package's;
- a torch-function mode on the stack (shardkit-ddp's param-access guard, left there by a
  wrapper whose training ended with a ``step()``) only passes each call on: its
  ``__torch_function__`` frame is skipped, and the call belongs to whoever made it;
- an operator's own implementation (a collective's internal buffers, a fused optimizer's
  kernels) is not dispatched to the mode again: the operator is counted as one call, by its
  outputs.

Counting by operator, not by allocator event, makes the figure independent of the allocator
and of the machine: the same program records the same allocations on every run.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from shardkit.testing._torch_compat import TorchDispatchMode

__all__ = ["Allocation", "LargeAllocations"]


@dataclass(frozen=True)
class Allocation:
    """One new tensor storage recorded by :class:`LargeAllocations`."""

    op: str
    """The operator that allocated it (``aten.empty.memory_format``, ``aten.clone.default``)."""
    nbytes: int
    """Bytes of the new storage."""
    where: str
    """The package code that asked for it: ``module:line (function)``."""


class LargeAllocations(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's base
    """Records the tensors of at least ``min_bytes`` that code of ``packages`` allocates.

    See [Note: Counting our allocations] for what counts. Use as a context manager around the
    code under test (a training step); ``records`` lists what was allocated, in order. Works on
    the thread that enters it (and the backward passes that thread runs).

    Args:
        min_bytes: the smallest storage recorded (default 64 KiB).
        packages: module-name prefixes of the code whose allocations count (default
            ``("shardkit.",)``: every shardkit package but this one).
    """

    def __init__(
        self, min_bytes: int = 64 * 1024, packages: Sequence[str] = ("shardkit.",)
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        if isinstance(packages, str) or not all(isinstance(p, str) for p in packages):
            raise TypeError(
                f"packages must be a sequence of module-name prefixes, got {packages!r}"
            )
        self.min_bytes = min_bytes
        self.packages = tuple(packages)
        self.records: list[Allocation] = []
        """Every allocation recorded, in order."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage(t)[0] for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            ptr, nbytes = _storage(t)
            if nbytes >= self.min_bytes and ptr not in inputs:
                where = self._owner(_caller())
                if where is not None:
                    self.records.append(Allocation(str(func), nbytes, where))
        return out

    def _owner(self, frame: FrameType | None) -> str | None:
        """``module:line (function)`` of the innermost frame outside torch when it is one of
        ``packages``'; ``None`` when it is anybody else's, or the model's forward."""
        while frame is not None:
            module = str(frame.f_globals.get("__name__", ""))
            if module == "torch.nn.modules.module":  # inside a module call: the model's
                return None
            if frame.f_code.co_name == "__torch_function__":  # a mode passing the call on
                frame = frame.f_back
                continue
            if module != "torch" and not module.startswith(("torch.", "shardkit.testing")):
                if module.startswith(self.packages):
                    return f"{module}:{frame.f_lineno} ({frame.f_code.co_name})"
                return None
            frame = frame.f_back
        return None

    def total_bytes(self) -> int:
        """Bytes of every recorded allocation together."""
        return sum(r.nbytes for r in self.records)


def _caller() -> FrameType | None:
    """The frame that called the mode's ``__torch_dispatch__`` (``None`` on a thread without
    Python frames of its own, such as a backend's worker)."""
    frame = inspect.currentframe()  # this function's
    for _ in range(2):  # __torch_dispatch__, then its caller
        frame = frame.f_back if frame is not None else None
    return frame


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of ``t``'s storage; (0, 0) for a tensor without one of its own."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0, 0
    return st.data_ptr(), st.nbytes()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Dense tensors in ``obj`` and its nested lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided and not obj.is_meta:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
