"""``LargeAllocations``: the large tensors a package's own code allocates (see [Note: Counting
our allocations] in ``shardkit.testing._allocations``), and the pin of the private dispatch
mode it is built on."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from shardkit.testing import LargeAllocations
from shardkit.testing._torch_compat import TorchDispatchMode
from torch import nn

_BIG = 1 << 20  # elements: 4 MiB of fp32

# A stand-in for a package: functions whose frames carry the module name "fakepkg.code".
_pkg = types.ModuleType("fakepkg.code")
exec(
    """
import torch

def allocate(n):
    return torch.empty(n)

def in_place(t):
    t.mul_(2)
    return t[: t.numel() // 2].view(-1)

def call_model(model, x):
    return model(x)

def pre_hook(module, args):
    module.scratch = torch.zeros(module.weight.numel())

def grad_hook(p):
    p.kept = p.grad.clone()

class Forwarding(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
""",
    _pkg.__dict__,
)


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_pin() -> None:
    """What LargeAllocations relies on: the mode sees a factory op called from Python and ops
    run by a hook in backward, and an op's own implementation is not dispatched to it again."""
    t = torch.ones(8)
    with _Seen() as seen:
        torch.empty(4)
    assert seen.ops == ["aten.empty.memory_format"]
    with _Seen() as seen:
        t.clone()  # implemented with empty_like + copy_, which the mode does not see
    assert seen.ops == ["aten.clone.default"]
    p = nn.Parameter(torch.ones(4))

    def hook(q: torch.Tensor) -> None:
        torch.zeros(3)

    p.register_post_accumulate_grad_hook(hook)
    with _Seen() as seen:
        (p * 2).sum().backward()
    assert "aten.zeros.default" in seen.ops, seen.ops


def test_records_the_package_allocations_only() -> None:
    small = _BIG // 64  # 64 KiB of fp32
    with LargeAllocations(packages=("fakepkg.",)) as allocs:
        a = _pkg.allocate(_BIG)
        _pkg.allocate(small - 1)  # below min_bytes
        _pkg.allocate(small)  # exactly min_bytes: recorded
        torch.empty(_BIG)  # the caller's own (this test module)
        _pkg.in_place(a)  # in place and a view: nothing new
    assert [(r.op, r.nbytes) for r in allocs.records] == [
        ("aten.empty.memory_format", 4 * _BIG),
        ("aten.empty.memory_format", 4 * small),
    ]
    assert allocs.records[0].where.startswith("fakepkg.code:")
    assert "(allocate)" in allocs.records[0].where
    assert allocs.total_bytes() == 4 * (_BIG + small)


def test_model_forward_and_autograd_kernels_are_not_the_package() -> None:
    model = nn.Linear(512, 512)
    x = torch.randn(1024, 512, requires_grad=True)
    with LargeAllocations(packages=("fakepkg.",)) as allocs:
        out = _pkg.call_model(model, x)  # activations of 2 MiB: the model's
        out.sum().backward()  # gradients of 1-2 MiB: autograd's
    assert allocs.records == []
    model.register_forward_pre_hook(_pkg.pre_hook)
    model.weight.register_post_accumulate_grad_hook(_pkg.grad_hook)
    with LargeAllocations(packages=("fakepkg.",)) as allocs:
        _pkg.call_model(model, x).sum().backward()
    assert [r.where.split(" ")[-1] for r in allocs.records] == ["(pre_hook)", "(grad_hook)"]


def test_a_torch_function_mode_of_the_package_is_not_the_caller() -> None:
    """A package's torch-function mode left on the stack (shardkit-ddp's param-access guard
    after a wrapper's last step) passes calls on: what they allocate is their callers'."""
    model = nn.Linear(512, 512)
    x = torch.randn(1024, 512)
    with _pkg.Forwarding(), LargeAllocations(packages=("fakepkg.",)) as allocs:
        model(x).sum().backward()  # autograd's and the model's, through the mode
        torch.empty(_BIG)  # this test module's
        _pkg.allocate(_BIG)  # the package's own code: still recorded
    assert [r.where.split(" ")[-1] for r in allocs.records] == ["(allocate)"], allocs.records


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="min_bytes"):
        LargeAllocations(min_bytes=-1)
    with pytest.raises(TypeError, match="packages"):
        LargeAllocations(packages="shardkit.")
