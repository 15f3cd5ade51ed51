#!/usr/bin/env python3
"""shardkit demo: train a small character-level GPT data-parallel with a ZeRO-1 sharded optimizer.

What it does (``hatch run demo``, or ``python docs/examples/demo.py`` in an environment with the
packages, tqdm and matplotlib installed):

1. Launches ``--world-size`` local ranks (default 2) with ``torchrun --standalone``: Gloo on the
   CPU, no GPU or cluster needed (NCCL when GPUs are present).
2. Trains a small GPT-style decoder (token and position embeddings, causal self-attention, MLP,
   layer norm, an LM head tied to the token embedding) wrapped in DDP, with
   ``shardkit.optim.ShardedOptimizer`` around ``torch.optim.AdamW``; when shardkit-overlap is
   installed the optimizer step runs inside DDP's comm hook, overlapped with backward.
3. The data is real text: eighteen of Shakespeare's sonnets (public domain, shipped in
   ``docs/examples/data/sonnets.txt`` with their source), read character by character. A
   ``DistributedSampler`` gives each rank its own share of the text windows every epoch.
4. Shows a tqdm progress bar with the loss and throughput, and prints each rank's
   optimizer-state bytes against what plain DDP + AdamW keeps on every rank.
5. Saves a sharded checkpoint (torch.distributed.checkpoint, each rank writes its shard), then
   launches again at ``--resume-world-size`` ranks (default 1), resumes from it and trains on.
6. Plots the loss of both phases with matplotlib to ``OUT/loss.png``, with the entropy of the
   text's characters (the floor of a model that sees no context) and of a character given the
   previous one (the floor with one character of context) drawn as reference lines.

Each phase is one ``torchrun`` launch; to run them by hand (one or many nodes)::

    torchrun --standalone --nproc-per-node 4 docs/examples/demo.py --steps 500 --out runs/a
    torchrun --standalone --nproc-per-node 2 docs/examples/demo.py --steps 200 --out runs/a \\
        --resume runs/a/checkpoint
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardkit.optim import ShardedOptimizer, load_sharded, save_sharded
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

try:  # optional: overlap the sharded step with backward
    from shardkit.overlap import register_zero_overlap
except ImportError:  # shardkit-overlap not installed: plain ZeRO-1 step after backward
    register_zero_overlap = None  # type: ignore[assignment]

# tqdm and matplotlib come with the demo's hatch env (`hatch run demo`); they are not shardkit
# dependencies. Without them the demo still trains: plain progress lines, no loss.png.
try:
    from tqdm import tqdm
except ImportError:
    tqdm = None  # type: ignore[assignment,misc]

TEXT = Path(__file__).resolve().parent / "data" / "sonnets.txt"


# ----------------------------------------------------------------------------- the data


def read_text(path: Path = TEXT) -> str:
    """The training text: the file without its leading ``# `` source note."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("# ")).strip() + "\n"


class CharWindows(Dataset[torch.Tensor]):
    """Overlapping windows of ``context + 1`` character ids (input and shifted target)."""

    def __init__(self, text: str, context: int, stride: int) -> None:
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.context = context
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.stride
        return self.ids[start : start + self.context + 1]


def entropies(text: str) -> tuple[float, float]:
    """(H(c), H(c_t | c_{t-1})) of the text's characters, in nats.

    The first is the lowest loss of a model that sees no context (it can only learn character
    frequencies), the second the lowest loss with one character of context. A model with a longer
    context can go below both on its own training text.
    """
    n = len(text)
    unigram = Counter(text)
    h0 = -sum(c / n * math.log(c / n) for c in unigram.values())
    pairs = Counter(itertools.pairwise(text))
    first = Counter(text[:-1])
    h1 = -sum(c / (n - 1) * math.log(c / first[a]) for (a, _), c in pairs.items())
    return h0, h1


def batches(
    loader: DataLoader[torch.Tensor], sampler: DistributedSampler[Any], done: int
) -> Iterator[torch.Tensor]:
    """Endless batches continuing after ``done`` steps: epoch ``done // len(loader)``, and so on.

    ``sampler.set_epoch`` reshuffles each epoch identically on every rank, so each rank keeps a
    disjoint share of the windows; a resumed run picks the epoch and position up from the step.
    """
    epoch, skip = divmod(done, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class GPTConfig:
    """Size of the demo model."""

    vocab: int
    """Alphabet size (distinct characters of the text)."""
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
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )

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


