"""Quantized collectives (``ShardedDataParallel(wire="int8" / "int4")``): the whole step against
a pure torch reference bit for bit, replicas identical on every rank after every step, and
everything else the wrapper does (accumulation, unused params, clipping, masters, compact
state, writes between steps, state dicts) with a quantized wire. See [Note: Quantized
reduce-scatter] and [Note: Weight deltas] in ``shardkit.optim._wire``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardkit.ddp import WIRE_FORMATS, BlockFormat, ShardedDataParallel
from shardkit.optim import ShardedOptimizer, load_sharded, save_sharded
from shardkit.testing import world
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

_WIRES = ["int8", "int4"]


def _rt(fmt: BlockFormat, x: torch.Tensor) -> torch.Tensor:
    """``x`` encoded and decoded: the codec itself (shardkit-optim's ``tests/test_codecs.py``
    checks it bit for bit against a plain torch reference); what this file checks is the step
    built around it."""
    enc = torch.empty(fmt.nbytes(x.numel()), dtype=torch.uint8)
    fmt.encode(x, enc)
    out = torch.empty(x.numel())
    fmt.decode(enc, out)
    return out


def _batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)


def _flat_everywhere(model: nn.Module) -> list[torch.Tensor]:
    """Every rank's params, flattened (after the gathers: ``state_dict`` waits)."""
    flat = torch.cat([v.reshape(-1).float() for v in model.state_dict().values()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


@pytest.mark.parametrize("wire", _WIRES)
@world(2)
def test_the_quantized_step_is_the_reference_bit_for_bit(wire: str) -> None:
    """One param, one bucket, SGD: the reduced gradient is each rank's own chunk exact plus
    the others' decoded chunks, summed in fp32 in rank order; the owner's master steps; the
    replica adds the decoded difference. A plain torch model of that (with the codec) gives the
    same bits."""
    fmt = WIRE_FORMATS[wire]
    world_size, lr = dist.get_world_size(), 0.5
    torch.manual_seed(0)
    m = nn.Linear(64, 32, bias=False)
    ref = copy.deepcopy(m)
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=lr)
    sdp = ShardedDataParallel(m, opt, wire=wire)
    n = ref.weight.numel()
    s = n // world_size
    replica = ref.weight.detach().reshape(-1).clone()
    masters = [replica[r * s : (r + 1) * s].clone() for r in range(world_size)]
    for step in range(3):
        grads = []
        for r in range(world_size):  # every rank's local gradient, times 1/N as staged
            ref.zero_grad()
            x, y = _batch(step, r)
            nn.functional.mse_loss(ref(x), y).backward()
            grads.append(torch.mul(ref.weight.grad.reshape(-1), 1.0 / world_size))
        for r in range(world_size):
            acc = torch.empty(0)
            for j in range(world_size):
                c = grads[j][r * s : (r + 1) * s]
                v = c if j == r else _rt(fmt, c)
                acc = v.clone() if j == 0 else acc + v
            masters[r].add_(acc, alpha=-lr)
            delta = masters[r] - replica[r * s : (r + 1) * s]
            replica[r * s : (r + 1) * s] += _rt(fmt, delta)
        with torch.no_grad():
            ref.weight.copy_(replica.view_as(ref.weight))
        opt.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(sdp(x), y).backward()
        opt.step()
        got = m.state_dict()["weight"]
        assert torch.equal(got, ref.weight), (got - ref.weight).abs().max()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 32))  # fmt: skip


