"""The one place that depends on torch behaviour that is not a documented API.

``torch.distributed.autograd.get_gradients`` raises a plain ``RuntimeError`` when the worker has
never seen the given context. There is no public predicate for "this worker knows the context",
so we recognise that error by its message.
``tests/test_distributed.py::test_unknown_context_on_owner_means_no_gradients`` pins it.

The direct step channel (see [Note: Direct step channel]) also relies on ``get_gradients``
working from a plain thread, not only from RPC threads (the context container is process-global;
documented nowhere): ``tests/test_channel.py::test_get_gradients_from_a_non_rpc_thread`` pins it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

__all__ = ["context_gradients", "is_rref", "is_unknown_context_error"]

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
