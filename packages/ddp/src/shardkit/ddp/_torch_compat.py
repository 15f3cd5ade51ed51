"""The private torch APIs shardkit-ddp relies on, isolated here and pinned by tests.

* The torch-function mode stack (``torch._C._len_torch_function_stack``,
  ``_pop_torch_function_stack``, ``_push_on_torch_function_stack``): the param-access guard
  ([Note: Param access guard] in ``shardkit.ddp._guard``) is a ``TorchFunctionMode`` that is
  pushed at the end of ``step()`` and must leave the stack once the last param gather is
  waited for, wherever it then sits in the stack. The public ``TorchFunctionMode.__exit__``
  pops the *top* mode, which is another mode's when the user entered one in between (e.g.
  ``with torch.device("meta"):`` or a ``FlopCounterMode`` around the forward).
  ``tests/test_torch_compat.py`` pins the calls.

The end-of-backward callback and the profiler flag come from shardkit-optim's public API
(``shardkit.optim.queue_end_of_backward``, ``shardkit.optim.profiler_range``).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__: list[str] = []


def push_function_mode(mode: TorchFunctionMode) -> None:
    """Pushes ``mode`` on this thread's torch-function mode stack (what ``with mode:`` does on
    entry; :func:`remove_function_mode` takes it off again)."""
    torch._C._push_on_torch_function_stack(mode)  # noqa: SLF001 (pinned torch internal)


def remove_function_mode(mode: TorchFunctionMode) -> bool:
    """Takes ``mode`` off this thread's torch-function mode stack, wherever it sits; the modes
    above it stay, in their order. Returns whether ``mode`` was on the stack."""
    above: list[TorchFunctionMode] = []
    found = False
    for _ in range(torch._C._len_torch_function_stack()):  # noqa: SLF001 (pinned torch internal)
        top = torch._C._pop_torch_function_stack()  # noqa: SLF001 (pinned torch internal)
        if top is mode:
            found = True
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)  # noqa: SLF001 (pinned torch internal)
    return found
