"""The one place shardkit-ddp reads torch internals.

``queue_end_of_backward(fn)``: runs ``fn`` once the autograd engine has finished the current
backward pass, by ``torch.autograd.Variable._execution_engine.queue_callback`` (what torch's DDP
and FSDP use for the same purpose). There is no public equivalent: a post-accumulate-grad hook
fires per param, and params unused in this backward fire none, so the end of the pass cannot be
seen otherwise. ``tests/test_torch_compat.py::test_queue_callback_runs_after_every_hook`` pins
that the callback runs once, after every param's post-accumulate-grad hook of the pass.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.autograd import Variable

__all__: list[str] = []


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Queues ``fn`` to run at the end of the running backward pass (call from a backward hook)."""
    Variable._execution_engine.queue_callback(fn)
