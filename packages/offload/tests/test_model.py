"""OffloadModel on CPU: parity with the plain model in every mode, scheduling, bad input."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from shardkit.offload import OffloadModel, module_bytes
from torch import nn


class _TwoOut(nn.Module):
    """Returns two tensors (a multi-tensor slice boundary)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x).relu(), self.b(x)


class _TwoIn(nn.Module):
    """Consumes the two tensors of a _TwoOut (possibly in another slice)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = xs
        return self.lin(a) * torch.sigmoid(b)


class _PassTwo(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = xs
        return self.lin(a), b


def _mlp(dropout: float = 0.0, bn: bool = False, d: int = 12) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(6, d), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(d, d), nn.GELU()]
    if bn:
        layers.append(nn.BatchNorm1d(d))
    layers += [nn.Linear(d, d), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(d, 3)]
    return nn.Sequential(*layers)


def _two_boundary(d: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, d), _TwoOut(d), _PassTwo(d), _TwoIn(d), nn.Linear(d, 3))


def _make(seed: int, build: Callable[[], nn.Sequential]) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(seed)
    ref = build()
    return ref, copy.deepcopy(ref)


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = model(x)
    (y.float().square().mean() + y.float().sum()).backward()
    assert x.grad is not None
    return y.detach(), x.grad


def _assert_params_equal(a: nn.Module, b: nn.Module, grads: bool = True) -> None:
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), (na, nb)
        if grads:
            assert pa.grad is not None and pb.grad is not None, na
            assert torch.equal(pa.grad, pb.grad), na
    for (na, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(ba, bb), na


MODES = [
    pytest.param(ckpt, staged, id=f"ckpt={ckpt}-staged={staged}")
    for ckpt in (False, True)
    for staged in (False, True)
]


@pytest.mark.parametrize(("ckpt", "staged"), MODES)
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: _mlp(), id="mlp"),
        pytest.param(lambda: _mlp(dropout=0.3, bn=True), id="dropout-bn"),
        pytest.param(_two_boundary, id="two-tensor-boundary"),
    ],
)
def test_parity_bit_for_bit_with_one_adam_step(
    build: Callable[[], nn.Sequential], ckpt: bool, staged: bool
) -> None:
    ref, src = _make(0, build)
    model = OffloadModel(
        src, "cpu", num_slices=3, checkpoint_activation=ckpt, stage_on_same_device=staged
    )
    x = torch.randn(8, 6)
    y_ref, gx_ref = _step(ref, x, seed=1)
    rng_after_ref = torch.get_rng_state()
    y, gx = _step(model, x, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_after_ref)  # recompute leaves RNG untouched
    assert torch.equal(y, y_ref)
    assert torch.equal(gx, gx_ref)
    _assert_params_equal(ref, model.module)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_ref.step()
    opt.step()
    _assert_params_equal(ref, model.module)
    # a second step sees the updated host parameters (nothing stale stays on the "device")
    for o in (opt_ref, opt):
        o.zero_grad()
    y_ref2, _ = _step(ref, x, seed=2)
    y2, _ = _step(model, x, seed=2)
    assert torch.equal(y2, y_ref2)
    _assert_params_equal(ref, model.module)


@pytest.mark.parametrize("staged", [False, True])
def test_microbatches_match_plain_model_and_modes_agree(staged: bool) -> None:
    ref, src = _make(0, lambda: _mlp(dropout=0.25))
    ck_src = copy.deepcopy(src)
    plain = OffloadModel(src, "cpu", num_slices=2, num_microbatches=4, stage_on_same_device=staged)
    ckpt = OffloadModel(
        ck_src,
        "cpu",
        num_slices=2,
        checkpoint_activation=True,
        num_microbatches=4,
        stage_on_same_device=staged,
    )
    x = torch.randn(8, 6)
    # with dropout, both offloaded modes draw masks in the same (slice-major) order: bit-equal
    y1, g1 = _step(plain, x, seed=3)
    y2, g2 = _step(ckpt, x, seed=3)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)
    _assert_params_equal(plain.module, ck_src)
    # without dropout (eval), micro-batching only regroups sums: equal to the plain model up to
    # float32 summation order (stated tolerance: 1e-6 relative)
    for m in (ref, plain, ckpt):
        m.eval()
        m.zero_grad()
    y_ref, gx_ref = _step(ref, x, seed=4)
    y, gx = _step(ckpt, x, seed=4)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-7)
    for pr, p in zip(ref.parameters(), ck_src.parameters(), strict=True):
        assert pr.grad is not None and p.grad is not None
        torch.testing.assert_close(p.grad, pr.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("ckpt", "staged"), MODES)
def test_autocast_bf16_parity_without_deprecation_warnings(ckpt: bool, staged: bool) -> None:
    ref, src = _make(0, lambda: _mlp(dropout=0.2))
    model = OffloadModel(
        src, "cpu", num_slices=2, checkpoint_activation=ckpt, stage_on_same_device=staged
    )
    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(5)
            y_ref = ref(x)
            torch.manual_seed(5)
            y = model(x)
        assert y.dtype == torch.bfloat16
        y_ref.float().sum().backward()
        y.float().sum().backward()
    assert torch.equal(y, y_ref)
    _assert_params_equal(ref, model.module)


@pytest.mark.parametrize("ckpt", [False, True])
def test_frozen_params_and_input_without_grad(ckpt: bool) -> None:
    ref, src = _make(0, _mlp)
    for m in (ref, src):
        m[0].requires_grad_(False)
        m[-1].weight.requires_grad_(False)
    model = OffloadModel(
        src, "cpu", num_slices=3, checkpoint_activation=ckpt, stage_on_same_device=True
    )
    x = torch.randn(5, 6)
    ref(x).sum().backward()
    out = model(x)
    assert out.requires_grad
    out.sum().backward()
    for (n, pr), p in zip(ref.named_parameters(), src.parameters(), strict=True):
        assert (pr.grad is None) == (p.grad is None), n
        if pr.grad is not None:
            assert p.grad is not None and torch.equal(pr.grad, p.grad), n


def test_all_frozen_and_no_grad_paths_need_no_backward() -> None:
    ref, src = _make(0, _mlp)
    src.requires_grad_(False)
    model = OffloadModel(src, "cpu", num_slices=2, stage_on_same_device=True)
    x = torch.randn(4, 6)
    assert not model(x).requires_grad
    src.requires_grad_(True)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    model.module.eval()
    ref.eval()
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


def test_gradients_accumulate_across_backwards_and_autograd_grad_works() -> None:
    ref, src = _make(0, _mlp)
    model = OffloadModel(src, "cpu", num_slices=3, stage_on_same_device=True)
    x = torch.randn(4, 6)
    for _ in range(2):
        ref(x).sum().backward()
        model(x).sum().backward()
    _assert_params_equal(ref, src)
    params = list(model.parameters())
    g = torch.autograd.grad(model(x).sum(), params)
    g_ref = torch.autograd.grad(ref(x).sum(), list(ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref, strict=True))


@pytest.mark.parametrize("ckpt", [False, True])
def test_residency_order_and_at_most_two_slices(ckpt: bool) -> None:
    _, src = _make(0, lambda: _mlp(d=16))
    model = OffloadModel(
        src, "cpu", num_slices=4, checkpoint_activation=ckpt, stage_on_same_device=True
    )
    engine = model._engine
    engine.trace = []
    model(torch.randn(4, 6)).sum().backward()
    trace = engine.trace
    resident: set[int] = set()
    peak = 0
    for what, i in trace:
        if what == "load":
            assert i not in resident
            resident.add(i)
        elif what == "evict":
            resident.remove(i)
        else:
            assert i in resident, f"slice {i} computed while not resident: {trace}"
        peak = max(peak, len(resident))
    assert peak == 2
    assert not resident  # everything freed after backward
    computes = [i for w, i in trace if w == "compute"]
    assert computes == ([0, 1, 2, 3, 3, 2, 1, 0] if ckpt else [0, 1, 2, 3])
    # prefetch: slice i+1 (forward) / i-1 (backward) is loaded before slice i computes
    loads = [(k, i) for k, (w, i) in enumerate(trace) if w == "load"]
    first_compute = {}
    for k, (w, i) in enumerate(trace):
        if w == "compute":
            first_compute.setdefault(i, k)
    for k, i in loads[:4]:
        if i >= 1:
            assert k < first_compute[i - 1], (i, trace)
    # the last slice is reused for backward, so it is loaded exactly twice... or once
    assert [i for _, i in loads] == [0, 1, 2, 3, 2, 1, 0]


def test_staged_storage_is_freed_when_not_resident() -> None:
    _, src = _make(0, _mlp)
    model = OffloadModel(src, "cpu", num_slices=3, stage_on_same_device=True)
    with torch.no_grad():
        model(torch.randn(2, 6))
    for store in model._engine.stores:
        assert not store.resident
        for g in store.groups:
            assert g.device_flat is not None and g.device_flat.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("ckpt", [False, True])
def test_staged_gradients_stream_out_one_at_a_time(
    ckpt: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each device gradient is copied out and dropped as soon as autograd produces it, so no
    more than one of a slice's gradients is alive on the device at a time (the GPU memory
    bound; see [Note: Streamed gradients]), and the result still matches the plain model."""
    from shardkit.offload._storage import _SliceStore

    ref, src = _make(0, _mlp)
    model = OffloadModel(
        src, "cpu", num_slices=2, checkpoint_activation=ckpt, stage_on_same_device=True
    )
    alive: list[int] = []
    original = _SliceStore._stream_out

    def counting(self: _SliceStore, gi: int, k: int) -> None:
        views = [v for g in self.groups for v in (g.device_views or [])]
        alive.append(sum(v.grad is not None for v in views))
        original(self, gi, k)

    monkeypatch.setattr(_SliceStore, "_stream_out", counting)
    x = torch.randn(4, 6)
    _step(ref, x, 1)
    _step(model, x, 1)
    assert len(alive) == sum(p.requires_grad for p in ref.parameters())
    assert max(alive) == 1
    for store in model._engine.stores:
        assert all(v.grad is None for g in store.groups for v in (g.device_views or []))
    _assert_params_equal(ref, model)


