"""``copy.deepcopy`` of a module wrapped by ``ShardedDataParallel`` gives a plain module.

[Note: Plain deepcopy]
The wrapper registers hooks on the user's module: a forward pre-hook on every submodule that
holds bucketed params (it waits for that submodule's deferred param gathers, [Note: Deferred
param gather]) and a state-dict pre-hook on the root. Those hooks refer to the wrapper, which
holds a process group, so a plain deepcopy of the module (EMA and eval copies; fairscale's
parity suite) would try to copy the wrapper and fail (``cannot pickle ProcessGroup``); torch
DDP registers nothing on the module and its module deep-copies cleanly. So:

- every such hook is registered through :func:`our_hook`, which records it (weakly) as the
  wrapper's: the registered callable is the wrapper's own bound method, called by torch with
  no trampoline between;
- every module that carries one gets a ``__deepcopy__`` *instance* attribute
  (:class:`_PlainCopy`; ``copy.deepcopy`` looks ``__deepcopy__`` up on the object, and
  ``nn.Module`` defines none), which first waits for every deferred param gather (so the copy
  sees finished params), then copies the module the way ``copy.deepcopy`` would without it
  (``__getstate__``, a new instance of the same class, ``__setstate__`` with the deep-copied
  state), leaving out its own entry and every recorded hook of its hook dicts.

The params themselves copy as ``nn.Parameter.__deepcopy__`` does: a clone of the param's own
view of the flat buffer (its numel, not the bucket), without ``.grad`` and without the
wrapper's tensor hooks. Deep-copying a submodule alone works the same way. The copy shares
nothing with the original: it trains with a plain optimizer and the original keeps its hooks.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any, cast

from torch import nn

__all__: list[str] = []


_OURS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""The module hooks of ``ShardedDataParallel`` s, left out of deep copies (held weakly: a hook
dict that drops one drops it here too)."""


def our_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Records ``fn`` (the very object to register as a module hook) as a wrapper's hook;
    returns it."""
    _OURS.add(fn)
    return fn


class _PlainCopy:
    """``__deepcopy__`` of one module that carries a wrapper's hooks; see [Note: Plain
    deepcopy]."""

    __slots__ = ("_module", "_wait")

    def __init__(self, module: nn.Module, wait: Callable[[], None]) -> None:
        self._module = weakref.ref(module)
        self._wait = wait

    def __call__(self, memo: dict[int, Any]) -> nn.Module:
        module = self._module()
        if module is None:  # pragma: no cover - only reachable through the module itself
            raise RuntimeError("the module of this __deepcopy__ no longer exists")
        self._wait()
        state = dict(cast(Any, module).__getstate__())
        state.pop("__deepcopy__", None)
        for key, value in state.items():
            if isinstance(value, dict) and any(_is_ours(h) for h in value.values()):
                state[key] = type(value)((k, h) for k, h in value.items() if not _is_ours(h))
        cls = type(module)
        out = cls.__new__(cls)
        memo[id(module)] = out
        cast(Any, out).__setstate__(copy.deepcopy(state, memo))
        return out


def _is_ours(hook: object) -> bool:
    """A hook of the wrapper (:func:`our_hook`), or one that torch stored wrapped with its
    module (``register_load_state_dict_pre_hook`` keeps the hook as the wrapper's ``.hook``).
    ``in`` on a ``WeakSet`` is ``False`` for what cannot be weakly referenced."""
    return hook in _OURS or getattr(hook, "hook", None) in _OURS


def make_deepcopy_plain(module: nn.Module, wait: Callable[[], None]) -> None:
    """Installs :class:`_PlainCopy` on ``module`` (unless its class defines ``__deepcopy__``)."""
    if getattr(type(module), "__deepcopy__", None) is not None:
        return
    object.__setattr__(module, "__deepcopy__", _PlainCopy(module, wait))


def drop_deepcopy_plain(module: nn.Module) -> None:
    """Removes the :class:`_PlainCopy` :func:`make_deepcopy_plain` installed (``close()``)."""
    if isinstance(module.__dict__.get("__deepcopy__"), _PlainCopy):
        object.__delattr__(module, "__deepcopy__")