def _loss(model: nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    x, y = _batch(micro)  # the same batches every step: the loss falls
    return nn.functional.mse_loss(model(x).float(), y)


def _train(model: nn.Module, opt: Any, steps: int, *, accumulate: int = 1, clip: bool = False,
           check: bool = True) -> list[float]:  # fmt: skip
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate - 1):
            with model.no_sync():
                _loss(model, step, micro).backward()
        loss = _loss(model, step, accumulate - 1)
        loss.backward()
        if clip:
            if isinstance(opt, ShardedOptimizer):
                opt.clip_grad_norm(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
        if check and isinstance(model, ShardedDataParallel):
            flats = _flat_everywhere(model)
            assert all(torch.equal(flats[0], f) for f in flats), f"replicas differ at {step}"
    return losses


@pytest.mark.parametrize("wire", _WIRES)
@pytest.mark.parametrize("mode", ["plain", "accumulate", "clip"])
@world(2)
def test_replicas_stay_identical_and_track_ddp(wire: str, mode: str) -> None:
    """Bit-identical replicas after every step; the loss curve within a few percent of DDP's
    (AdamW, 12 steps)."""
    kw = {"accumulate": 2} if mode == "accumulate" else {"clip": mode == "clip"}
    ref_m = _model()
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    want = _train(DDP(ref_m), ref_opt, 12, **kw)
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    got = _train(ShardedDataParallel(m, opt, wire=wire, bucket_cap_mb=0.02), opt, 12, **kw)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert got[-1] == pytest.approx(want[-1], rel=0.05 if wire == "int8" else 0.15)
    assert got[-1] < 0.8 * got[0]


@world(2)
def test_quantized_gradients_with_exact_params_and_the_reverse() -> None:
    """Per-direction wires: each one alone also keeps the replicas identical; exact params
    under quantized gradients need no masters. Stochastic rounding (a ``BlockFormat``) too: the
    owner draws, every rank decodes the same codes."""
    stochastic = BlockFormat(8, 128, stochastic=True)
    wires: list[tuple[Any, Any]] = [("int8", "exact"), ("exact", "int4"), (stochastic, None)]
    for wire, params in wires:
        m = _model()
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
        sdp = ShardedDataParallel(m, opt, wire=wire, wire_params=params, bucket_cap_mb=0.02)
        losses = _train(sdp, opt, 6)
        assert losses[-1] < losses[0]
        assert ("master_params" in opt.state_dict()) == (params != "exact")
        if wire is stochastic:
            assert sdp.comm_stats.calls["reduce_scatter"] > 0


@world(2)
def test_unused_params_and_bf16_masters_and_compact_state() -> None:
    """A branch no rank uses keeps its values; a bf16 model with fp32 masters and int8
    moments trains with an int8 wire, replicas identical."""
    torch.manual_seed(0)
    m = nn.ModuleDict({"used": nn.Linear(64, 32), "unused": nn.Linear(64, 32)}).to(torch.bfloat16)
    before = m["unused"].weight.detach().clone()
    opt = ShardedOptimizer(
        m.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32,
        compact_state="int8",
    )  # fmt: skip
    sdp = ShardedDataParallel(m, opt, wire="int8", bucket_cap_mb=0.01)
    for step in range(4):
        opt.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(sdp.module["used"](x.bfloat16()).float(), y).backward()
        opt.step()
        flats = _flat_everywhere(m)
        assert all(torch.equal(flats[0], f) for f in flats)
    assert torch.equal(m.state_dict()["unused.weight"], before)


@pytest.mark.parametrize("wire", _WIRES)
@world(2)
def test_a_write_between_steps_reaches_the_master(wire: str) -> None:
    """A user's in-place write to the params between steps is what the next step starts from:
    with a zero learning rate the written values stay exactly (the next delta does not revert
    them to the old master)."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(m, opt, wire=wire)
    _train(sdp, opt, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    written = {k: v.clone() for k, v in m.state_dict().items()}
    for group in opt.param_groups:
        group["lr"] = 0.0
    _train(sdp, opt, 1)
    for k, v in m.state_dict().items():
        assert torch.equal(v, written[k]), k


@world(2)
def test_resume_from_state_dicts_continues_bit_for_bit() -> None:
    """The model's state dict holds the replicas, the optimizer's the masters: a fresh wrapper
    loaded from both continues exactly as the run that saved them."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire="int8")
    _train(sdp, opt, 3)
    model_sd = copy.deepcopy(m.state_dict())
    opt_sd = opt.state_dict()
    assert set(opt_sd["master_params"]) == set(range(len(list(m.parameters()))))
    _train(sdp, opt, 2, check=False)
    want = m.state_dict()
    m2 = _model()
    m2.load_state_dict(model_sd)
    opt2 = ShardedOptimizer(m2.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp2 = ShardedDataParallel(m2, opt2, wire="int8")
    opt2.load_state_dict(opt_sd)
    _train(sdp2, opt2, 2, check=False)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[k]), k


@world(2)
def test_counted_bytes_per_param() -> None:
    """int8 + int8 moves 0.254x, int4 + int4 0.141x DDP's fp32 all-reduce (payload and
    scales, ring model) per param per step."""
    ratios = {}
    for wire in ("exact", "int8", "int4"):
        m = _model()
        opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
        sdp = ShardedDataParallel(m, opt, wire=wire)
        sdp.comm_stats.reset()
        _train(sdp, opt, 2, check=False)
        stats = sdp.comm_stats
        moved = stats.bytes["reduce_scatter"] + stats.bytes["all_gather"]
        numel = sum(p.numel() for p in m.parameters())
        ddp = 2 * (dist.get_world_size() - 1) / dist.get_world_size() * 4 * numel
        ratios[wire] = moved / 2 / ddp
        if wire != "exact":
            assert stats.scale_bytes["reduce_scatter"] > 0
            assert sum(v for (k, _), v in stats.bucket_bytes.items() if k == "all_gather") == (
                pytest.approx(stats.bytes["all_gather"])
            )
    assert ratios["exact"] == pytest.approx(1.0, rel=0.02)  # bucket padding
    assert ratios["int8"] <= 0.3
    assert ratios["int4"] <= 0.16


@world(2)
def test_bad_wires_raise() -> None:
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="not a wire format"):
        ShardedDataParallel(m, opt, wire="int3")
    with pytest.raises(TypeError, match="wire_params must be"):
        ShardedDataParallel(m, opt, wire_params=8)
    with pytest.raises(ValueError, match="do not compose"):
        ShardedDataParallel(m, opt, wire="int8", reduce_dtype=torch.bfloat16)
    m16 = _model().to(torch.bfloat16)
    opt16 = ShardedOptimizer(
        m16.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32,
        master_remainder=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="master_remainder=False"):
        ShardedDataParallel(m16, opt16, wire="int8")