def test_state_dict_and_optimizer_identity_are_kept() -> None:
    ref, src = _make(0, lambda: _mlp(bn=True))
    params_before = list(src.parameters())
    opt = torch.optim.SGD(src.parameters(), lr=0.1)  # built before wrapping
    model = OffloadModel(src, "cpu", num_slices=2, stage_on_same_device=True)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]
    assert {k.removeprefix("module.") for k in model.state_dict()} == set(ref.state_dict())
    model.load_state_dict({"module." + k: v + 1 for k, v in ref.state_dict().items()})
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.step()
    ref.load_state_dict({k: v + 1 for k, v in ref.state_dict().items()})
    ref(x).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    _assert_params_equal(ref, src)


def test_presplit_slices() -> None:
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Linear(8, 8), nn.Linear(8, 2)]
    ref = nn.Sequential(*copy.deepcopy(parts))
    model = OffloadModel(parts, "cpu", stage_on_same_device=True)
    assert model.config.num_slices == 3
    x = torch.randn(3, 6)
    y_ref, g_ref = _step(ref, x, 0)
    y, g = _step(model, x, 0)
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


def test_slicing_is_balanced_by_bytes() -> None:
    seq = nn.Sequential(
        nn.Linear(40, 40),
        nn.ReLU(),
        nn.Linear(40, 4),
        nn.Linear(4, 4),
        nn.Linear(4, 40),
        nn.Linear(40, 40),
    )
    model = OffloadModel(seq, "cpu", num_slices=3)
    ranges = model.slice_ranges
    big = (40 * 40 + 40) * 4
    sizes = [sum(module_bytes(seq[i]) for i in r) for r in ranges]
    assert max(sizes) == big  # optimal: each big layer alone, the three small ones together
    assert ranges[0].start == 0 and ranges[-1] == range(5, 6)
    assert [i for r in ranges for i in r] == list(range(6))


