"""Drop-in parity with fairscale's ``OffloadModel`` on the inputs it accepts.

Covers a pre-split list of modules passed with ``num_slices``, ``num_slices`` above the length
of an ``nn.Sequential``, batches that ``num_microbatches`` does not divide (split with
``torch.chunk``), and ``.cpu()`` / ``.to()`` on the wrapper.

Each case runs against up to three references on the same weights (same seed, deep copies) and
the same input, comparing forward outputs, parameter gradients and the parameters after one SGD
step:

- ``sequential``: the plain ``nn.Sequential`` run on the same ``torch.chunk`` micro-batches,
  backward per micro-batch in order (gradients accumulate in the same order as ours): bit for
  bit, input gradients included; and the unchunked model within float32 round-off.
- ``fairscale-cpu-shim``: fairscale's own ``OffloadModel`` on a CPU. fairscale refuses to run
  without CUDA (``TypeError: CUDA must be available``) and calls ``torch.cuda.Stream``,
  ``Tensor.cuda()`` and ``Tensor.pin_memory()`` unconditionally; the shim turns those into
  identities (every tensor is already on the CPU) so that fairscale's own slicing, chunking and
  forward/backward code runs unchanged. Bit for bit.
- ``fairscale-cuda``: fairscale's ``OffloadModel`` as is, on a GPU (skipped without one), against
  ours with ``device="cuda"``; within rtol 1e-5 / atol 1e-6 (cuBLAS may pick different kernels
  on different streams).

fairscale itself only supports micro-batches with ``checkpoint_activation=True`` (it raises
``RuntimeError`` otherwise) and returns no input gradients in that mode, so those comparisons
use the ``sequential`` reference only. fairscale also squeezes a trailing dimension of size 1 at
every slice boundary (``torch.cat(...).squeeze(-1)``); the models here have no width-1 layer.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from shardkit.offload import OffloadModel
from torch import nn

_HAS_CUDA = torch.cuda.is_available()  # read before any test patches it (see _fairscale_on_cpu)

Build = Callable[[], "nn.Sequential | list[nn.Module]"]
Move = Callable[[nn.Module], Any]

REFERENCES = [
    "sequential",
    "fairscale-cpu-shim",
    pytest.param(
        "fairscale-cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not _HAS_CUDA,
                reason="fairscale's OffloadModel needs a CUDA GPU (it raises TypeError 'CUDA must "
                "be available' without one); covered on CPU by fairscale-cpu-shim and sequential",
            ),
        ],
    ),
]


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def _presplit() -> list[nn.Module]:
    seq = _net()
    return [seq[0:2], seq[2:4], seq[4:7]]


def _layers(src: nn.Sequential | list[nn.Module]) -> nn.Sequential:
    """The plain model with the same layers (and the same parameter order) as ``src``."""
    return nn.Sequential(*src) if isinstance(src, list) else src


def _fairscale_offload_model() -> type[nn.Module]:
    try:
        with warnings.catch_warnings():  # its import-time torch.cuda.amp deprecation warnings
            warnings.simplefilter("ignore")
            from fairscale.experimental.nn.offload import OffloadModel as FairscaleOffloadModel
    except ImportError:
        pytest.skip("fairscale is not installed")
    cls: type[nn.Module] = FairscaleOffloadModel
    return cls


class _NoStream:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass


@contextlib.contextmanager
def _fairscale_on_cpu() -> Iterator[None]:
    """Let fairscale's OffloadModel run on a CPU (see the module docstring)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "Stream", _NoStream)
        mp.setattr(torch.cuda, "device", _NoStream)
        mp.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        mp.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
        mp.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
        with warnings.catch_warnings():  # torch.cuda.amp.custom_fwd deprecation at call time
            warnings.simplefilter("ignore", FutureWarning)
            yield


@dataclass
class _Result:
    y: torch.Tensor
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    x_grad: torch.Tensor | None = None


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean() + y.sum()


def _finish(y: torch.Tensor, params: list[nn.Parameter], x: torch.Tensor) -> _Result:
    if _HAS_CUDA:  # fairscale drops slices with non_blocking copies on a side stream
        torch.cuda.synchronize()
    grads = []
    for p in params:
        assert p.grad is not None
        grads.append(p.grad.detach().cpu().clone())
    torch.optim.SGD(params, lr=0.1).step()
    return _Result(
        y.detach().cpu(),
        grads,
        [p.detach().cpu().clone() for p in params],
        None if x.grad is None else x.grad.cpu(),
    )


