#!/usr/bin/env python3
"""shardkit demo: train a small GPT-style model data-parallel with a ZeRO-1 sharded optimizer.

What it does (``python docs/examples/demo.py``, or ``hatch run demo``):

1. Starts ``--world-size`` local Gloo ranks (default 2; no GPU, no cluster needed).
2. Trains a small GPT-style decoder (token and position embeddings, causal self-attention, MLP,
   layer norm, an LM head tied to the token embedding) wrapped in DDP, with
   ``shardkit.optim.ShardedOptimizer`` around ``torch.optim.AdamW``; when shardkit-overlap is
   installed the optimizer step runs inside DDP's comm hook, overlapped with backward.
3. The task is clearly defined and synthetic: next-token prediction on sequences drawn from a
   fixed, seeded Markov chain over a 16-symbol alphabet. The lowest achievable loss is the
   chain's conditional entropy, printed at the start, so you can watch the loss fall towards it.
4. Shows a progress bar with loss and throughput, and prints each rank's optimizer-state bytes
   against what plain DDP + AdamW keeps on every rank.
5. Saves a sharded checkpoint (torch.distributed.checkpoint, each rank writes its shard), then
   resumes from it at ``--resume-world-size`` ranks (default 1) and trains on.
6. Writes the loss curve of both phases to ``OUT/loss.png``.

Under ``torchrun`` the same script runs unchanged, one process per rank, on one or many nodes
(NCCL when GPUs are present, else Gloo)::

    torchrun --nproc-per-node 4 docs/examples/demo.py --steps 500 --out runs/a
    torchrun --nproc-per-node 2 docs/examples/demo.py --steps 200 --resume runs/a/checkpoint

(under torchrun each launch is one world size, so resuming at another size is a second launch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import struct
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from shardkit.optim import ShardedOptimizer, load_sharded, save_sharded
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # optional: overlap the sharded step with backward
    from shardkit.overlap import register_zero_overlap
except ImportError:  # shardkit-overlap not installed: plain ZeRO-1 step after backward
    register_zero_overlap = None  # type: ignore[assignment]

VOCAB = 16


# ----------------------------------------------------------------------------- the task


def markov_chain(seed: int = 1234) -> torch.Tensor:
    """Transition table P[a, b] = p(next=b | current=a): peaked, seeded."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3.0
    return torch.softmax(logits, dim=-1)


def entropy_floor(table: torch.Tensor) -> float:
    """Conditional entropy (nats) of the chain, weighted by a long sample's state counts."""
    seqs = sample(table, 256, 128, torch.Generator().manual_seed(99))
    probs = table[seqs[:, :-1].reshape(-1)]
    return float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())


