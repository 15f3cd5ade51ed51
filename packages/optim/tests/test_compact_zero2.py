"""``compact_state`` under ZeRO-2 (shardkit-ddp's ShardedDataParallel): block-aligned fragment
buckets ([Note: Block-aligned fragment buckets]) make every rank's piece of a compact param hold
whole blocks of the param's global flat index, so the run is bit for bit the plain optimizer
whose moments are requantized after each step (the reference, ``_compact_testkit.Reference``),
at world 2 and 3, through consolidation and sharded checkpoints read at another world size and
by ZeRO-1.

Every rank trains on the same full batch, so the averaged gradients are exact at any world size
and the sharded run equals the one-process reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _compact_testkit import J, K, Reference, equal, groups, loss, model, train
from _optim_testkit import save_run
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer, build_flat_buckets, load_sharded
from shardkit.optim._compact import CompactTensor, stores_compact
from shardkit.optim._flat import compact_block
from shardkit.testing import world

_CASES = [
    ("int8", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    ("int4", torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    ("int8", torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
]


def _wrap(m: torch.nn.Module, kind: str, cls: Any, masters: bool, **kw: Any) -> Any:
    opt = ShardedOptimizer(
        groups(m), cls, compact_state=kind,
        master_dtype=torch.float32 if masters else None, **kw,
    )  # fmt: skip
    # a small bucket cap: several buckets, the 8192-element weights alone in theirs
    return ShardedDataParallel(m, opt, reduce_buffer_size=6000), opt


def _pieces(opt: ShardedOptimizer) -> list[tuple[Any, Any]]:
    """(entry, state) of every tensor this rank's stepper holds."""
    stepper = opt.driver.stepper  # type: ignore[union-attr]
    local = stepper.local
    return [(e, local.state.get(e.opt, {}) if local else {}) for e in stepper.all_entries()]


def _check_layout(opt: ShardedOptimizer, kind: str) -> None:
    block = compact_block(kind)
    for b in opt.driver.buckets:  # type: ignore[union-attr]
        compact = [stores_compact(p.numel(), p.dtype) for p in b.params]
        if any(compact):
            assert b.shard % block == 0, (b.index, b.shard)
        for p, off, c in zip(b.params, b.offsets, compact, strict=True):
            assert not c or off % block == 0, (b.index, off)
    for e, state in _pieces(opt):
        big = e.param.numel() >= 4096
        assert e.lo % block == 0 or not big
        if state:  # compact is decided on the whole param, not on the piece
            assert isinstance(state["exp_avg"], CompactTensor) == big, (e.param.shape, e.lo)


def _average(m: torch.nn.Module) -> None:
    """The reference's gradients as the sharded run averages N equal ones: each times 1/N
    first, then summed (DDP's order; a sum of equal values does not depend on the order)."""
    n = dist.get_world_size()
    for p in m.parameters():
        if p.grad is not None:
            d = p.grad * (1.0 / n)
            total = d
            for _ in range(n - 1):
                total = total + d
            p.grad = total


def _step_both(ref: Reference, sdp: Any, opt: ShardedOptimizer, step: int) -> None:
    """One step of the reference (its grads averaged as the sharded run's) and of ``sdp``."""
    ref.model.zero_grad()
    loss(ref.model, step).backward()
    _average(ref.model)
    ref.step()
    opt.zero_grad()
    loss(sdp, step).backward()
    opt.step()


def _run(case: int, masters: bool) -> None:
    kind, cls, kw = _CASES[case]
    dtype = torch.bfloat16 if masters else torch.float32
    ref = Reference(model(dtype), cls, kind, **kw)
    m = model(dtype)
    sdp, opt = _wrap(m, kind, cls, masters, **kw)
    for step in range(4):
        _step_both(ref, sdp, opt, step)
    sdp.wait_params()
    _check_layout(opt, kind)
    # [Note: Fused steps of cut params]: torch's fused CPU kernel steps a tensor's vector body
    # and its scalar tail differently, so a small param cut at any element may differ in the
    # last bit; compact params are cut between blocks (multiples of the vector width): exact.
    exact = not kw.get("fused")
    sd = opt.state_dict(all_ranks=True)
    want = ref.opt.state_dict()
    for i, (a, b) in enumerate(zip(ref.model.parameters(), m.parameters(), strict=True)):
        big = stores_compact(a.numel(), a.dtype)
        what = f"ZeRO-2 {kind} world {dist.get_world_size()}, param {i}"
        if exact or big:
            assert torch.equal(a, b), what
            for k, v in want["state"][i].items():
                assert torch.equal(sd["state"][i][k], v), (what, k)
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=what)
            for k, v in want["state"][i].items():
                torch.testing.assert_close(sd["state"][i][k], v, rtol=1e-6, atol=0, msg=what)


@pytest.mark.parametrize("case", range(len(_CASES)))
@pytest.mark.parametrize("masters", [False, True])
@world(2)
def test_zero2_matches_the_plain_optimizer_on_requantized_moments(case: int, masters: bool) -> None:
    _run(case, masters)