def _train_step(model: nn.Module, x: torch.Tensor) -> _Result:
    y = model(x)
    _loss(y).backward()
    return _finish(y, list(model.parameters()), x)


def _chunked_step(ref: nn.Module, x: torch.Tensor, num_microbatches: int) -> _Result:
    """The plain model on ``torch.chunk`` micro-batches, backward per micro-batch in order."""
    ys = [ref(c) for c in torch.chunk(x, num_microbatches)]
    y = torch.cat(ys)
    gys = torch.autograd.grad(_loss(y), ys)
    for y_m, g_m in zip(ys, gys, strict=True):
        y_m.backward(g_m)
    return _finish(y, list(ref.parameters()), x)


def _ours(
    build: Build,
    x: torch.Tensor,
    device: str = "cpu",
    move: Move | None = None,
    **kwargs: Any,
) -> tuple[_Result, OffloadModel]:
    torch.manual_seed(0)
    model = OffloadModel(build(), device, **kwargs)
    if move is not None:
        assert move(model) is model
    return _train_step(model, x.to(device)), model


def _reference(
    kind: str,
    build: Build,
    x: torch.Tensor,
    move: Move | None = None,
    num_slices: int = 3,
    checkpoint_activation: bool = False,
    num_microbatches: int = 1,
) -> _Result:
    torch.manual_seed(0)
    src = build()
    if kind == "sequential":
        return _chunked_step(_layers(src), x, num_microbatches)
    if num_microbatches > 1 and not checkpoint_activation:
        pytest.skip(
            "fairscale's OffloadModel raises RuntimeError for micro-batches without "
            "checkpoint_activation=True; this case is compared with the sequential reference"
        )
    cls = _fairscale_offload_model()
    shim = _fairscale_on_cpu() if kind == "fairscale-cpu-shim" else contextlib.nullcontext()
    device = torch.device("cpu" if kind == "fairscale-cpu-shim" else "cuda")
    with shim:
        model = cls(
            src,
            device,
            num_slices=num_slices,
            checkpoint_activation=checkpoint_activation,
            num_microbatches=num_microbatches,
        )
        if move is not None:
            move(model)
        return _train_step(model, x.to(device))


def _assert_equal(ours: _Result, ref: _Result, exact: bool, inputs: bool = False) -> None:
    def check(a: torch.Tensor, b: torch.Tensor) -> None:
        if exact:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    check(ours.y, ref.y)
    assert len(ours.grads) == len(ref.grads)
    for a, b in zip(ours.grads, ref.grads, strict=True):
        check(a, b)
    for a, b in zip(ours.params, ref.params, strict=True):
        check(a, b)
    if inputs:
        assert ours.x_grad is not None and ref.x_grad is not None
        check(ours.x_grad, ref.x_grad)


def _device(kind: str) -> str:
    return "cuda" if kind == "fairscale-cuda" else "cpu"


# ------------------------------------------------------------------ (a) num_slices


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("num_slices", [1, 3, 5])
def test_presplit_list_with_num_slices(
    reference: str, ckpt: bool, num_slices: int, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(8, 6, requires_grad=reference == "sequential")
    with caplog.at_level(logging.INFO, logger="shardkit.offload"):
        ours, model = _ours(
            _presplit,
            x.detach().requires_grad_(x.requires_grad),
            _device(reference),
            num_slices=num_slices,
            checkpoint_activation=ckpt,
        )
    # as fairscale: each module of the list is one slice, whatever num_slices says
    assert model.config.num_slices == 3 and len(model._engine.slices) == 3
    ignored = [r for r in caplog.records if "is ignored for a pre-split list" in r.getMessage()]
    assert len(ignored) == (num_slices != 3)
    ref = _reference(reference, _presplit, x, num_slices=num_slices, checkpoint_activation=ckpt)
    _assert_equal(ours, ref, exact=reference != "fairscale-cuda", inputs=reference == "sequential")


@pytest.mark.parametrize("reference", REFERENCES)
def test_num_slices_above_sequential_length_is_clamped(
    reference: str, caplog: pytest.LogCaptureFixture
) -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    x = torch.randn(5, 6)
    with caplog.at_level(logging.INFO, logger="shardkit.offload"):
        ours, model = _ours(build, x, _device(reference), num_slices=7)
    assert model.slice_ranges == [range(0, 1), range(1, 2), range(2, 3)]
    assert any("num_slices=7 exceeds the 3 layers" in r.getMessage() for r in caplog.records)
    ref = _reference(reference, build, x, num_slices=7)
    _assert_equal(ours, ref, exact=reference != "fairscale-cuda")
    # the default (3, as fairscale's) is clamped too: a 2-layer model needs no num_slices
    assert OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "cpu").config.num_slices == 2


