#!/usr/bin/env python3
"""shardkit demo: train a small character-level GPT with ZeRO-2 (ShardedDataParallel) beside DDP.

What it does (``hatch run demo``, or ``python docs/examples/demo.py`` in an environment with
shardkit-ddp, shardkit-checkpoint and their siblings, tqdm and matplotlib installed):

1. Launches ``--world-size`` local ranks (default 2) with ``torchrun --standalone``: Gloo on the
   CPU, no GPU or cluster needed (NCCL when GPUs are present).
2. Trains a small GPT-style decoder (token and position embeddings, causal self-attention, MLP,
   layer norm, an LM head tied to the token embedding) twice on the same batches from the same
   initial weights: with ``shardkit.ddp.ShardedDataParallel`` (ZeRO-2: gradients
   reduce-scattered into each rank's shard, ``AdamW`` state and steps sharded, params
   all-gathered), and with torch's ``DistributedDataParallel`` + ``AdamW`` (the reference, in
   its leanest configuration: ``gradient_as_bucket_view=True``).
3. The data is real text: eighteen of Shakespeare's sonnets (public domain, shipped in
   ``docs/examples/data/sonnets.txt`` with their source), read character by character. A
   ``DistributedSampler`` gives each rank its own share of the text windows every epoch.
4. Shows a tqdm progress bar with the loss and throughput, and prints what each rank holds per
   parameter after a step, for both: every live tensor storage counted once (params, gradients,
   optimizer state; see :func:`live_storages`).
5. Checkpoints both through shardkit-checkpoint (atomic commits, CRC-32s): ZeRO-2's optimizer
   with ``shardkit.optim.save_sharded`` (each rank writes its shard), the models and DDP's AdamW
   with ``shardkit.checkpoint.save``; then launches again at ``--resume-world-size`` ranks
   (default 3), resumes both from their checkpoints (resharded to the new world size) and trains
   on.
6. Plots with matplotlib to ``OUT/loss.png``: the loss of both runs over both phases, with the
   entropy of the text's characters (the floor of a model that sees no context) and of a
   character given the previous one, and the bytes per parameter each rank held with ZeRO-2 and
   with DDP at each world size.
7. ``--wire int8`` (or ``int4``) runs ZeRO-2 with quantized collectives
   (``ShardedDataParallel(..., wire="int8")``: block-quantized gradients and weight deltas, a
   quarter of DDP's bytes): its loss then follows DDP's closely rather than exactly.

Each phase is one ``torchrun`` launch; to run them by hand (one or many nodes)::

    torchrun --standalone --nproc-per-node 4 docs/examples/demo.py --steps 500 --out runs/a
    torchrun --standalone --nproc-per-node 2 docs/examples/demo.py --steps 200 --out runs/a \\
        --resume runs/a/checkpoint
"""

from __future__ import annotations

import argparse
import gc
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
from shardkit import checkpoint
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer, load_sharded, save_sharded
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# tqdm and matplotlib come with the demo's hatch env (`hatch run demo`); they are not shardkit
# dependencies. Without them the demo still trains: plain progress lines, no loss.png.
try:
    from tqdm import tqdm
except ImportError:
    tqdm = None  # type: ignore[assignment,misc]

TEXT = Path(__file__).resolve().parent / "data" / "sonnets.txt"


# ----------------------------------------------------------------------------- the data


_BUCKET_MB = 0.25
"""Gradient bucket cap (MiB) of both runs, sized for this small model: with DDP's default 25 MiB
one bucket would hold the whole model, and ZeRO-2 keeps a staging pool of two buckets between
steps (shardkit-ddp's ``keep_staging_buffers``), which on a 0.6M-param model would be two
copies of the gradients; 0.25 MiB buckets keep it under 1 byte per param, as the default
buckets do on a model of 30M params or more."""


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