# ----------------------------------------------------------------------------- one rank


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def train(args: argparse.Namespace) -> None:
    """One rank of one torchrun launch: from scratch, or from ``--resume`` (a checkpoint)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    phase = "resume" if args.resume else "train"
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    out = Path(args.out)
    data = CharWindows(read_text(), context=64, stride=32)
    cfg = GPTConfig(vocab=len(data.chars), context=data.context)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    ckpt = Path(args.resume) if args.resume else out / "checkpoint"
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

    local_batch = max(1, args.batch // world_size)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=local_batch, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(
            f"--batch {args.batch} is larger than the {len(data)} text windows split over "
            f"{world_size} rank(s): use a smaller --batch"
        )
    stream = batches(loader, sampler, start_step)
    end_step = start_step + args.steps
    losses: list[tuple[int, float]] = []
    if rank == 0:
        mode = "ShardedOptimizer(AdamW)" + (" + overlap hook" if overlapped else "")
        print(
            f"{phase}: {world_size} rank(s) on {device.type}, {mode}; global batch "
            f"{local_batch * world_size} x {cfg.context} characters, {len(loader)} steps per epoch"
        )
    bar = None
    if rank == 0 and tqdm is not None:
        bar = tqdm(
            total=args.steps, desc=f"{phase} @ world {world_size}", unit="step", file=sys.stdout
        )
    tic = time.perf_counter()
    for step in range(start_step + 1, end_step + 1):
        batch = next(stream).to(device)
        logits = ddp(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer_step()  # with the overlap hook: only checks that the hooks stepped every bucket
        zero.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size
        losses.append((step, float(mean)))
        if rank == 0:
            chars_s = (
                (step - start_step)
                * local_batch
                * world_size
                * cfg.context
                / (time.perf_counter() - tic)
            )
            if bar is not None:
                bar.set_postfix(loss=f"{float(mean):.3f}", chars_s=f"{chars_s:,.0f}", refresh=False)
                bar.update(1)
            elif step % 10 == 0 or step == end_step:
                print(
                    f"  step {step}/{end_step}  loss {float(mean):.4f}  {chars_s:,.0f} chars/s",
                    flush=True,
                )
    if bar is not None:
        bar.close()

    # Optimizer memory: this rank's shard against the full AdamW state DDP keeps on every rank.
    mine = torch.tensor([_state_bytes(zero.optim)], dtype=torch.float64, device=device)
    per_rank = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(per_rank, mine)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        full = 2 * 4 * n_params  # exp_avg + exp_avg_sq in fp32 (+ a scalar step per param)
        print(
            f"  optimizer state per rank (plain DDP + AdamW would keep {full / 2**20:.2f} MiB on every rank):"
        )
        for r, b in enumerate(per_rank):
            print(f"    rank {r}: {float(b) / 2**20:.2f} MiB  ({float(b) / full:.2f}x DDP)")

    if phase == "train":
        save_sharded(zero, ckpt)
        if rank == 0:
            torch.save(model.state_dict(), ckpt / "model.pt")
            (ckpt / "demo.json").write_text(
                json.dumps({"step": end_step, "world_size": world_size})
            )
            print(f"  saved sharded checkpoint at {ckpt} (step {end_step}, {world_size} shards)")
    if rank == 0:
        if phase == "train":  # a fresh run: an older resumed curve no longer follows it
            (out / "loss-resume.json").unlink(missing_ok=True)
        record = {"world_size": world_size, "losses": losses}
        (out / f"loss-{phase}.json").write_text(json.dumps(record))
        plot(out)
    if overlap is not None:
        overlap.close()
    dist.barrier()  # nobody tears the group down while another rank still writes or reads


# ----------------------------------------------------------------------------- the loss plot

_LABEL_BOX = {"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}


def plot(out: Path) -> Path | None:
    """``out/loss.png`` from whichever phases have run; None (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib is not installed: no loss.png (`hatch run demo` installs it)")
        (out / "loss.png").unlink(missing_ok=True)
        return None
    h0, h1 = entropies(read_text())
    vocab = len(set(read_text()))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    colours = {"train": "tab:blue", "resume": "tab:orange"}
    top: list[float] = []
    for phase, label in (("train", "train at world {}"), ("resume", "resumed at world {}")):
        path = out / f"loss-{phase}.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        steps, values = zip(*record["losses"], strict=True)
        top.append(max(values))
        ax.plot(
            steps, values, color=colours[phase], lw=1.4, label=label.format(record["world_size"])
        )
        if phase == "resume":
            ax.axvline(steps[0] - 0.5, color="0.5", lw=0.8, ls=":")
            ax.annotate(
                "checkpoint: resharded", (steps[0] - 0.5, 1.0), xycoords=("data", "axes fraction"),
                xytext=(4, -12), textcoords="offset points", fontsize=8, color="0.35",
            )  # fmt: skip
    ax.axhline(math.log(vocab), color="0.6", lw=0.8, ls="--")
    ax.axhline(h0, color="tab:red", lw=1.0, ls="--")
    ax.axhline(h1, color="tab:green", lw=1.0, ls="--")
    ax.annotate(f"uniform guess: ln {vocab} = {math.log(vocab):.2f} nats", (0.01, math.log(vocab)),
                xycoords=("axes fraction", "data"), xytext=(0, 3), textcoords="offset points",
                fontsize=8, color="0.4")  # fmt: skip
    ax.annotate(f"entropy floor without context: H(c) = {h0:.2f} nats", (0.99, h0),
                xycoords=("axes fraction", "data"), xytext=(0, 3), textcoords="offset points",
                fontsize=8, color="tab:red", ha="right", bbox=_LABEL_BOX)  # fmt: skip
    ax.annotate(f"entropy floor with 1 character of context: H(c | previous c) = {h1:.2f} nats",
                (0.99, h1), xycoords=("axes fraction", "data"), xytext=(0, -10),
                textcoords="offset points", fontsize=8, color="tab:green", ha="right", bbox=_LABEL_BOX)  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats per character)")
    ax.set_title(
        "Character-level GPT on Shakespeare's sonnets, ShardedOptimizer(AdamW)", fontsize=10
    )
    ax.set_ylim(0, 1.12 * max(math.log(vocab), *top))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the launcher


