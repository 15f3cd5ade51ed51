"""Training quality, wire bytes and step time of ``ShardedDataParallel``'s quantized wires.

Not collected by pytest. Run (Gloo on CPU, one thread per rank)::

    python packages/ddp/benchmarks/wire_quality.py [--steps 300] [--cnn-steps 250] \\
        [--seeds 0 1 2] [--world 2] [--rounds 100] [--out docs/benchmarks/wire/quality.json] \\
        [--plot docs/benchmarks/wire/quality.png]

(``--plot`` needs matplotlib; ``--plot ''`` skips the figure.) About 2 minutes on 2 cores with
the defaults.

Method
------
Every run is ``ShardedDataParallel(model, ShardedOptimizer(model.parameters(),
torch.optim.AdamW, fused=True), wire=W)`` for ``W`` in ``exact`` (fp32), ``int8`` (256-element
blocks) and ``int4`` (64-element blocks), the params' wire being the gradients' (the default of
``wire_params``), bucket cap 0.25 MiB (the demo's, so these small models get more than one
bucket). For each model and seed, the three wires start from the same initial weights (seeded
by the seed) and see the same batches (each rank's batch at each step drawn from a generator
seeded by ``(seed, step, rank)``): the only difference between them is the wire. Ranks are
spawned with ``torch.multiprocessing`` at ``--world`` ranks (default 2); all runs of one part
share one process group.

Models:

- ``gpt``: the demo's character-level GPT (``docs/examples/demo.py``, imported by path),
  shrunk: context 32, width 64, 4 heads, 2 blocks (106k params), on Shakespeare's sonnets: the
  first 90 % of the text trains (random windows, 16 per rank per step), the last 10 % is held
  out. AdamW lr 3e-3, weight decay 0.01 (the demo's). ``--steps`` steps (default 300).
- ``cnn``: 3 conv layers (3 -> 16 -> 32 -> 32 channels, 3x3, ReLU, two 2x2 max-pools) and a
  linear head on a synthetic 10-class task: 3x16x16 images, each a class template (fixed
  smoothed Gaussian patterns, seed 1234, the same for every run) rolled by up to 3 pixels each
  way, scaled by a random contrast in [0.5, 1.5], plus Gaussian noise of std 3.5; 32 images per
  rank per step, AdamW lr 2e-3, weight decay 0.01. ``--cnn-steps`` steps (default 250).

Figures per run: the training loss of every step (mean over the ranks), the final training
loss (mean of the last 20 steps' losses) and the evaluation loss at the end on held-out data
that is the same for every run (gpt: every non-overlapping 32-character window of the held-out
text; cnn: 2048 images drawn with seed 999999), computed on the params every rank holds (the
replica; with a quantized wire the owner's exact masters differ from it by the last step's
rounding). Per model and wire: mean and worst (largest) over the seeds. The check: is int8's
final loss (its worst seed, and its mean) at most fp32's worst seed + 1 %?

Bytes: ``sdp.comm_stats`` (ring-model bytes per rank, [Note: Byte accounting] in
``shardkit.optim._wire``), reset after the wrapper is built, ``reduce_scatter + all_gather``
over the run, per param per step, divided by DDP's fp32 all-reduce of the same params
(``2(N-1)/N * 4`` bytes per param). Counted in every quality run at ``--world`` and, briefly (5
steps per wire), for the cnn at world 4.

Step time (gpt, ``--world`` ranks, one interleaved run): torch DDP
(``gradient_as_bucket_view=True``, the same bucket cap) + AdamW fused, and
``ShardedDataParallel`` exact / int8 / int4, all built at once; each round steps every system
once (``zero_grad``, forward, backward, ``step``) in an order rotated every round, a barrier
before each; after one warm-up round, the median over ``--rounds`` rounds of each system's step
time, and the median of its per-round ratio to DDP's. On this box (2 cores, two ranks plus
Gloo's threads) that is mostly a measure of CPU work: the codecs' encode / decode and the
extra local sums.

Modelled step time at 10 and 100 Gb/s per rank (no overlap, an upper bound of a step):
``t = t_compute + t_codec + bytes / bandwidth`` with ``t_compute`` forward + backward of the
model plus an AdamW step over this rank's share of the params (DDP: all of them), with no
communication, as ``bench_systems.py`` measures it, but run as one more entry of every round of
the interleaved timing (so under the same load; medians over the rounds); ``t_codec``
(quantized wires) the encode of one model-sized fp32 vector plus ``(2N-1)/N`` times its decode
(a rank encodes ``(N-1)/N`` of the gradients and its own ``1/N`` param delta, decodes ``(N-1)/N``
gradient chunks and every rank's delta), measured with ``BlockFormat.encode`` / ``decode_add``; ``bytes``
the counted bytes per rank per step (DDP: ``2(N-1)/N * 4`` per param). Each part is in the JSON
beside the measured times, and the modelled times as ratios to DDP's. The GPT here is small
(106k params): at these bandwidths its communication is well under a millisecond, so the
modelled ratios mostly show the codecs' CPU cost against compute; the bytes ratios are what
carries to large models.

Everything lands in one JSON (``--out``) with the machine (``platform.processor()``, CPU count,
torch version, date) and the wall time of each part; ``--plot`` draws the loss curves (panels
gpt and cnn; per wire the mean over seeds of each seed's 10-step running mean, with the
min / max band over the seeds).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_ROOT = Path(__file__).resolve().parents[3]
_DEMO = _ROOT / "docs" / "examples" / "demo.py"
WIRES = ("exact", "int8", "int4")
MODELS = ("gpt", "cnn")
_BUCKET_MB = 0.25
_LAST = 20  # final training loss: mean of the last 20 steps
_GPT = {"context": 32, "dim": 64, "heads": 4, "layers": 2, "batch": 16, "lr": 3e-3}
_CNN = {"size": 16, "classes": 10, "batch": 32, "lr": 2e-3, "noise": 3.5, "shift": 3}
_TEMPLATE_SEED = 1234
_EVAL_SEED = 999999
_BANDWIDTHS_GBPS = (10, 100)


def _load_demo() -> Any:
    spec = importlib.util.spec_from_file_location("shardkit_demo", _DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["shardkit_demo"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1_000_003 + k
    return torch.Generator().manual_seed(seed % (2**62))


# ----------------------------------------------------------------------------- the tasks


class Task:
    """A model factory, a batch per (seed, step, rank), a loss and a held-out evaluation."""

    name: str

    def model(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def batch(self, seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> float:
        """Mean loss over the held-out set (every rank computes it all: it is small)."""
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in self.held_out:
                total += float(self.loss(model, x, y)) * len(x)
                count += len(x)
        model.train()
        return total / count

    held_out: list[tuple[torch.Tensor, torch.Tensor]]


class GPTTask(Task):
    name = "gpt"

    def __init__(self) -> None:
        data = demo.CharWindows(demo.read_text(), context=_GPT["context"], stride=1)
        self.vocab = len(data.chars)
        split = int(0.9 * len(data.ids))
        self.train_ids, held = data.ids[:split], data.ids[split:]
        self.cfg = demo.GPTConfig(
            vocab=self.vocab,
            context=_GPT["context"],
            dim=_GPT["dim"],
            heads=_GPT["heads"],
            layers=_GPT["layers"],
        )
        n = _GPT["context"] + 1
        windows = held[: (len(held) // n) * n].view(-1, n)
        self.held_out = [(w[:, :-1], w[:, 1:]) for w in windows.split(64)]

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return demo.GPT(self.cfg)

    def batch(self, seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = _GPT["context"] + 1
        starts = torch.randint(
            0, len(self.train_ids) - n, (_GPT["batch"],), generator=_gen(seed, step, rank)
        )
        w = torch.stack([self.train_ids[s : s + n] for s in starts.tolist()])
        return w[:, :-1], w[:, 1:]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).reshape(-1, self.vocab), y.reshape(-1))


class CNN(nn.Module):
    def __init__(self, classes: int, size: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(32 * (size // 4) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class CNNTask(Task):
    name = "cnn"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(_TEMPLATE_SEED)
        size, classes = _CNN["size"], _CNN["classes"]
        raw = torch.randn(classes, 3, size + 4, size + 4, generator=g)
        smooth = F.avg_pool2d(raw, 5, stride=1)  # spatially correlated patterns
        self.templates = smooth / smooth.flatten(1).std(1)[:, None, None, None]
        self.held_out = [self._sample(_gen(_EVAL_SEED, i), 256) for i in range(8)]

    def _sample(self, g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shift = _CNN["shift"]
        y = torch.randint(0, _CNN["classes"], (n,), generator=g)
        dx = torch.randint(-shift, shift + 1, (n,), generator=g).tolist()
        dy = torch.randint(-shift, shift + 1, (n,), generator=g).tolist()
        x = torch.stack(
            [
                torch.roll(self.templates[c], (a, b), dims=(1, 2))
                for c, a, b in zip(y.tolist(), dx, dy, strict=True)
            ]
        )
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=g)
        x = x * contrast + _CNN["noise"] * torch.randn(x.shape, generator=g)
        return x, y

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return CNN(_CNN["classes"], _CNN["size"])

    def batch(self, seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(_gen(seed, step, rank), _CNN["batch"])

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)


def _task(name: str) -> Task:
    return GPTTask() if name == "gpt" else CNNTask()


def _lr(task: Task) -> float:
    return float(_GPT["lr"] if task.name == "gpt" else _CNN["lr"])


# ----------------------------------------------------------------------------- one rank


def _sharded(model: nn.Module, wire: str, lr: float) -> tuple[nn.Module, Any]:
    from shardkit.ddp import ShardedDataParallel
    from shardkit.optim import ShardedOptimizer

    opt = ShardedOptimizer(
        model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.01, fused=True
    )
    sdp = ShardedDataParallel(model, opt, wire=wire, bucket_cap_mb=_BUCKET_MB)
    return sdp, opt


def _ddp_bytes(numel: int, world: int) -> float:
    return 2 * (world - 1) / world * 4 * numel


def _train(task: Task, wire: str, seed: int, steps: int) -> dict[str, Any]:
    """One run at this process group's world size: per-step losses, final figures, bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = task.model(seed)
    numel = sum(p.numel() for p in model.parameters())
    sdp, opt = _sharded(model, wire, _lr(task))
    sdp.comm_stats.reset()
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = task.batch(seed, step, rank)
        opt.zero_grad()
        loss = task.loss(sdp, x, y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    seconds = time.perf_counter() - t0
    stats = sdp.comm_stats
    moved = stats.bytes["reduce_scatter"] + stats.bytes["all_gather"]
    per_param = moved / steps / numel
    result = {
        "loss": losses,
        "final_train": statistics.fmean(losses[-_LAST:]),
        "eval": task.evaluate(model),
        "params": numel,
        "seconds": seconds,
        "bytes_per_param_step": per_param,
        "reduce_scatter_bytes_per_param_step": stats.bytes["reduce_scatter"] / steps / numel,
        "all_gather_bytes_per_param_step": stats.bytes["all_gather"] / steps / numel,
        "scale_bytes_per_param_step": sum(stats.scale_bytes.values()) / steps / numel,
        "bytes_vs_ddp": per_param * numel / _ddp_bytes(numel, world),
    }
    sdp.close()
    del sdp, opt, model
    gc.collect()
    return result


def _quality(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in MODELS:
        task = _task(name)
        steps = args.steps if name == "gpt" else args.cnn_steps
        runs: dict[str, dict[str, Any]] = {w: {} for w in WIRES}
        for seed in args.seeds:
            for wire in WIRES:
                r = _train(task, wire, seed, steps)
                runs[wire][str(seed)] = r
                if dist.get_rank() == 0:
                    print(
                        f"  {name} seed {seed} {wire:5s}: final train {r['final_train']:.4f} "
                        f"eval {r['eval']:.4f} bytes {r['bytes_vs_ddp']:.3f}x DDP "
                        f"({r['seconds']:.1f}s)",
                        flush=True,
                    )
        out[name] = {"steps": steps, "runs": runs}
    return out


def _bytes_only(args: argparse.Namespace) -> dict[str, Any]:
    task = CNNTask()
    return {wire: _train(task, wire, 0, args.bytes_steps)["bytes_vs_ddp"] for wire in WIRES}


class _System:
    def __init__(self, name: str, task: GPTTask, opt: Any, wrapped: nn.Module) -> None:
        self.name, self.task, self.opt, self.wrapped = name, task, opt, wrapped

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        self.task.loss(self.wrapped, x, y).backward()
        self.opt.step()


class _ComputeAlone:
    """Forward + backward of the plain model, and AdamW steps over all of its params and over
    this rank's share, with no communication: one more system of the interleaved rounds, so it
    runs under the same load as the others (each part after a barrier)."""

    def __init__(self, task: GPTTask) -> None:
        self.task = task
        self.model = task.model(0)
        n = sum(p.numel() for p in self.model.parameters())
        self.adams = {}
        for key, numel in (("adamw_all", n), ("adamw_share", n // dist.get_world_size())):
            flat = torch.zeros(numel, requires_grad=True)
            flat.grad = torch.ones_like(flat)
            self.adams[key] = torch.optim.AdamW([flat], lr=1e-4, fused=True)
        self.times: dict[str, list[float]] = {
            "forward_backward": [],
            "adamw_all": [],
            "adamw_share": [],
        }

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        self.model.zero_grad()
        self.task.loss(self.model, x, y).backward()
        seconds = {"forward_backward": time.perf_counter() - t0}
        for key, opt in self.adams.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            seconds[key] = time.perf_counter() - t0
        if record:
            for key, v in seconds.items():
                self.times[key].append(v)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.times.items()}


def _codec_seconds(wire: str, numel: int, world: int) -> float:
    """Encode of ``numel`` fp32 values + ``(2N-1)/N`` times their decode (median of 10)."""
    from shardkit.ddp import WIRE_FORMATS

    fmt = WIRE_FORMATS[wire]
    x = torch.randn(numel, generator=_gen(7))
    enc = torch.empty(fmt.nbytes(numel), dtype=torch.uint8)
    out = torch.zeros(numel)
    scratch = torch.empty(fmt.scratch_numel(numel))

    def timed(f: Callable[[], None]) -> float:
        ts = []
        for _ in range(12):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[2:])

    t_enc = timed(lambda: fmt.encode(x, enc, scratch))
    t_dec = timed(lambda: fmt.decode_add(enc, out, scratch))
    return t_enc + (2 * world - 1) / world * t_dec


def _timing(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    task = GPTTask()
    systems = []
    model = task.model(0)
    numel = sum(p.numel() for p in model.parameters())
    ddp_opt = torch.optim.AdamW(model.parameters(), lr=_GPT["lr"], weight_decay=0.01, fused=True)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=_BUCKET_MB)
    systems.append(_System("ddp", task, ddp_opt, ddp))
    sharded = {}
    for wire in WIRES:
        sdp, opt = _sharded(task.model(0), wire, _GPT["lr"])
        sharded[wire] = sdp
        systems.append(_System(wire, task, opt, sdp))
    compute_alone = _ComputeAlone(task)
    x, y = task.batch(0, 0, rank)
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    for r in range(args.rounds + 1):  # round 0 warms up
        if r == 1:
            for sdp in sharded.values():
                sdp.comm_stats.reset()
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for s in order:
            dist.barrier()
            t0 = time.perf_counter()
            s.step(x, y)
            if r:
                times[s.name].append(time.perf_counter() - t0)
        compute_alone.step(x, y, record=r > 0)
    ratios = {
        k: statistics.median([t / d for t, d in zip(v, times["ddp"], strict=True)])
        for k, v in times.items()
    }
    wire_bytes = {"ddp": _ddp_bytes(numel, world)}
    for wire, sdp in sharded.items():
        stats = sdp.comm_stats
        wire_bytes[wire] = (stats.bytes["reduce_scatter"] + stats.bytes["all_gather"]) / args.rounds
    for s in systems:
        s.wrapped = s.opt = None  # type: ignore[assignment]
    for sdp in sharded.values():
        sdp.close()
    del systems, sharded, ddp, ddp_opt
    gc.collect()
    parts = compute_alone.medians()
    compute = {
        "ddp": parts["forward_backward"] + parts["adamw_all"],
        "sharded": parts["forward_backward"] + parts["adamw_share"],
    }
    codec = {w: 0.0 if w == "exact" else _codec_seconds(w, numel, world) for w in WIRES}
    result: dict[str, Any] = {
        "params": numel,
        "rounds": args.rounds,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_vs_ddp": ratios,
        "compute_s": compute,
        "compute_parts_s": parts,
        "codec_s": codec,
        "bytes_per_step": wire_bytes,
        "modelled": {},
    }
    for gbps in _BANDWIDTHS_GBPS:
        bw = gbps * 1e9 / 8
        t = {"ddp": compute["ddp"] + wire_bytes["ddp"] / bw}
        for wire in WIRES:
            t[wire] = compute["sharded"] + codec[wire] + wire_bytes[wire] / bw
        result["modelled"][f"{gbps}Gbps"] = {
            "comm_s": {k: v / bw for k, v in wire_bytes.items()},
            "step_s": t,
            "step_vs_ddp": {k: v / t["ddp"] for k, v in t.items()},
        }
    return result


def _worker(
    rank: int, world: int, port: int, part: str, args: argparse.Namespace, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parts: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "quality": _quality,
        "bytes": _bytes_only,
        "timing": _timing,
    }
    result = parts[part](args)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _spawn(world: int, part: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    out = os.path.join(scratch, f"{part}-{world}.json")
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(world, _port(), part, args, out), nprocs=world, join=True)
    with open(out) as f:
        result = dict(json.load(f))
    result["wall_s"] = time.perf_counter() - t0
    print(f"{part} at world {world}: {result['wall_s']:.0f}s", flush=True)
    return result


# ----------------------------------------------------------------------------- summary, plot


def _summarise(quality: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, q in quality.items():
        per_wire = {}
        for wire, runs in q["runs"].items():
            finals = [r["final_train"] for r in runs.values()]
            evals = [r["eval"] for r in runs.values()]
            per_wire[wire] = {
                "final_train_mean": statistics.fmean(finals),
                "final_train_worst": max(finals),
                "final_train_best": min(finals),
                "eval_mean": statistics.fmean(evals),
                "eval_worst": max(evals),
                "eval_best": min(evals),
                "bytes_vs_ddp": statistics.fmean(r["bytes_vs_ddp"] for r in runs.values()),
            }
        exact = per_wire["exact"]
        bound = 1.01 * exact["final_train_worst"]
        eval_bound = 1.01 * exact["eval_worst"]
        summary[name] = {
            "wires": per_wire,
            "int8_final_train_worst_within_exact_worst_plus_1pct": (
                per_wire["int8"]["final_train_worst"] <= bound
            ),
            "int8_final_train_mean_within_exact_worst_plus_1pct": (
                per_wire["int8"]["final_train_mean"] <= bound
            ),
            "int8_eval_worst_within_exact_worst_plus_1pct": (
                per_wire["int8"]["eval_worst"] <= eval_bound
            ),
            "gap_vs_exact_mean_pct": {
                w: {
                    "final_train": 100
                    * (per_wire[w]["final_train_mean"] / exact["final_train_mean"] - 1),
                    "eval": 100 * (per_wire[w]["eval_mean"] / exact["eval_mean"] - 1),
                }
                for w in ("int8", "int4")
            },
        }
    return summary


def _running_mean(values: list[float], k: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    colours = {"exact": "tab:blue", "int8": "tab:orange", "int4": "tab:green"}
    labels = {"exact": "exact (fp32)", "int8": "int8 (256-blocks)", "int4": "int4 (64-blocks)"}
    titles = {
        "gpt": "demo GPT (chars, sonnets), {p:,} params",
        "cnn": "CNN, synthetic 10 classes, {p:,} params",
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    world = record["config"]["world"]
    for ax, name in zip(axes, MODELS, strict=True):
        q = record["quality"][name]
        summary = record["summary"][name]["wires"]
        params = 0
        for wire in WIRES:
            curves = [_running_mean(r["loss"]) for r in q["runs"][wire].values()]
            params = next(iter(q["runs"][wire].values()))["params"]
            steps = range(1, len(curves[0]) + 1)
            cols = list(zip(*curves, strict=True))
            mean = [statistics.fmean(c) for c in cols]
            low, high = [min(c) for c in cols], [max(c) for c in cols]
            ax.fill_between(steps, low, high, color=colours[wire], alpha=0.18, lw=0)
            s = summary[wire]
            label = (
                f"{labels[wire]}: final {s['final_train_mean']:.3f}, "
                f"eval {s['eval_mean']:.3f}, {s['bytes_vs_ddp']:.3f}x DDP bytes"
            )
            ax.plot(steps, mean, color=colours[wire], lw=1.3, label=label)
        ax.set_title(titles[name].format(p=params), fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (10-step running mean)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5, loc="upper right")
    fig.suptitle(
        f"ShardedDataParallel wires, Gloo CPU world {world}, AdamW: mean over seeds "
        f"{record['config']['seeds']}, band min/max",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cpu_model() -> str:
    """The first ``model name`` of ``/proc/cpuinfo`` (``platform.processor()`` is often empty
    on Linux), or ``""``."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return names[0] if names else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="gpt training steps")
    parser.add_argument("--cnn-steps", type=int, default=250, help="cnn training steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bytes-world", type=int, default=4, help="world of the cnn byte count")
    parser.add_argument("--bytes-steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=100, help="step-time rounds")
    parser.add_argument("--out", default="docs/benchmarks/wire/quality.json")
    parser.add_argument("--plot", default="docs/benchmarks/wire/quality.png")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        quality = _spawn(args.world, "quality", args, scratch)
        bytes_world = _spawn(args.bytes_world, "bytes", args, scratch)
        timing = _spawn(args.world, "timing", args, scratch)
    record: dict[str, Any] = {
        "machine": {
            "processor": platform.processor(),
            "cpu_model": _cpu_model(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        "command": " ".join(["python", os.path.relpath(__file__, _ROOT), *sys.argv[1:]]),
        "config": {
            "world": args.world,
            "seeds": args.seeds,
            "gpt": {**_GPT, "steps": args.steps},
            "cnn": {**_CNN, "steps": args.cnn_steps},
            "bucket_cap_mb": _BUCKET_MB,
            "final_train": f"mean of the last {_LAST} steps",
            "optimizer": "ShardedOptimizer(torch.optim.AdamW, fused=True, weight_decay=0.01)",
        },
        "summary": _summarise({k: v for k, v in quality.items() if k in MODELS}),
        "bytes_vs_ddp": {
            f"world{args.world}": {
                name: {
                    w: statistics.fmean(
                        r["bytes_vs_ddp"] for r in quality[name]["runs"][w].values()
                    )
                    for w in WIRES
                }
                for name in MODELS
            },
            f"world{args.bytes_world}": {
                "cnn": {k: v for k, v in bytes_world.items() if k in WIRES}
            },
        },
        "step_time": timing,
        "quality": {k: v for k, v in quality.items() if k in MODELS},
        "wall_s": {
            "quality": quality["wall_s"],
            "bytes": bytes_world["wall_s"],
            "timing": timing["wall_s"],
            "total": time.perf_counter() - start,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        _plot(record, Path(args.plot))
    print(json.dumps({k: record[k] for k in ("summary", "bytes_vs_ddp", "wall_s")}, indent=1))
    t = timing
    print("step time vs DDP (measured):", {k: round(v, 3) for k, v in t["step_vs_ddp"].items()})
    for bw, m in t["modelled"].items():
        print(f"modelled {bw}:", {k: round(v, 3) for k, v in m["step_vs_ddp"].items()})
    print(f"wrote {args.out} and {args.plot} in {record['wall_s']['total']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