def live_storages(extra: list[torch.Tensor | None], device: torch.device) -> dict[int, int]:
    """``storage data_ptr -> bytes`` of every live tensor on ``device``'s type, each storage
    counted once (views share their storage's entry), as ``shardkit.testing.live_storages``
    counts: every tensor reachable from Python plus ``extra`` (the params' ``.grad``)."""
    gc.collect()
    out: dict[int, int] = {}
    for obj in [*gc.get_objects(), *extra]:
        if obj is None or not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        if obj.device.type != device.type:
            continue
        try:
            st = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


@dataclass
class Job:
    """One of the two runs of a phase: its model, the wrapper that trains it, its optimizer."""

    name: str
    """``"zero2"`` (ShardedDataParallel) or ``"ddp"`` (the reference)."""
    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer


def build(
    name: str, cfg: GPTConfig, device: torch.device, lr: float, ckpt: Path | None,
    wire: str = "exact",
) -> Job:  # fmt: skip
    """A job from the same initial weights (seed 0), resumed from ``ckpt`` when given; ZeRO-2's
    collectives travel as ``wire`` says (``"exact"``, ``"int8"``, ``"int4"``)."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if name == "ddp":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=0.01
        )
        if ckpt is not None:  # model and AdamW, resharded to this world size
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            checkpoint.load(state, ckpt / "ddp")
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        wrapped: nn.Module = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=_BUCKET_MB)
        return Job(name, model, wrapped, optimizer)
    if ckpt is not None:  # the weights first: ShardedDataParallel lays them out in its buckets
        checkpoint.load(model.state_dict(), ckpt / "zero2-model")
    zero = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.01)
    wrapped = ShardedDataParallel(model, zero, bucket_cap_mb=_BUCKET_MB, wire=wire)
    if ckpt is not None:
        load_sharded(zero, ckpt / "zero2-optimizer")  # each rank reads the shard it owns now
    return Job(name, model, wrapped, zero)


def run(
    job: Job,
    args: argparse.Namespace,
    data: CharWindows,
    cfg: GPTConfig,
    start_step: int,
    phase: str,
    baseline: set[int],
) -> tuple[list[tuple[int, float]], int]:
    """Trains ``job`` ``args.steps`` steps; returns (step, mean loss) and the bytes this rank
    holds right after its last step, before the gradients are dropped: every live storage that
    is not in ``baseline`` (what was alive before the job was built), counted once."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = next(job.model.parameters()).device
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
    label = {"zero2": "ZeRO-2 (ShardedDataParallel)", "ddp": "DDP (reference)"}[job.name]
    bar = None
    if rank == 0 and tqdm is not None:
        bar = tqdm(total=args.steps, desc=f"{phase} {label} @ world {world_size}", unit="step",
                   file=sys.stdout)  # fmt: skip
    params = list(job.model.parameters())
    held = 0
    tic = time.perf_counter()
    for step in range(start_step + 1, end_step + 1):
        batch = next(stream).to(device)
        logits = job.wrapped(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        job.optimizer.step()
        if step == end_step:  # what a rank holds between steps: before gradients are dropped
            del logits, batch
            live = live_storages([p.grad for p in params], device)
            held = sum(n for ptr, n in live.items() if ptr not in baseline)
        job.optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size
        losses.append((step, float(mean)))
        if rank == 0:
            chars_s = (step - start_step) * local_batch * world_size * cfg.context
            chars_s /= time.perf_counter() - tic
            if bar is not None:
                bar.set_postfix(loss=f"{float(mean):.3f}", chars_s=f"{chars_s:,.0f}", refresh=False)
                bar.update(1)
            elif step % 10 == 0 or step == end_step:
                print(f"  {label} step {step}/{end_step}  loss {float(mean):.4f}  "
                      f"{chars_s:,.0f} chars/s", flush=True)  # fmt: skip
    if bar is not None:
        bar.close()
    return losses, held


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
    ckpt = Path(args.resume) if args.resume else None
    start_step = 0
    if ckpt is not None:
        opened = checkpoint.open_checkpoint(ckpt / "zero2-model")
        start_step = int((opened.record or {})["step"])
    if rank == 0:
        print(
            f"{phase}: {world_size} rank(s) on {device.type}; the same batches through ZeRO-2 and "
            f"DDP; global batch {max(1, args.batch // world_size) * world_size} x {cfg.context} "
            f"characters"
        )
    record: dict[str, Any] = {"world_size": world_size}
    n_params = 0
    for name in ("ddp", "zero2"):  # one after the other: each job's memory counted alone
        baseline = set(live_storages([], device))
        job = build(name, cfg, device, args.lr, ckpt, args.wire)
        n_params = sum(p.numel() for p in job.model.parameters())
        losses, held = run(job, args, data, cfg, start_step, phase, baseline)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, held / n_params)
        record[name] = {"losses": losses, "bytes_per_param": gathered}
        if phase == "train":
            save(job, out / "checkpoint", losses[-1][0])
        del job, losses
        gc.collect()
    if rank == 0:
        diff = max(
            abs(a[1] - b[1])
            for a, b in zip(record["ddp"]["losses"], record["zero2"]["losses"], strict=True)
        )
        print(
            f"  held per rank after a step ({n_params:,} params, every live tensor storage once):"
        )
        for r in range(world_size):
            z, d = record["zero2"]["bytes_per_param"][r], record["ddp"]["bytes_per_param"][r]
            print(
                f"    rank {r}: ZeRO-2 {z:.1f} bytes/param, DDP {d:.1f} bytes/param ({z / d:.2f}x)"
            )
        print(f"  loss of ZeRO-2 and DDP differ by at most {diff:.1e} over the phase")
        if phase == "train":
            print(f"  checkpoints at {out / 'checkpoint'} (step {start_step + args.steps}, "
                  f"{world_size} ranks): zero2-model, zero2-optimizer (sharded), ddp")  # fmt: skip
            (out / "loss-resume.json").unlink(
                missing_ok=True
            )  # a fresh run: an older resume is stale
        (out / f"loss-{phase}.json").write_text(json.dumps(record))
        plot(out)
    dist.barrier()  # nobody tears the group down while another rank still writes or reads


