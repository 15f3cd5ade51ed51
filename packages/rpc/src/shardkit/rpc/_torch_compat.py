"""The one place that depends on torch behaviour that is not a documented API.

``torch.distributed.autograd.get_gradients`` raises a plain ``RuntimeError`` when the worker has
never seen the given context. There is no public predicate for "this worker knows the context",
so we recognise that error by its message.
``tests/test_distributed.py::test_unknown_context_on_owner_means_no_gradients`` pins it.

``torch.autograd.profiler._is_profiler_enabled`` is the process-wide flag every torch profiler
entry point (``torch.profiler.profile``, ``torch.autograd.profiler.profile``, ``emit_nvtx``,
``emit_itt``) sets while it runs; torch's own compiler reads it to skip its ranges when nobody
profiles. There is no public equivalent. ``tests/test_single_process.py::
test_profiling_flag_follows_the_profiler`` pins it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc._logging import log_once

__all__ = ["context_gradients", "is_rref", "is_unknown_context_error", "profiling"]

# `torch.distributed.rpc.PyRRef` is the documented RRef class (`rpc.RRef` is only its typing
# alias: `isinstance(rpc.remote(...), rpc.RRef)` is False), but torch's stubs do not re-export it.
_PYRREF: type[Any] = rpc.PyRRef  # type: ignore[attr-defined]


def is_rref(value: object) -> bool:
    """Whether ``value`` is an RPC RRef (what ``rpc.remote`` / ``rpc.RRef(x)`` return)."""
    return isinstance(value, _PYRREF)


_UNKNOWN_CONTEXT_PREFIX = "Could not find autograd context with id"


def is_unknown_context_error(err: BaseException) -> bool:
    """Whether ``err`` is dist_autograd's "no such context on this worker" error."""
    return isinstance(err, RuntimeError) and _UNKNOWN_CONTEXT_PREFIX in str(err)


def context_gradients(
    context_id: int, *, missing_ok: bool
) -> dict[torch.Tensor, torch.Tensor] | None:
    """Gradients recorded on this worker in ``context_id``.

    Args:
        context_id: A distributed autograd context id.
        missing_ok: Return ``None`` instead of raising when this worker never took part in the
            context (an owner whose parameters were not used by that forward pass).

    Returns:
        Parameter -> gradient, or ``None`` when the context is unknown here and ``missing_ok``.
    """
    try:
        grads: dict[torch.Tensor, torch.Tensor] = dist_autograd.get_gradients(context_id)  # type: ignore[attr-defined]
        return grads
    except RuntimeError as err:
        if missing_ok and is_unknown_context_error(err):
            return None
        raise


def profiling() -> bool:
    """Whether a torch profiler is running in this process (any thread).

    See [Note: RPC profiler ranges]. Where torch no longer has the flag, ranges are always recorded
    (logged once): the same traces, a few microseconds more per step.
    """
    flag = getattr(autograd_profiler, "_is_profiler_enabled", None)
    if isinstance(flag, bool):
        return flag
    log_once(
        "profiler-flag",
        logging.INFO,
        "shardkit.rpc: torch.autograd.profiler._is_profiler_enabled is gone in torch %s; "
        "profiler ranges are recorded on every step, profiled or not",
        torch.__version__,
    )
    return True