# ------------------------------------------------------------------ (b) uneven micro-batches

# (batch, num_microbatches, sizes torch.chunk gives)
UNEVEN = [
    pytest.param(10, 4, [3, 3, 3, 1], id="10-in-4"),
    pytest.param(6, 4, [2, 2, 2], id="6-in-4-gives-3"),
    pytest.param(3, 4, [1, 1, 1], id="3-in-4-gives-3"),
    pytest.param(7, 2, [4, 3], id="7-in-2"),
    pytest.param(1, 3, [1], id="1-in-3-gives-1"),
]


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize(("ckpt", "staged"), [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize(("batch", "num", "sizes"), UNEVEN)
def test_uneven_microbatches_split_like_torch_chunk(
    reference: str, ckpt: bool, staged: bool, batch: int, num: int, sizes: list[int]
) -> None:
    assert [c.shape[0] for c in torch.chunk(torch.empty(batch), num)] == sizes
    x = torch.randn(batch, 6, requires_grad=reference == "sequential")
    torch.manual_seed(0)
    model = OffloadModel(
        _net(),
        _device(reference),
        num_slices=3,
        checkpoint_activation=ckpt,
        num_microbatches=num,
        stage_on_same_device=staged,
    )
    model._engine.trace = []
    xo = x.detach().to(_device(reference)).requires_grad_(x.requires_grad)
    ours = _train_step(model, xo)
    computes = [i for what, i in model._engine.trace if what == "compute"]
    assert computes.count(0) == len(sizes) * (2 if ckpt else 1)  # forward (+ recompute)
    ref = _reference(reference, _net, x, checkpoint_activation=ckpt, num_microbatches=num)
    _assert_equal(ours, ref, exact=reference != "fairscale-cuda", inputs=reference == "sequential")
    if reference == "sequential":  # the same math as the unchunked model, up to fp32 round-off
        torch.manual_seed(0)
        whole = _train_step(_net(), x.detach().clone().requires_grad_(True))
        _assert_close(ours, whole)


def _assert_close(a: _Result, b: _Result) -> None:
    torch.testing.assert_close(a.y, b.y, rtol=1e-6, atol=1e-6)
    for ga, gb in zip(a.grads, b.grads, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


class _Unfold(nn.Module):
    """Doubles the batch dimension: (B, 8) -> (2B, 4)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 4)


class _Pair(nn.Module):
    """Takes a (tensor, tensor) input, returns one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(3, 8)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.a(xs[0]) * torch.sigmoid(self.b(xs[1]))
        return out


@pytest.mark.parametrize("ckpt", [False, True])
def test_uneven_microbatches_with_two_inputs_and_a_batch_changing_layer(ckpt: bool) -> None:
    """Gradients are split by the recorded micro-batch output sizes, not re-chunked."""

    def build() -> nn.Sequential:
        return nn.Sequential(_Pair(), nn.Tanh(), _Unfold(), nn.Linear(4, 5), nn.ReLU())

    torch.manual_seed(0)
    ref = build()
    model = OffloadModel(
        copy.deepcopy(ref),
        "cpu",
        num_slices=3,
        checkpoint_activation=ckpt,
        num_microbatches=4,
        stage_on_same_device=True,
    )
    a = torch.randn(7, 6, requires_grad=True)
    b = torch.randn(7, 3, requires_grad=True)
    a2 = a.detach().clone().requires_grad_(True)
    b2 = b.detach().clone().requires_grad_(True)
    y = model((a, b))
    assert y.shape == (14, 5)
    _loss(y).backward()
    ys = [ref((ca, cb)) for ca, cb in zip(torch.chunk(a2, 4), torch.chunk(b2, 4), strict=True)]
    y_ref = torch.cat(ys)
    for y_m, g_m in zip(ys, torch.autograd.grad(_loss(y_ref), ys), strict=True):
        y_m.backward(g_m)
    assert torch.equal(y, y_ref)
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)  # type: ignore[arg-type]
    for p, pr in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, pr.grad)  # type: ignore[arg-type]


def test_microbatch_input_errors_remain() -> None:
    model = OffloadModel(_net(), "cpu", num_microbatches=2)
    with pytest.raises(ValueError, match=r"same batch size \(dim 0\), got \[4, 3\]"):
        model((torch.randn(4, 6), torch.randn(3, 6)))
    with pytest.raises(ValueError, match="input 0 is 0-dimensional"):
        model(torch.tensor(1.0))


# ------------------------------------------------------------------ (c) .cpu() / .to()

# (move, whether it targets CUDA: only meaningful with device="cuda")
MOVES: list[Any] = [
    pytest.param(lambda m: m.cpu(), False, id="cpu()"),
    pytest.param(lambda m: m.to("cpu"), False, id="to('cpu')"),
    pytest.param(lambda m: m.to(torch.device("cpu"), non_blocking=True), False, id="to(cpu)"),
    pytest.param(lambda m: m.float(), False, id="float()-on-fp32"),
    pytest.param(lambda m: nn.ModuleList([m]).to("cpu") and m, False, id="parent.to('cpu')"),
    pytest.param(lambda m: m.cuda(), True, id="cuda()"),
    pytest.param(lambda m: m.to("cuda"), True, id="to('cuda')"),
]


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize(("move", "to_cuda"), MOVES)
def test_moving_the_wrapper(reference: str, move: Move, to_cuda: bool) -> None:
    if to_cuda and reference != "fairscale-cuda":
        pytest.skip("a move to CUDA is only meaningful with device='cuda' (fairscale-cuda)")
    x = torch.randn(6, 6)
    staged = reference != "fairscale-cuda"  # on CPU, run the staging path (see _ours)
    ours, model = _ours(
        _net,
        x,
        _device(reference),
        move,
        num_slices=3,
        checkpoint_activation=True,
        stage_on_same_device=staged,
    )
    # nothing moved: parameters are still the host views the engine owns
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.config.device.type == _device(reference)
    ref = _reference(reference, _net, x, move, num_slices=3, checkpoint_activation=True)
    _assert_equal(ours, ref, exact=reference != "fairscale-cuda")


def test_cpu_keeps_parameter_identity_and_evicts_a_resident_slice() -> None:
    torch.manual_seed(0)
    ref = _net()
    model = OffloadModel(copy.deepcopy(ref), "cpu", num_slices=3, stage_on_same_device=True)
    params = [(id(p), p.data_ptr()) for p in model.parameters()]
    x = torch.randn(4, 6)
    y = model(x)  # with grad and no backward yet: the last slice stays resident
    assert [s.resident for s in model._engine.stores] == [False, False, True]
    assert model.cpu() is model
    assert not any(s.resident for s in model._engine.stores)
    assert [(id(p), p.data_ptr()) for p in model.parameters()] == params
    _loss(y).backward()  # the evicted slice is loaded again for backward
    _loss(ref(x)).backward()
    for p, pr in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, pr.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("move", "match"),
    [
        (lambda m: m.to(torch.float64), "cannot cast its parameters after wrapping"),
        (lambda m: m.half(), r"turns torch.float32 tensors into torch.float16"),
        (lambda m: m.double(), "cast the model before wrapping it"),
        (lambda m: m.to("meta"), r"moving it to meta is not supported after wrapping"),
        (lambda m: nn.ModuleList([m]).to("meta"), "pass device='meta' when wrapping"),
    ],
)
def test_moves_that_cannot_keep_offloading_raise(move: Move, match: str) -> None:
    torch.manual_seed(0)
    ref = _net()
    model = OffloadModel(copy.deepcopy(ref), "cpu", num_slices=3, stage_on_same_device=True)
    with pytest.raises(RuntimeError, match=match):
        move(model)
    x = torch.randn(4, 6)
    assert torch.equal(model(x), ref(x))  # nothing was changed by the refused move