@pytest.mark.parametrize("wire", _WIRES)
@world(2)
def test_grad_scaler_skips_an_overflow_sent_quantized(wire: str) -> None:
    """An inf in one rank's gradient makes its block decode to NaN on the owner: every rank
    skips that step (params unchanged, scale backed off); the other steps are taken."""
    from shardkit.optim import ShardedGradScaler

    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire=wire)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=100, group=opt.group)
    bad = 2
    for step in range(4):
        hook = None
        if step == bad and dist.get_rank() == 1:

            def poison(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g[0, 0] = float("inf")
                return g

            hook = m[2].weight.register_hook(poison)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        scale = scaler.get_scale()
        opt.zero_grad()
        scaler.scale(_loss(sdp, step)).backward()
        scaler.step(opt)
        scaler.update()
        if hook is not None:
            hook.remove()
        after = m.state_dict()
        changed = any(not torch.equal(after[k], v) for k, v in before.items())
        assert changed == (step != bad), step
        assert (scaler.get_scale() < scale) == (step == bad), step
        flats = _flat_everywhere(m)
        assert all(torch.equal(flats[0], f) for f in flats)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wire_ckpt")


@world(2)
def test_save_at_world2(ckpt_root: Path) -> None:
    """int8 wire at world 2: the model's replicas (``state_dict``) and the optimizer's masters
    and state (``save_sharded``), for the world-3 resume below."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire="int8")
    _train(sdp, opt, 3)
    full = opt.state_dict(all_ranks=True)
    if dist.get_rank() == 0:
        torch.save(m.state_dict(), ckpt_root / "model.pt")
        torch.save(full["master_params"], ckpt_root / "masters.pt")
    save_sharded(opt, ckpt_root / "opt")


@world(3)
def test_resume_at_world3_restores_replicas_and_masters(ckpt_root: Path) -> None:
    """N -> M: the replicas and the exact masters come back as saved, and training goes on
    with identical replicas."""
    m = _model()
    m.load_state_dict(torch.load(ckpt_root / "model.pt"))
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire="int8")
    load_sharded(opt, ckpt_root / "opt")
    saved = torch.load(ckpt_root / "masters.pt")
    got = opt.state_dict(all_ranks=True)["master_params"]
    assert set(got) == set(saved)
    for i, v in saved.items():
        assert torch.equal(got[i], v), i
    want = torch.load(ckpt_root / "model.pt")
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k
    losses = _train(sdp, opt, 4)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "options",
    [
        {"overlap_param_gather": False},
        {"keep_staging_buffers": False},
        {"gradient_as_bucket_view": True},
        {"elementwise": False},
    ],
    ids=lambda o: next(iter(o)),
)
@world(2)
def test_every_option_with_a_quantized_wire(options: dict[str, Any]) -> None:
    """The wrapper's options compose with ``wire="int8"``: replicas identical after every step
    and the loss falling (``elementwise=False``: whole params per owner)."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire="int8", bucket_cap_mb=0.02, **options)
    losses = _train(sdp, opt, 6)
    assert losses[-1] < losses[0]


@world(2)
def test_refresh_trainable_with_a_quantized_wire() -> None:
    """Freezing a layer mid-training rebuilds the layout: the replicas stay identical, the
    frozen layer keeps its values, training goes on."""
    m = _model()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire="int8", bucket_cap_mb=0.02)
    _train(sdp, opt, 3)
    before = opt.state_dict(all_ranks=True)["master_params"]
    m[0].requires_grad_(False)
    sdp.refresh_trainable()
    after = opt.state_dict(all_ranks=True)["master_params"]
    for i in range(2, len(before)):  # the exact masters of the params that stay trainable
        assert torch.equal(after[i], before[i]), i
    frozen = m.state_dict()["0.weight"].clone()
    losses = _train(sdp, opt, 3)
    assert torch.equal(m.state_dict()["0.weight"], frozen)
    assert losses[-1] < losses[0]
    m[0].requires_grad_(True)
    _train(sdp, opt, 2)
    assert not torch.equal(m.state_dict()["0.weight"], frozen)


