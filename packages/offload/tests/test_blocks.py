"""offload_blocks: a stack of blocks inside an arbitrary model (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from shardkit.offload import offload_blocks
from torch import nn


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True, dropout=0.1)
        self.mlp = nn.Sequential(
            nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * d, d)
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0
    ) -> tuple[torch.Tensor, None]:
        h = self.norm(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + scale * a
        return x + self.mlp(x), None


class _Net(nn.Module):
    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(5, d)
        self.layers = nn.ModuleList([_Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.embed(x)
        for layer in self.layers:
            h, _ = layer(h, mask, scale=0.5)
        return self.head(h)


def _run(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = model(x)
    y.square().mean().backward()
    assert x.grad is not None
    return y.detach(), x.grad


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("ckpt", [False, True])
def test_blocks_parity_bit_for_bit(ckpt: bool, staged: bool) -> None:
    torch.manual_seed(0)
    ref = _Net()
    net = copy.deepcopy(ref)
    handle = offload_blocks(
        net, "layers", "cpu", checkpoint_activation=ckpt, stage_on_same_device=staged
    )
    assert handle.num_blocks == 4
    handle._blocks.engine.trace = []
    x = torch.randn(2, 6, 5)
    y_ref, gx_ref = _run(ref, x, 1)
    y, gx = _run(net, x, 1)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    sd_ref, sd = ref.state_dict(), net.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        assert torch.equal(sd[k], sd_ref[k]), k
    for (n, p_ref), p in zip(ref.named_parameters(), net.parameters(), strict=True):
        assert p.grad is not None and p_ref.grad is not None, n
        assert torch.equal(p.grad, p_ref.grad), n
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    torch.optim.AdamW(net.parameters(), lr=1e-2).step()
    assert torch.equal(_run(net, x, 2)[0], _run(ref, x, 2)[0])
    # scheduling: never more than two blocks resident, each computes only while resident
    resident: set[int] = set()
    for what, i in handle._blocks.engine.trace:
        if what == "load":
            resident.add(i)
        elif what == "evict":
            resident.discard(i)
        else:
            assert i in resident
        assert len(resident) <= 2


def test_blocks_no_grad_eval_and_state_dict_roundtrip() -> None:
    torch.manual_seed(0)
    ref = _Net().eval()
    net = copy.deepcopy(ref)
    handle = offload_blocks(net, net.layers, "cpu", stage_on_same_device=True)
    x = torch.randn(2, 4, 5)
    with torch.no_grad():
        assert torch.equal(net(x), ref(x))
    assert not any(s.resident for s in handle._blocks.engine.stores)
    # loading the plain model's checkpoint into the offloaded one (keys are unchanged)
    other = _Net().eval()
    net.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(net(x), other(x))
    net.to(torch.float32)  # moving the rest of the model leaves the offloaded blocks alone
    handle.release()


def test_blocks_bad_input() -> None:
    net = _Net()
    with pytest.raises(TypeError, match="no submodule 'nope'"):
        offload_blocks(net, "nope", "cpu")
    with pytest.raises(TypeError, match=r"must be an nn\.ModuleList"):
        offload_blocks(net, "head", "cpu")
    with pytest.raises(TypeError, match="not a submodule of model"):
        offload_blocks(net, nn.ModuleList([nn.Linear(2, 2)]), "cpu")
    with pytest.raises(ValueError, match="empty"):
        net2 = _Net()
        net2.layers = nn.ModuleList()
        offload_blocks(net2, "layers", "cpu")
    offload_blocks(net, "layers", "cpu")
    with pytest.raises(ValueError, match="already offloaded"):
        offload_blocks(net, "layers", "cpu")