def save(job: Job, ckpt: Path, step: int) -> None:
    """Both jobs' checkpoints through shardkit-checkpoint (collective: every rank calls it)."""
    if job.name == "ddp":  # plain DDP + AdamW: model and optimizer state, one DCP checkpoint
        msd, osd = get_state_dict(job.model, job.optimizer)
        checkpoint.save({"model": msd, "optim": osd}, ckpt / "ddp", record={"step": step})
        return
    assert isinstance(job.optimizer, ShardedOptimizer)
    checkpoint.save(job.model.state_dict(), ckpt / "zero2-model", record={"step": step})
    save_sharded(job.optimizer, ckpt / "zero2-optimizer")  # each rank writes the state it owns


# ----------------------------------------------------------------------------- the plot

_LABEL_BOX = {"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}
_COLOURS = {"zero2": "tab:blue", "ddp": "tab:orange"}
_NAMES = {"zero2": "ZeRO-2 (ShardedDataParallel)", "ddp": "DDP + AdamW"}


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
    records = {
        phase: json.loads((out / f"loss-{phase}.json").read_text())
        for phase in ("train", "resume")
        if (out / f"loss-{phase}.json").exists()
    }
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120, width_ratios=(2.2, 1))
    top: list[float] = []
    for phase, record in records.items():
        for name in ("ddp", "zero2"):
            steps, values = zip(*record[name]["losses"], strict=True)
            top.append(max(values))
            label = f"{_NAMES[name]}, world {record['world_size']}" + (
                " (resumed)" if phase == "resume" else ""
            )
            ax.plot(steps, values, color=_COLOURS[name], lw=1.3 if name == "zero2" else 2.6,
                    alpha=1.0 if name == "zero2" else 0.45,
                    ls="-" if phase == "train" else "--", label=label)  # fmt: skip
        if phase == "resume":
            first = record["zero2"]["losses"][0][0]
            ax.axvline(first - 0.5, color="0.5", lw=0.8, ls=":")
            ax.annotate(
                f"checkpoint: resharded to {record['world_size']} ranks", (first - 0.5, 1.0),
                xycoords=("data", "axes fraction"), xytext=(4, -12), textcoords="offset points",
                fontsize=8, color="0.35",
            )  # fmt: skip
    ax.axhline(h0, color="tab:red", lw=1.0, ls="--")
    ax.axhline(h1, color="tab:green", lw=1.0, ls="--")
    ax.annotate(f"no context: H(c) = {h0:.2f}", (0.99, h0), xycoords=("axes fraction", "data"),
                xytext=(0, 3), textcoords="offset points", fontsize=8, color="tab:red",
                ha="right", bbox=_LABEL_BOX)  # fmt: skip
    ax.annotate(f"1 character of context: H(c | previous) = {h1:.2f}", (0.99, h1),
                xycoords=("axes fraction", "data"), xytext=(0, -10), textcoords="offset points",
                fontsize=8, color="tab:green", ha="right", bbox=_LABEL_BOX)  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats per character)")
    ax.set_title("Character-level GPT on Shakespeare's sonnets: the same batches", fontsize=10)
    ax.set_ylim(0, 1.12 * max(math.log(vocab), *top))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    labels, width = [], 0.38
    for i, record in enumerate(records.values()):
        labels.append(f"world {record['world_size']}")
        for j, name in enumerate(("ddp", "zero2")):
            value = max(record[name]["bytes_per_param"])  # the rank holding most
            x = i + (j - 0.5) * width
            bars.bar(x, value, width, color=_COLOURS[name], label=_NAMES[name] if i == 0 else None)
            bars.annotate(f"{value:.1f}", (x, value), xytext=(0, 2), textcoords="offset points",
                          ha="center", fontsize=8)  # fmt: skip
    bars.set_xticks(range(len(labels)), labels)
    bars.set_ylim(
        0, 1.35 * max(max(r[n]["bytes_per_param"]) for r in records.values() for n in _NAMES)
    )
    bars.set_ylabel("bytes per parameter held per rank")
    bars.set_title(
        "After a step: every live tensor storage\n(params, grads, AdamW state)", fontsize=10
    )
    bars.legend(loc="upper right", fontsize=8)
    bars.grid(alpha=0.3, axis="y")
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
        "--wire",
        args.wire,
    ]
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
        "--resume-world-size", type=int, default=3, help="local ranks after resuming"
    )
    parser.add_argument("--steps", type=int, default=150, help="steps per phase")
    parser.add_argument("--batch", type=int, default=32, help="global batch (text windows)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="demo-out", help="output directory")
    parser.add_argument(
        "--resume", default=None, help="(under torchrun) resume from this checkpoint"
    )
    parser.add_argument(
        "--short", action="store_true", help="a quick run (20 steps per phase) for tests"
    )
    parser.add_argument(
        "--wire",
        default="exact",
        choices=["exact", "int8", "int4"],
        help="how ZeRO-2's gradients and params travel: exact, or block-quantized int8 / int4 "
        "(a quarter / an eighth of DDP's bytes)",
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
            gc.collect()  # the wrappers' reference cycles hold the group: free it before exit
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
    first = json.loads((out / "loss-train.json").read_text())["zero2"]["losses"]
    second = json.loads((out / "loss-resume.json").read_text())["zero2"]["losses"]
    png = out / "loss.png"
    wrote = f"; wrote {png}" if png.exists() else ""
    print(
        f"loss {first[0][1]:.3f} -> {second[-1][1]:.3f}{wrote} in {time.perf_counter() - start:.0f}s total"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