@world(2)
def test_two_optimizers_with_a_quantized_wire() -> None:
    """fairscale's ``ShardedDataParallel(model, [opt1, opt2])`` with ``wire="int4"``: each
    optimizer steps and gathers its own params, replicas identical."""
    m = _model()
    first = [p for n, p in m.named_parameters() if n.startswith("0.")]
    rest = [p for n, p in m.named_parameters() if not n.startswith("0.")]
    o1 = ShardedOptimizer(first, optim=torch.optim.AdamW, lr=1e-2)
    o2 = ShardedOptimizer(rest, optim=torch.optim.SGD, lr=1e-2, momentum=0.9)
    sdp = ShardedDataParallel(m, [o1, o2], wire="int4")
    for step in range(4):
        o1.zero_grad()
        o2.zero_grad()
        _loss(sdp, step).backward()
        o1.step()
        o2.step()
        flats = _flat_everywhere(m)
        assert all(torch.equal(flats[0], f) for f in flats)


class _EdgeShapes(nn.Module):
    """Params where sharding breaks: a scalar, one element, an empty one, fewer elements than
    ranks, and an odd count (int4 pairs), beside a layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scalar = nn.Parameter(torch.tensor(0.5))
        self.one = nn.Parameter(torch.randn(1))
        self.empty = nn.Parameter(torch.randn(0, 3))
        self.few = nn.Parameter(torch.randn(1, 1))
        self.odd = nn.Parameter(torch.randn(7, 3))
        self.layer = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x) * self.scalar + self.one + self.few + self.empty.sum()
        return y + self.odd.sum() * 1e-2


@pytest.mark.parametrize("wire", _WIRES)
@pytest.mark.parametrize("cap", [0.0001, 25.0], ids=["bucket_per_param", "one_bucket"])
@world(3)
def test_edge_shapes_at_world3(wire: str, cap: float) -> None:
    """Every edge shape with a quantized wire at world 3 (chunks of padded buckets, blocks
    cut by the shards): replicas identical after every step, the loss falling."""
    m = _EdgeShapes()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(m, opt, wire=wire, bucket_cap_mb=cap)
    losses = _train(sdp, opt, 6)
    assert losses[-1] < losses[0]


def _edge_batch(step: int, k: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * step + 10 * k + rank))


@pytest.mark.parametrize("backwards", [1, 2], ids=["one_backward", "two_synced_backwards"])
@world(3)
def test_exact_wire_edge_shapes_at_world3_match_the_averaged_reference(backwards: int) -> None:
    """The exact Gloo reduce-scatter receives the first peer's chunk into the grad shard, or,
    when the shard holds an unconsumed gradient (a second synchronised backward), into the
    pool ([Note: Gloo reduce-scatter point to point] in shardkit.optim._wire): every edge
    shape in a bucket of its own (empty shards included), against a plain AdamW on the
    averaged gradients (1e-6: the reference sums in another order)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    m, ref = _EdgeShapes(), _EdgeShapes()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sdp = ShardedDataParallel(m, opt, bucket_cap_mb=0.0001)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in range(backwards):
            sdp(_edge_batch(step, k, rank)).square().mean().backward()
            for r in range(world_size):
                (ref(_edge_batch(step, k, r)).square().mean() / world_size).backward()
        opt.step()
        ref_opt.step()
    sdp.wait_params()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Empty(nn.Module):
    """A model whose only param is empty: its bucket's shards hold no element."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() * 0 + self.p.sum()


@world(3)
def test_exact_wire_reduces_an_empty_bucket() -> None:
    """A bucket of no element: the peers' (empty) chunks still pair up, nothing is received."""
    m = _Empty()
    opt = ShardedOptimizer(m.parameters(), optim=torch.optim.Adam, lr=1e-2)
    sdp = ShardedDataParallel(m, opt)
    for step in range(2):
        opt.zero_grad()
        sdp(_edge_batch(step, 0, dist.get_rank())).backward()
        opt.step()
    sdp.wait_params()
    assert m.p.shape == (0,)
