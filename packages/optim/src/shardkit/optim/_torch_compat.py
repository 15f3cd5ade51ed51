"""The one place shardkit-optim reads torch internals (and, through its public API, the
distributions built on it: shardkit-ddp and shardkit-overlap use :func:`queue_end_of_backward`,
the profiler flag through ``shardkit.optim.profiler_range`` and the collective shims from here
instead of keeping copies).

* ``torch.autograd.Variable._execution_engine.queue_callback``: runs a function once the  # noqa: SLF001 (pinned torch internal)
  autograd engine has finished the current backward pass, after the callbacks queued before it
  (torch's DDP queues its ``finalize_backward`` there; FSDP relies on it too). There is no
  public equivalent: a post-accumulate-grad hook fires per param, and params unused in a
  backward fire none. ``tests/test_torch_compat.py::test_queue_callback_runs_after_every_hook``
  pins it.
* ``torch._C._autograd._profiler_enabled``: whether a profiler records on this thread (every
  torch profiler entry point: ``torch.profiler.profile``, ``torch.autograd.profiler.profile``,
  ``emit_nvtx``, ``emit_itt``; autograd's worker threads inherit the state); what
  ``torch.autograd._profiler_enabled`` re-exports privately. No public equivalent.
  ``tests/test_torch_compat.py::test_profiling_flag_follows_the_profiler`` pins it.
* ``torch.distributed.distributed_c10d._get_default_store``: the c10d store
  ``init_process_group`` built the default group from (torchrun's TCPStore, a FileStore, ...),
  which the call agreement runs on (see [Note: Agreement over the store] in ``_agreement.py``).
  torch keeps it only in its private group registry; ``default_store()`` reads it.
  ``tests/test_torch_compat.py::test_default_store_is_shared_by_the_ranks`` pins what the
  agreement relies on: one store seen by every rank, ``clone()``, ``compare_set``'s
  first-writer-wins, a ``wait`` that times out and leaves the client usable, ``multi_get``,
  ``delete_key``.

* The torch-function mode stack (``torch._C._len_torch_function_stack``,
  ``_get_function_stack_at``, ``_pop_torch_function_stack``, ``_push_on_torch_function_stack``):
  the param-access guard
  ([Note: Param access guard] in ``shardkit.optim._gather``) is a ``TorchFunctionMode`` that is
  pushed at the end of ``step()`` and must leave the stack once the last param gather is
  waited for, wherever it then sits in the stack. The public ``TorchFunctionMode.__exit__``
  pops the *top* mode, which is another mode's when the user entered one in between (e.g.
  ``with torch.device("meta"):`` or a ``FlopCounterMode`` around the forward).
  ``tests/test_torch_compat_modes.py`` pins the calls.

The internals a hot path calls (``queue_end_of_backward``, ``profiling``, the mode-stack calls)
are torch's own C functions bound to public names here, not wrappers: a step runs no Python
frame of this module.

* ``torch._C._functorch.is_functorch_wrapped_tensor`` / ``get_unwrapped``: a tensor inside a
  ``torch.func`` transform (``grad``, ``grad_and_value``, ``vjp``, ``jacrev``, ``vmap``) is a
  functorch wrapper without storage of its own around the tensor passed in; the param-access
  guard unwraps it to the param's storage to match it ([Note: Param access guard]).
  ``tests/test_torch_compat_modes.py::test_functorch_wrappers_unwrap_to_the_param`` pins it.

* ``torch.Tensor._version``: the version counter autograd keeps per tensor, bumped by every
  in-place op on it (``copy_`` in ``load_state_dict``, ``nn.init``, ``p.mul_``), not by writes
  through ``p.data`` nor through another tensor that shares its storage without being its view
  (a flat buffer the param was re-pointed into). Master weights use it to notice params
  written outside the optimizer ([Note: Params written outside the optimizer] in
  ``_master_set.py``); there is no public equivalent short of comparing values every step.
  ``tests/test_torch_compat.py::test_version_counter_pin`` pins what is relied on.

* The torch-function mode stack (``torch._C._len_torch_function_stack``,
  ``_pop_torch_function_stack``, ``_push_on_torch_function_stack``): the compiled compact step
  runs its two compiled kernels with the thread's stack set aside (:func:`no_function_modes`),
  because ``torch.compile`` traces an active mode's ``__torch_function__`` into its graph and
  guards on the mode's state: a mode that counts its calls (shardkit-ddp's param-access guard,
  on the stack after a ``step()`` of ``ShardedDataParallel``) would make every call recompile.
  The kernels touch only the optimizer's own state and scratch, never what a mode watches for;
  torch's Adam between them runs with the modes in place. There is no public way to set the
  stack aside (``torch.overrides`` enters modes, it does not leave them).
  ``tests/test_torch_compat.py::test_no_function_modes_sets_the_stack_aside`` pins it.

* ``torch._inductor.config``: which options this torch's inductor has.
  ``torch.compile(options=...)`` raises on a name it does not know, and the compact step's
  one kernel asks for one that torch added lately (``eager_numerics.division_rounding``:
  Triton's correctly rounded division, [Note: One kernel on a GPU] in ``_compact_kernel.py``);
  :func:`inductor_options` keeps the names this torch has, read off
  ``torch._inductor.list_options()``; there is no public list of them.
  ``tests/test_torch_compat.py::test_inductor_options_keeps_the_known_ones`` pins it.

One internal is overridden rather than read: ``torch.amp.GradScaler._unscale_grads_(optimizer,
inv_scale, found_inf, allow_fp16) -> {device: found_inf}``, which ``GradScaler.unscale_`` calls
and whose result becomes the optimizer's found-inf flags. ``ShardedGradScaler`` overrides it to
unscale master-weight gradients in fp32 (see [Note: Master weights]);
``tests/test_master.py::test_grad_scaler_unscale_hook_pin`` pins the call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.distributed_c10d import Store
from torch.overrides import TorchFunctionMode

__all__ = [
    "all_gather_single",
    "default_store",
    "function_mode_at",
    "function_mode_count",
    "functorch_base",
    "inductor_options",
    "no_function_modes",
    "pop_function_mode",
    "profiling",
    "push_function_mode",
    "queue_end_of_backward",
    "reduce_scatter_single",
    "remove_function_mode",
    "tensor_version",
]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (now deprecated, with a
# FutureWarning per call) to all_gather_single / reduce_scatter_single; older torch has only
# the first names.
all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
"""``all_gather_single(output, input, group=None, async_op=False)``: one tensor in, one out."""
reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
"""``reduce_scatter_single(output, input, op=SUM, group=None, async_op=False)``."""

logger = logging.getLogger("shardkit.optim")
_logged_no_flag = False


queue_end_of_backward: Callable[[Callable[[], None]], None] = (
    Variable._execution_engine.queue_callback  # noqa: SLF001 (pinned torch internal)
)
"""``queue_end_of_backward(fn)`` runs ``fn`` once the running backward pass finishes, after
earlier queued callbacks. Call it from inside a backward pass (an autograd hook or a DDP comm
hook). torch's own bound method (the engine is a process-wide singleton), so a call runs no
Python frame of this module."""


def default_store() -> Store:
    """The c10d store of the default process group (every rank's client of the same store).

    Raises:
        RuntimeError: this torch keeps it elsewhere (the call agreement cannot run).
    """
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise RuntimeError(
            "shardkit.optim: this torch has no torch.distributed.distributed_c10d."
            "_get_default_store(), which the call agreement needs; use a torch that "
            "shardkit-optim supports (see its README)"
        )
    store = get()
    if not isinstance(store, Store):
        raise RuntimeError(f"the default process group has no c10d store (got {store!r})")
    return store


def _profiling_fallback() -> bool:
    """Where torch has no C flag: ranges are always opened (logged once)."""
    global _logged_no_flag
    if not _logged_no_flag:
        _logged_no_flag = True
        logger.info(
            "shardkit: torch._C._autograd._profiler_enabled is gone in this torch; "
            "profiler ranges are opened on every step (logged once)"
        )
    return True


profiling: Callable[[], bool] = getattr(
    torch._C._autograd,  # noqa: SLF001 (pinned torch internal)
    "_profiler_enabled",
    _profiling_fallback,
)
"""``profiling()``: whether a torch profiler records on this thread (``torch.profiler.profile``,
``torch.autograd.profiler.profile``, ``emit_nvtx``, ``emit_itt``; autograd's worker threads
inherit the state). torch's own C function (no Python frame), so the engine's hot paths call it
before they build a range ([Note: Profiler ranges] in ``_profiling.py``). Where torch no longer
has it, ranges are always opened (logged once): the same traces, a few microseconds more per
range."""


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: it changes with every in-place op on ``t`` or its views."""
    return int(t._version)  # noqa: SLF001 (pinned torch internal)


push_function_mode: Callable[[TorchFunctionMode], None] = (
    torch._C._push_on_torch_function_stack  # noqa: SLF001 (pinned torch internal)
)
"""``push_function_mode(mode)`` pushes ``mode`` on this thread's torch-function mode stack (what
``with mode:`` does on entry; :func:`remove_function_mode` takes it off again)."""

function_mode_count: Callable[[], int] = (
    torch._C._len_torch_function_stack  # noqa: SLF001 (pinned torch internal)
)
"""``function_mode_count()``: the depth of this thread's torch-function mode stack."""

function_mode_at: Callable[[int], TorchFunctionMode] = (
    torch._C._get_function_stack_at  # noqa: SLF001 (pinned torch internal)
)
"""``function_mode_at(i)``: the mode at depth ``i`` (``function_mode_count() - 1``: the top)."""

pop_function_mode: Callable[[], TorchFunctionMode] = (
    torch._C._pop_torch_function_stack  # noqa: SLF001 (pinned torch internal)
)
"""``pop_function_mode()``: takes the top mode off this thread's stack and returns it."""


def remove_function_mode(mode: TorchFunctionMode) -> bool:
    """Takes ``mode`` off this thread's torch-function mode stack, wherever it sits; the modes
    above it stay, in their order. Returns whether ``mode`` was on the stack."""
    above: list[TorchFunctionMode] = []
    found = False
    for _ in range(function_mode_count()):
        top = pop_function_mode()
        if top is mode:
            found = True
            break
        above.append(top)
    for m in reversed(above):
        push_function_mode(m)
    return found


@contextlib.contextmanager
def no_function_modes() -> Iterator[None]:
    """Runs the body with this thread's torch-function mode stack empty; restores it after."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:  # noqa: SLF001 (pinned torch internal)
        modes.append(torch._C._pop_torch_function_stack())  # noqa: SLF001 (pinned torch internal)
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)  # noqa: SLF001 (pinned torch internal)


_absent_options: set[str] = set()


def inductor_options(wanted: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``wanted`` whose names this torch's inductor has (dotted for nested ones,
    e.g. ``"eager_numerics.division_rounding"``), for ``torch.compile(options=)``, which raises
    on an unknown name; each absent one is left out, logged once."""
    import torch._inductor as inductor

    known = set(inductor.list_options())
    for name in sorted(wanted.keys() - known - _absent_options):
        _absent_options.add(name)
        logger.info(
            "torch %s's inductor has no option %r: compiled without it", torch.__version__, name
        )
    return {name: value for name, value in wanted.items() if name in known}


def functorch_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a ``torch.func`` wrapper (at any depth of nested transforms) wraps, or
    ``None`` if ``t`` is no such wrapper."""
    functorch = torch._C._functorch  # noqa: SLF001 (pinned torch internal)
    if not functorch.is_functorch_wrapped_tensor(t):
        return None
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t
