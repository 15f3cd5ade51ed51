"""Pins the private torch APIs of ``shardkit.optim._torch_compat``: the torch-function mode stack
the param-access guard is pushed on and taken off ([Note: Param access guard])."""

from __future__ import annotations

from typing import Any

import torch
from shardkit.optim._torch_compat import (
    function_mode_at,
    function_mode_count,
    functorch_base,
    pop_function_mode,
    push_function_mode,
    remove_function_mode,
)
from torch.overrides import TorchFunctionMode


class _Tag(TorchFunctionMode):
    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name = name
        self.log = log

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.log.append(self.name)
        return func(*args, **(kwargs or {}))


def test_remove_a_mode_from_under_another_keeps_the_others_in_order() -> None:
    log: list[str] = []
    low, mid, top = _Tag("low", log), _Tag("mid", log), _Tag("top", log)
    depth = torch._C._len_torch_function_stack()
    t = torch.ones(1)
    with low:
        push_function_mode(mid)
        with top:
            t.add_(1)
            assert log == ["top", "mid", "low"]
            assert remove_function_mode(mid) is True
            assert torch._C._len_torch_function_stack() == depth + 2
            log.clear()
            t.add_(1)
            assert log == ["top", "low"]  # order kept, mid gone
            assert remove_function_mode(mid) is False  # not on the stack: nothing changes
            assert torch._C._len_torch_function_stack() == depth + 2
        # ``with top`` popped the top, which is still ``top``
        log.clear()
        t.add_(1)
        assert log == ["low"]
    assert torch._C._len_torch_function_stack() == depth


def test_the_stack_calls_see_and_take_the_top_mode() -> None:
    """``function_mode_count`` / ``function_mode_at`` / ``pop_function_mode``: what the guard's
    leave reads first (the guard on top: one pop)."""
    log: list[str] = []
    low, top = _Tag("low", log), _Tag("top", log)
    depth = function_mode_count()
    t = torch.ones(1)
    with low:
        push_function_mode(top)
        assert function_mode_count() == depth + 2
        assert function_mode_at(depth + 1) is top and function_mode_at(depth) is low
        assert pop_function_mode() is top
        assert function_mode_count() == depth + 1
        t.add_(1)
        assert log == ["low"]
    assert function_mode_count() == depth


def test_a_mode_is_off_the_stack_while_its_own_handler_runs() -> None:
    """The guard relies on it: inside its own call it is not on the stack, so it must not try
    to remove itself there ([Note: Param access guard])."""
    seen: list[bool] = []

    class _Probe(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.append(remove_function_mode(self))
            return func(*args, **(kwargs or {}))

    probe = _Probe()
    t = torch.ones(1)
    push_function_mode(probe)
    t.add_(1)
    assert seen == [False]
    assert remove_function_mode(probe) is True  # torch pushed it back after the call


class _Seen(TorchFunctionMode):
    """Records the storage pointer of every tensor argument, unwrapped as the guard does."""

    def __init__(self) -> None:
        super().__init__()
        self.ptrs: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor):
                try:
                    self.ptrs.append(a.data_ptr())
                except RuntimeError:
                    base = functorch_base(a)
                    if base is not None:
                        self.ptrs.append(base.data_ptr())
        return func(*args, **(kwargs or {}))


def test_functorch_wrappers_unwrap_to_the_param() -> None:
    """Inside ``grad_and_value`` (and nested in ``vmap``) a param is a wrapper without storage;
    ``functorch_base`` finds the param's storage; a plain tensor is no wrapper."""
    w = torch.nn.Parameter(torch.randn(3, 3))
    assert functorch_base(w) is None

    def f(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (x @ params["w"]).sum()

    seen = _Seen()
    with seen:
        torch.func.grad_and_value(f)({"w": w}, torch.randn(2, 3))
    assert w.data_ptr() in seen.ptrs
    seen = _Seen()
    with seen:
        torch.func.vmap(lambda x: torch.func.grad(f)({"w": w}, x))(torch.randn(4, 2, 3))
    assert w.data_ptr() in seen.ptrs