def _torchrun(nproc: int, args: argparse.Namespace, extra: list[str]) -> None:
    """One phase: ``torchrun --standalone --nproc-per-node <nproc> demo.py ...`` (Gloo on CPU)."""
    script = Path(__file__).resolve()
    forwarded = [
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--lr",
        str(args.lr),
        "--out",
        args.out,
    ]
    if args.no_overlap:
        forwarded.append("--no-overlap")
    argv = ["--standalone", "--nproc-per-node", str(nproc), str(script), *forwarded, *extra]
    shown = shlex.join(["torchrun", *argv]).replace(str(script), os.path.relpath(script))
    print(f"$ {shown}", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: more threads per rank buy little
    # `python -m torch.distributed.run` is torchrun, run with this interpreter.
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv], env=env, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"demo: the torchrun launch above failed with exit status {proc.returncode}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="local ranks for the first phase")
    parser.add_argument(
        "--resume-world-size", type=int, default=1, help="local ranks after resuming"
    )
    parser.add_argument("--steps", type=int, default=150, help="steps per phase")
    parser.add_argument("--batch", type=int, default=32, help="global batch (text windows)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="demo-out", help="output directory")
    parser.add_argument(
        "--resume", default=None, help="(under torchrun) resume from this checkpoint"
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="do not register the overlap hook"
    )
    parser.add_argument(
        "--short", action="store_true", help="a quick run (20 steps per phase) for tests"
    )
    args = parser.parse_args(argv)
    if args.short:
        args.steps = 20
    for name in ("world_size", "resume_world_size", "steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # one rank, launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return 0

    text = read_text()
    h0, h1 = entropies(text)
    vocab = len(set(text))
    print(
        f"text: {len(text):,} characters of Shakespeare's sonnets, {vocab} distinct; loss starts near "
        f"ln({vocab}) = {math.log(vocab):.2f} nats, entropy {h0:.2f} (no context), "
        f"{h1:.2f} (one character of context)"
    )
    start = time.perf_counter()
    _torchrun(args.world_size, args, [])
    _torchrun(args.resume_world_size, args, ["--resume", str(Path(args.out) / "checkpoint")])
    out = Path(args.out)
    first = json.loads((out / "loss-train.json").read_text())["losses"]
    second = json.loads((out / "loss-resume.json").read_text())["losses"]
    png = out / "loss.png"
    wrote = f"; wrote {png}" if png.exists() else ""
    print(
        f"loss {first[0][1]:.3f} -> {second[-1][1]:.3f}{wrote} in {time.perf_counter() - start:.0f}s total"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