@pytest.mark.parametrize("masters", [False, True])
@world(3)
def test_zero2_world3_cuts_params_between_blocks(masters: bool) -> None:
    _run(1, masters)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compact_zero2_ckpt")


@world(2)
def test_zero2_save_world2(ckpt_root: Path) -> None:
    m = model()
    sdp, opt = _wrap(m, "int8", torch.optim.AdamW, False, lr=1e-2)
    train(sdp, opt, K)
    sdp.wait_params()
    save_run(m, opt, ckpt_root / "w2")


def _resume(ckpt_root: Path, zero2: bool) -> None:
    ref = Reference(model(), torch.optim.AdamW, "int8", lr=1e-2)
    for step in range(K + J):  # grads averaged at world 2, then at this world size
        ref.model.zero_grad()
        loss(ref.model, step).backward()
        if step >= K:
            _average(ref.model)
        ref.step()
    m = model()
    m.load_state_dict(torch.load(ckpt_root / "w2.model.pt"))
    if zero2:
        sdp, opt = _wrap(m, "int8", torch.optim.AdamW, False, lr=1e-2)
        load_sharded(opt, ckpt_root / "w2")
        _check_layout(opt, "int8")
        train(sdp, opt, J, start=K)
        sdp.wait_params()
    else:
        opt = ShardedOptimizer(groups(m), torch.optim.AdamW, compact_state="int8", lr=1e-2)
        load_sharded(opt, ckpt_root / "w2")
        train(m, opt, J, start=K)
    equal(ref.model, m, f"ZeRO-2 world 2 -> {'ZeRO-2' if zero2 else 'ZeRO-1'} world "
          f"{dist.get_world_size()}")  # fmt: skip


@world(1)
def test_zero2_checkpoint_resumes_under_zero1_world1(ckpt_root: Path) -> None:
    _resume(ckpt_root, zero2=False)


@world(3)
def test_zero2_checkpoint_resumes_under_zero2_world3(ckpt_root: Path) -> None:
    _resume(ckpt_root, zero2=True)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 3, 255, 257, 4095, 4096, 5000, 6144, 9000]), min_size=1,
                   max_size=6),
    world_size=st.integers(1, 5),
    kind=st.sampled_from(["int8", "int4"]),
)  # fmt: skip
def test_every_cut_of_a_compact_param_falls_between_blocks(
    sizes: list[int], world_size: int, kind: str
) -> None:
    """Single process: whatever the shapes and world size, every rank's piece of a param that
    stores compact state starts on a block boundary of the param and ends on one or at its
    end; the other params keep the packed layout's order."""
    params = [torch.zeros(n, requires_grad=True) for n in sizes]
    buckets, prints = build_flat_buckets(
        [{"params": params}], [True], world_size, 1 << 20, 1 << 20, compact_state=kind
    )
    block = compact_block(kind)
    assert prints[0].endswith(f";compact={kind}/{block}")
    for b in buckets:
        covered = 0
        for r in range(world_size):
            for i, lo, hi in b.pieces(r):
                p, off = b.params[i], b.offsets[i]
                covered += hi - lo
                if stores_compact(p.numel(), p.dtype):
                    assert (lo - off) % block == 0
                    assert (hi - off) % block == 0 or hi - off == p.numel()
        assert covered == sum(p.numel() for p in b.params)
        ends = sorted((off, off + p.numel()) for off, p in zip(b.offsets, b.params, strict=True))
        assert all(a[1] <= c[0] for a, c in zip(ends, ends[1:], strict=False))  # no overlap
        assert ends[-1][1] <= b.numel


class _Branchy(torch.nn.Module):
    """A compact param (``side``, 8192 elements) that no rank uses on odd steps: it is not
    stepped then and keeps its own step count."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 512)
        self.b = torch.nn.Linear(512, 16)
        self.side = torch.nn.Linear(512, 16)
        self.head = torch.nn.Linear(16, 3)
        self.use_side = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        out = self.b(h) + (self.side(h) if self.use_side else 0)
        return self.head(torch.tanh(out))


@world(2)
def test_zero2_unused_params_keep_their_compact_state_and_step_count() -> None:
    ref = Reference(_Branchy(), torch.optim.AdamW, "int8", lr=1e-2, weight_decay=0.1)
    m = _Branchy()
    opt = ShardedOptimizer(groups(m), torch.optim.AdamW, compact_state="int8", lr=1e-2,
                           weight_decay=0.1)  # fmt: skip
    sdp = ShardedDataParallel(m, opt, reduce_buffer_size=6000)
    for step in range(5):
        ref.model.use_side = m.use_side = step % 2 == 0  # type: ignore[assignment]
        _step_both(ref, sdp, opt, step)
    sdp.wait_params()
    equal(ref.model, m, "unused compact param")
    sd = opt.state_dict(all_ranks=True)
    side = [i for i, (n, _) in enumerate(m.named_parameters()) if n == "side.weight"][0]
    assert int(sd["state"][side]["step"]) == 3  # steps 0, 2, 4
    for i, state in ref.opt.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