class _Dict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}


def test_bad_input_errors() -> None:
    seq = _mlp()
    with pytest.raises(TypeError, match="offload_blocks"):
        OffloadModel(nn.Linear(2, 2), "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_slices must be >= 1, got 0"):
        OffloadModel(_mlp(), "cpu", num_slices=0)
    with pytest.raises(TypeError, match="num_slices must be an int"):
        OffloadModel(_mlp(), "cpu", num_slices=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        OffloadModel(_mlp(), "cpu", num_microbatches=0)
    with pytest.raises(TypeError, match="checkpoint_activation must be a bool"):
        OffloadModel(_mlp(), "cpu", checkpoint_activation=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offload_device must be"):
        OffloadModel(_mlp(), "cpu", offload_device="meta")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        OffloadModel(_mlp(), "meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            OffloadModel(_mlp(), "cuda")
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="shared between slices"):
        OffloadModel(nn.Sequential(shared, nn.ReLU(), shared), "cpu", num_slices=2)
    model = OffloadModel(seq, "cpu", num_microbatches=4, checkpoint_activation=True)
    with pytest.raises(RuntimeError, match="cannot cast its parameters after wrapping"):
        model.to(torch.float64)
    bad = OffloadModel(nn.Sequential(nn.Linear(2, 2), _Dict()), "cpu", num_slices=2)
    with pytest.raises(TypeError, match="output of slice 1 must be a Tensor"):
        bad(torch.randn(2, 2))


def test_double_backward_and_retain_graph_are_rejected() -> None:
    model = OffloadModel(_mlp(), "cpu", num_slices=2, checkpoint_activation=True)
    y = model(torch.randn(2, 6)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        y.backward()
    x = torch.randn(2, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