def sample(table: torch.Tensor, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    seq = torch.empty(batch, length, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(1, length):
        seq[:, t] = torch.multinomial(table[seq[:, t - 1]], 1, generator=g).squeeze(1)
    return seq


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class GPTConfig:
    """Size of the demo model."""

    vocab: int = VOCAB
    """Alphabet size."""
    context: int = 64
    """Longest sequence."""
    dim: int = 128
    """Model width."""
    heads: int = 4
    """Attention heads."""
    layers: int = 3
    """Transformer blocks."""


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.context, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


# ----------------------------------------------------------------------------- training


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def _progress(step: int, total: int, loss: float, tok_s: float, start: int) -> None:
    width = 30
    done = int(width * (step - start) / max(1, total - start))
    bar = "#" * done + "-" * (width - done)
    end = "\n" if step == total else ""
    print(f"\r  [{bar}] step {step:4d}/{total}  loss {loss:.4f}  {tok_s:,.0f} tok/s", end=end, flush=True)


def train(rank: int, world_size: int, args: argparse.Namespace, phase: str) -> None:
    """One rank of one phase ("train": from scratch, "resume": from the checkpoint)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() and args.torchrun else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    ckpt = Path(args.resume) if args.resume else Path(args.out) / "checkpoint"
    start_step = 0
    if phase == "resume":
        meta = json.loads((ckpt / "demo.json").read_text())
        model.load_state_dict(torch.load(ckpt / "model.pt", map_location=device))
        start_step = meta["step"]
    ddp = DDP(model)
    zero = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    if phase == "resume":
        load_sharded(zero, ckpt)
    optimizer_step = zero.step
    overlapped = register_zero_overlap is not None and not args.no_overlap
    overlap = None
    if overlapped:
        # The step of each gradient bucket runs inside DDP's comm hook, during backward.
        overlap = register_zero_overlap(ddp, zero, interleaved=True, shard_buckets=True)
        optimizer_step = overlap.step

    table = markov_chain()
    g = torch.Generator().manual_seed(1000 * (start_step + 1) + rank)
    local_batch = max(1, args.batch // world_size)
    end_step = start_step + args.steps
    losses: list[tuple[int, float]] = []
    if rank == 0:
        mode = "ShardedOptimizer(AdamW)" + (" + overlap hook" if overlapped else "")
        print(f"{phase}: {world_size} rank(s) on {device.type}, {mode}, global batch {local_batch * world_size} x {cfg.context} tokens")
    tic = time.perf_counter()
    for step in range(start_step + 1, end_step + 1):
        batch = sample(table, local_batch, cfg.context + 1, g).to(device)
        logits = ddp(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer_step()  # with the overlap hook: only checks that the hooks stepped every bucket
        zero.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size
        losses.append((step, float(mean)))
        if rank == 0 and (step % 5 == 0 or step == end_step):
            tok_s = (step - start_step) * local_batch * world_size * cfg.context / (time.perf_counter() - tic)
            _progress(step, end_step, float(mean), tok_s, start_step)

    # Optimizer memory: this rank's shard against the full AdamW state DDP keeps on every rank.
    mine = torch.tensor([_state_bytes(zero.optim)], dtype=torch.float64, device=device)
    per_rank = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(per_rank, mine)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        full = 2 * 4 * n_params  # exp_avg + exp_avg_sq in fp32 (+ a scalar step per param)
        print(f"  optimizer state per rank (plain DDP + AdamW would keep {full / 2**20:.2f} MiB on every rank):")
        for r, b in enumerate(per_rank):
            print(f"    rank {r}: {float(b) / 2**20:.2f} MiB  ({float(b) / full:.2f}x DDP)")

    if phase == "train":
        save_sharded(zero, ckpt)
        if rank == 0:
            torch.save(model.state_dict(), ckpt / "model.pt")
            (ckpt / "demo.json").write_text(json.dumps({"step": end_step, "world_size": world_size}))
            print(f"  saved sharded checkpoint at {ckpt} (step {end_step}, {world_size} shards)")
    if rank == 0:
        log = Path(args.out) / f"loss-{phase}.json"
        log.write_text(json.dumps(losses))
    if overlap is not None:
        overlap.close()
    dist.barrier()  # nobody tears the group down while another rank still writes or reads


def _spawned(rank: int, world_size: int, init_file: str, args: argparse.Namespace, phase: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        train(rank, world_size, args, phase)
    finally:
        dist.destroy_process_group()


def run_local(world_size: int, args: argparse.Namespace, phase: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world_size, os.path.join(tmp, "init"), args, phase), nprocs=world_size, join=True)


# ----------------------------------------------------------------------------- loss curve PNG


def write_png(path: Path, curves: list[tuple[list[tuple[int, float]], tuple[int, int, int]]], floor: float) -> None:
    """A dependency-free line plot: loss against step, one colour per phase, floor dashed."""
    w, h, m = 640, 360, 30
    px = bytearray(b"\xff" * (w * h * 3))
    pts = [p for c, _ in curves for p in c]
    x0, x1 = min(s for s, _ in pts), max(s for s, _ in pts)
    y0, y1 = min(min(v for _, v in pts), floor) * 0.95, max(v for _, v in pts) * 1.02

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            i = (y * w + x) * 3
            px[i:i + 3] = bytes(rgb)

    def to_px(s: float, v: float) -> tuple[int, int]:
        return (m + int((s - x0) / max(1, x1 - x0) * (w - 2 * m)), h - m - int((v - y0) / (y1 - y0) * (h - 2 * m)))

    for x in range(m, w - m):
        put(x, h - m, (0, 0, 0))
    for y in range(m, h - m):
        put(m, y, (0, 0, 0))
    fy = to_px(x0, floor)[1]
    for x in range(m, w - m, 6):
        for d in range(3):
            put(x + d, fy, (120, 120, 120))
    for curve, rgb in curves:
        prev = None
        for s, v in curve:
            cur = to_px(s, v)
            if prev is not None:
                n = max(abs(cur[0] - prev[0]), abs(cur[1] - prev[1]), 1)
                for k in range(n + 1):
                    x = prev[0] + (cur[0] - prev[0]) * k // n
                    y = prev[1] + (cur[1] - prev[1]) * k // n
                    put(x, y, rgb)
                    put(x, y + 1, rgb)
            prev = cur
    raw = b"".join(b"\x00" + bytes(px[y * w * 3:(y + 1) * w * 3]) for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="local ranks for the first phase")
    parser.add_argument("--resume-world-size", type=int, default=1, help="local ranks after resuming")
    parser.add_argument("--steps", type=int, default=150, help="steps per phase")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", default="demo-out", help="output directory")
    parser.add_argument("--resume", default=None, help="(torchrun) resume from this checkpoint")
    parser.add_argument("--no-overlap", action="store_true", help="do not register the overlap hook")
    parser.add_argument("--short", action="store_true", help="a quick run (20 steps per phase) for tests")
    args = parser.parse_args(argv)
    if args.short:
        args.steps = 20
    for name in ("world_size", "resume_world_size", "steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ

    if args.torchrun:  # one process per rank, launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args, "resume" if args.resume else "train")
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
        if rank == 0:
            _plot(Path(args.out), entropy_floor(markov_chain()))
        return 0

    floor = entropy_floor(markov_chain())
    print(f"task: Markov chain over {VOCAB} symbols; start loss ~ ln({VOCAB}) = {math.log(VOCAB):.3f}, floor (entropy) = {floor:.3f}")
    start = time.perf_counter()
    run_local(args.world_size, args, "train")
    run_local(args.resume_world_size, args, "resume")
    first, second = _plot(Path(args.out), floor)
    print(f"loss {first[0][1]:.3f} -> {second[-1][1]:.3f} (floor {floor:.3f}); wrote {Path(args.out) / 'loss.png'} in {time.perf_counter() - start:.0f}s total")
    return 0


def _plot(out: Path, floor: float) -> tuple[list[Any], list[Any]]:
    """loss.png from whichever phases have run (blue: training, orange: after the resume)."""
    phases = [json.loads(p.read_text()) if p.exists() else [] for p in (out / "loss-train.json", out / "loss-resume.json")]
    curves = [(c, rgb) for c, rgb in zip(phases, ((31, 119, 180), (255, 127, 14)), strict=True) if c]
    if curves:
        write_png(out / "loss.png", curves, floor)
    return phases[0], phases[1]


if __name__ == "__main__":
    sys.exit(main())
