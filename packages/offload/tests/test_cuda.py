"""CUDA: parity with the all-on-device model and peak device memory (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from shardkit.offload import OffloadModel, offload_blocks
from torch import nn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]


def _model(d: int = 512, n: int = 8) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(d, d), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(d, 4))


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mbs", [1, 2])
def test_cuda_parity_with_device_model(ckpt: bool, mbs: int) -> None:
    torch.manual_seed(0)
    ref = _model().cuda()
    model = OffloadModel(
        copy.deepcopy(ref).cpu(),
        "cuda",
        num_slices=4,
        checkpoint_activation=ckpt,
        num_microbatches=mbs,
    )
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    x = torch.randn(16, 512, device="cuda")
    if mbs == 1:
        torch.manual_seed(1)
        y_ref = ref(x)
        torch.manual_seed(1)
        y = model(x)
        assert torch.equal(y, y_ref)
    ref.eval()
    model.module.eval()
    ref.zero_grad()
    ref(x).square().mean().backward()
    model(x).square().mean().backward()
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert p.grad is not None and p.grad.device.type == "cpu"
        assert p_ref.grad is not None
        torch.testing.assert_close(p.grad, p_ref.grad.cpu(), rtol=1e-4, atol=1e-5)


def test_cuda_peak_memory_two_slices_plus_streamed_gradients() -> None:
    """Peak device memory of a train step: the two resident slices, a couple of gradients in
    flight to the host (streamed, see [Note: Streamed gradients]) and small activations; well
    below the all-on-device model's."""
    torch.manual_seed(0)
    d, n, slices = 1024, 16, 8
    x = torch.randn(8, d, device="cuda")
    ref = _model(d, n).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref(x).sum().backward()
    torch.cuda.synchronize()
    peak_ref = torch.cuda.max_memory_allocated() - base
    model = OffloadModel(ref.cpu(), "cuda", num_slices=slices, checkpoint_activation=True)
    del ref
    torch.cuda.empty_cache()
    slice_bytes = max(
        sum(g.host.numel() * g.host.element_size() for g in store.groups)
        for store in model._engine.stores
    )
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    for _ in range(2):  # the second step runs with every cache warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < peak_ref
        assert peak <= 2 * slice_bytes + 2 * largest + 4 * 2**20, (
            f"peak {peak / 2**20:.1f} MiB, slice {slice_bytes / 2**20:.1f} MiB, "
            f"largest param {largest / 2**20:.1f} MiB"
        )
        model.zero_grad(set_to_none=True)


def test_cuda_blocks_parity() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    ref = Net().cuda()
    net = copy.deepcopy(ref)
    offload_blocks(net, "layers", "cuda", checkpoint_activation=True)
    x = torch.randn(4, 64, device="cuda")
    assert torch.equal(net(x), ref(x))
    net(x).sum().backward()
    ref(x).sum().backward()
    for p_ref, p in zip(ref.parameters(), net.parameters(), strict=True):
        assert p.grad is not None and p_ref.grad is not None
        torch.testing.assert_close(p.grad, p_ref.grad.cpu())
