"""The TorchScript entry point for ``DistributedOptimizer.step`` requests.

It is compiled on import, on the trainer and on every owner (:mod:`shardkit.rpc._owner`, whose
``_remote_new`` builds an owner's optimizer, imports it there);
``script_step`` is ``None`` where TorchScript is unavailable, and steps then take the Python RPC
entry points of :mod:`shardkit.rpc._owner`. See [Note: Step requests].
"""

# No `from __future__ import annotations` here: TorchScript reads these functions' annotations
# as objects (string annotations of an ignored function fail to resolve).
import warnings
from typing import Any, Optional

import torch
from shardkit.rpc._local_optimizer import step_and_wait
from shardkit.rpc._logging import logger

__all__ = ["script_step"]

# [Note: Step requests]
# A step is one `rpc_async` per owner, sent to all owners before waiting on any; the futures are
# chained (`torch.futures.collect_all`) so the trainer wakes once. What travels is the smallest
# thing torch RPC can send:
#
# - No hyper-parameter change (the common case): a TorchScript call to `_remote_step_script`
#   with two ints, the optimizer handle and the context id. torch serialises it in C++ and the
#   owner runs it without unpickling anything; the only Python it runs is the step itself
#   (`step_and_wait`, reached through `torch.jit.ignore`), under one GIL acquisition, and its
#   reply (`None`, or the failure as text) goes back as a TorchScript value. A Python RPC
#   instead pickles the call on the trainer, unpickles it on the owner, pickles the reply there
#   and unpickles it on the trainer, each under the GIL: measured on the 2-core test machine,
#   that is ~0.3 ms of a ~0.9 ms no-op round trip to two owners, which alone is more than
#   torch's whole TorchScript step. The optimizer itself still runs in Python, so any
#   `torch.optim.Optimizer` works (nothing about it is scripted).
# - Some options changed ([Note: Hyper-parameter forwarding]): a Python RPC to
#   `_remote_step_with(handle, context_id, updates)`; `updates` holds only the changed keys of
#   the owner's groups, so a tensor lr or tuple betas arrive as they are.
#
# Both go through the same per-parameter queue ([Note: Per-optimizer serial queue]), so mixing
# them (and state_dict / load_state_dict) stays exact. One difference: a TorchScript function
# cannot return a Python Future (its reply must be a TorchScript value), so a script step that
# finds its queue busy waits on its RPC server thread (`SerialQueue.run`) until the queue's
# holder has run its step (or handed it the queue), where a Python step only enqueues and
# releases it (`SerialQueue.submit`). Waiting threads cost no CPU and cannot deadlock: no
# queued operation needs another RPC thread to run. With more concurrent
# trainers on one owner than the RPC agent has server threads (`num_worker_threads`, 16 by
# default), other requests to that owner wait for a free thread.
#
# Where TorchScript cannot be used (`PYTORCH_JIT=0`, or a torch whose `torch.jit.script` /
# `torch.jit.ignore` fail or are gone: deprecated since torch 2.13), `script_step` is None, that
# is logged once per process,
# and every step takes `_remote_step` / `_remote_step_with` (same results). `_remote_new`
# reports each owner's availability, so a trainer uses the script call only for owners that
# compiled it too.


def _step_in_python(handle: int, context_id: int) -> Optional[str]:  # noqa: UP045 (TorchScript)
    # Marked `torch.jit.ignore` by `_compile` (in place): TorchScript calls it as Python.
    return step_and_wait(handle, context_id)


def _remote_step_script(handle: int, context_id: int) -> Optional[str]:  # noqa: UP045
    failure: Optional[str] = _step_in_python(handle, context_id)  # noqa: UP045
    return failure


def _compile() -> Any:
    """``_remote_step_script`` as a ``torch.jit.ScriptFunction``, or ``None`` (logged)."""
    try:
        with warnings.catch_warnings():
            # torch >= 2.13 deprecates `torch.jit.script`; this internal use is deliberate.
            warnings.filterwarnings("ignore", r".*torch\.jit\.script", DeprecationWarning)
            torch.jit.ignore(_step_in_python)  # type: ignore[no-untyped-call]  # marks it in place
            compiled: Any = torch.jit.script(_remote_step_script)
    except Exception as err:
        logger.warning(
            "shardkit.rpc: TorchScript could not compile the step entry point (%s: %s); "
            "DistributedOptimizer steps use Python RPC calls (same results, slower)",
            type(err).__name__,
            err,
        )
        return None
    if not isinstance(compiled, torch.jit.ScriptFunction):
        logger.info(
            "shardkit.rpc: TorchScript is disabled (PYTORCH_JIT=0?); DistributedOptimizer steps "
            "use Python RPC calls (same results, slower)"
        )
        return None
    return compiled


script_step: Any = _compile()
