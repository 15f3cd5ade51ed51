"""A tiny GPT-style model, a deterministic task and comparison helpers shared by the suites.

The model has what a real decoder has and what trips sharded optimizers up: token and position
embeddings, causal self-attention, an MLP, layer norms, an LM head tied to the token embedding
(one parameter used twice) and, optionally, a frozen block (parameters that get no gradient).
It is tiny on purpose: every suite trains it a few steps on 2-4 Gloo ranks on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "assert_close_params",
    "assert_same_params",
    "assert_same_state",
    "global_batch",
    "lm_loss",
    "local_batch",
    "make_model",
    "snapshot",
]


@dataclass(frozen=True)
class GPTConfig:
    """Size of the test model."""

    vocab: int = 32
    """Alphabet size."""
    context: int = 12
    """Sequence length."""
    dim: int = 32
    """Model width."""
    heads: int = 2
    """Attention heads."""
    layers: int = 3
    """Transformer blocks."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, both residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        # No bias: the key bias gets an exactly-zero gradient (softmax is shift-invariant), so
        # its Adam update would normalise pure rounding noise, which differs between runs that
        # are equal only up to rounding (bf16 autocast); the bit-exact suites do not care.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.out = nn.Linear(2 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Embeddings, a stack of blocks (``self.blocks``), final norm, head tied to ``self.tok``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.context, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model(seed: int = 0, frozen_block: int | None = 1, cfg: GPTConfig | None = None) -> GPT:
    """The test model, identical for equal seeds; ``frozen_block`` gets ``requires_grad=False``."""
    torch.manual_seed(seed)
    model = GPT(cfg or GPTConfig())
    if frozen_block is not None:
        model.blocks[frozen_block].requires_grad_(False)
    return model


def global_batch(step: int, size: int = 12, cfg: GPTConfig | None = None) -> torch.Tensor:
    """The step's global batch: ``size`` token sequences of ``context + 1`` tokens.

    A learnable task (each token is the previous one plus a per-sequence stride, mod vocab), so
    the loss falls within a few steps.
    """
    cfg = cfg or GPTConfig()
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, cfg.vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(cfg.context + 1)) % cfg.vocab


def local_batch(step: int, rank: int, world_size: int, size: int = 12) -> torch.Tensor:
    """This rank's contiguous slice of the step's global batch (``size`` divisible by the world)."""
    if size % world_size:
        raise ValueError(f"global batch {size} is not divisible by the world size {world_size}")
    n = size // world_size
    return global_batch(step, size)[rank * n : (rank + 1) * n]


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (float32 even under autocast)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, by name (a tied parameter appears once)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_params(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str
) -> None:
    """Bit-for-bit equality of two snapshots; the message names the first differing params."""
    if got.keys() != want.keys():
        raise AssertionError(f"{where}: parameter names differ: {sorted(got)} vs {sorted(want)}")
    bad = [
        f"{n} (max |diff| {(got[n].double() - want[n].double()).abs().max().item():.3e})"
        for n in got
        if not torch.equal(got[n], want[n])
    ]
    if bad:
        raise AssertionError(f"{where}: {len(bad)} params differ bit-wise: {bad[:4]}")


def assert_close_params(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    where: str,
    *,
    atol: float,
    rtol: float,
) -> None:
    """Equality within ``atol + rtol * |want|`` element-wise."""
    if got.keys() != want.keys():
        raise AssertionError(f"{where}: parameter names differ: {sorted(got)} vs {sorted(want)}")
    bad = [
        f"{n} (max |diff| {(got[n] - want[n]).abs().max().item():.3e})"
        for n in got
        if not torch.allclose(got[n], want[n], atol=atol, rtol=rtol)
    ]
    if bad:
        raise AssertionError(
            f"{where}: {len(bad)} params differ beyond atol={atol}, rtol={rtol}: {bad[:4]}"
        )


def assert_same_state(got: dict[str, object], want: dict[str, object], where: str) -> None:
    """Bit-for-bit equality of two plain torch optimizer state dicts (state and param groups)."""
    gs, ws = got["state"], want["state"]
    assert isinstance(gs, dict) and isinstance(ws, dict)
    if sorted(gs) != sorted(ws):
        raise AssertionError(f"{where}: state keys differ: {sorted(gs)} vs {sorted(ws)}")
    for idx in ws:
        a, b = gs[idx], ws[idx]
        if a.keys() != b.keys():
            raise AssertionError(f"{where}: state[{idx}] keys differ: {sorted(a)} vs {sorted(b)}")
        for key in b:
            x, y = a[key], b[key]
            same = torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y
            if not same:
                raise AssertionError(f"{where}: state[{idx}][{key!r}] differs: {x!r} vs {y!r}")
    gg, wg = got["param_groups"], want["param_groups"]
    assert isinstance(gg, list) and isinstance(wg, list)
    if gg != wg:
        raise AssertionError(f"{where}: param_groups differ:\n{gg}\nvs\n{wg}")


def iter_trainable(model: nn.Module) -> Iterable[nn.Parameter]:
    """The parameters with ``requires_grad``."""
    return (p for p in model.parameters() if p.requires_grad)
