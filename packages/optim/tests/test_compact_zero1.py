"""``compact_state`` under ZeRO-1 ([Note: Compact state under ZeRO-1]): bit for bit a plain
torch optimizer whose moments are requantized after each step (the reference), through
consolidation, sharded checkpoints at another world size, repartition and the overlap hook.

Every rank trains on the same full batch, so the sharded run equals the one-process reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _compact_testkit import J as _J
from _compact_testkit import K as _K
from _compact_testkit import Reference as _Reference
from _compact_testkit import equal as _equal
from _compact_testkit import groups as _groups
from _compact_testkit import loss as _loss
from _compact_testkit import model as _model
from _compact_testkit import train as _train
from _optim_testkit import save_run
from shardkit.optim import ShardedOptimizer, load_sharded
from shardkit.optim._compact import CompactTensor
from shardkit.testing import world

_CASES = [
    ("int8", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    ("int4", torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    ("int8", torch.optim.Adam, {"lr": 1e-2, "foreach": True, "maximize": True}),
]


@pytest.mark.parametrize("case", range(len(_CASES)))
@pytest.mark.parametrize("masters", [False, True])
@world(2)
def test_matches_the_plain_optimizer_on_requantized_moments(case: int, masters: bool) -> None:
    kind, cls, kw = _CASES[case]
    dtype = torch.bfloat16 if masters else torch.float32
    ref = _Reference(_model(dtype), cls, kind, **kw)
    model = _model(dtype)
    opt = ShardedOptimizer(
        _groups(model), cls, compact_state=kind,
        master_dtype=torch.float32 if masters else None, **kw,
    )  # fmt: skip
    for step in range(4):
        for m, o in ((ref.model, ref), (model, opt)):
            m.zero_grad()
            _loss(m, step).backward()
            o.step()
        _equal(ref.model, model, f"step {step}")
    # compact where the param is large (decided on its whole size), fp32 elsewhere
    kinds = {tuple(v.shape): type(st["exp_avg"]).__name__ for v, st in opt.optim.state.items()}
    for shape, name in kinds.items():
        big = torch.Size(shape).numel() >= 4096
        assert name == ("CompactTensor" if big else "Tensor"), (shape, name)
    # the consolidated dict has fp32 moments: the reference's, and a plain torch optimizer loads it
    sd = opt.state_dict(all_ranks=True)
    want = ref.opt.state_dict()
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)
    plain = cls([{"params": list(g["params"]), "lr": g["lr"]} for g in ref.opt.param_groups], **kw)
    plain.load_state_dict(sd)


@world(2)
def test_state_bytes_and_a_repartition_keep_the_codes() -> None:
    ref = _Reference(_model(), torch.optim.AdamW, "int8", lr=1e-2)
    model = _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, compact_state="int8", lr=1e-2)
    _train(ref.model, ref, 2)
    _train(model, opt, 2)
    codes = {
        id(p): st["exp_avg"].codes.clone()
        for p, st in opt.optim.state.items()
        if isinstance(st["exp_avg"], CompactTensor)
    }
    big = [p for p in opt.owned_params if p.numel() >= 4096]
    for p in big:  # 1 byte per element and one fp32 scale per 256 for each moment
        st = opt.optim.state[p]
        nbytes = sum(m.nbytes for m in (st["exp_avg"], st["exp_avg_sq"]))
        assert nbytes == 2 * (p.numel() + 4 * (p.numel() // 256))
    # moving every param to rank 0 and back is exact (fp32 on the wire, the same codes after)
    n = len(opt.shard_layout.params)
    opt.set_partition([0] * n)
    opt.set_partition([i % 2 for i in range(n)])
    for p, st in opt.optim.state.items():
        if id(p) in codes:
            assert torch.equal(st["exp_avg"].codes, codes[id(p)])
    _train(ref.model, ref, 2, start=2)
    _train(model, opt, 2, start=2)
    _equal(ref.model, model, "after the repartition")


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compact_ckpt")


@world(2)
def test_save_world2(ckpt_root: Path) -> None:
    model = _model()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, compact_state="int4", lr=1e-2)
    _train(model, opt, _K)
    save_run(model, opt, ckpt_root / "w2")


@world(1)
def test_load_2_to_1_continues_bit_for_bit(ckpt_root: Path) -> None:
    _resume(ckpt_root)


@world(3)
def test_load_2_to_3_continues_bit_for_bit(ckpt_root: Path) -> None:
    _resume(ckpt_root)


def _resume(ckpt_root: Path) -> None:
    n = dist.get_world_size()
    ref = _Reference(_model(), torch.optim.AdamW, "int4", lr=1e-2)
    _train(ref.model, ref, _K + _J)
    model = _model()
    model.load_state_dict(torch.load(ckpt_root / "w2.model.pt"))
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, compact_state="int4", lr=1e-2)
    load_sharded(opt, ckpt_root / "w2")
    assert all(
        isinstance(st["exp_avg"], CompactTensor) == (p.numel() >= 4096)
        for p, st in opt.optim.state.items()
    )
    _train(model, opt, _J, start=_K)
    _equal(ref.model, model, f"2 -> {n}")


@world(2)
def test_misuse_is_refused_clearly() -> None:
    model = _model()
    with pytest.raises(TypeError, match="needs optim=torch.optim.Adam or torch.optim.AdamW"):
        ShardedOptimizer(model.parameters(), torch.optim.SGD, compact_state="int8", lr=0.1)
    with pytest.raises(ValueError, match="compact_state must be None, 'int8' or 'int4'"):
        ShardedOptimizer(model.parameters(), torch.optim.Adam, compact_state="fp8")
    low = _model(torch.bfloat16)
    with pytest.raises(ValueError, match="master_dtype=torch.float32"):
        ShardedOptimizer(low.parameters(), torch.optim.Adam, compact_state="int8")
    with pytest.raises(ValueError, match="capturable=True"):
        ShardedOptimizer(
            model.parameters(), torch.optim.Adam, compact_state="int8", capturable=True
        )


@world(2)
def test_the_overlap_hook_steps_compact_state_bit_for_bit() -> None:
    """shardkit-overlap steps the shard bucket by bucket inside backward through the same
    wrapped optimizer (``step_local``): the same result as the reference."""
    from shardkit.overlap import register_zero_overlap
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = _Reference(_model(), torch.optim.AdamW, "int8", lr=1e-2, weight_decay=0.1)
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets: several local steps per backward
    opt = ShardedOptimizer(
        _groups(model), torch.optim.AdamW, compact_state="int8", lr=1e-2, weight_decay=0.1
    )
    register_zero_overlap(ddp, opt)
    for step in range(4):
        ref.model.zero_grad()
        _loss(ref.model, step).backward()
        ref.step()
        opt.zero_grad()
        _loss(ddp, step).backward()  # same batch on every rank: the averaged grads are exact
        opt.step()
    _equal(ref.model, model, "overlap hook")
    assert any(isinstance(st["exp_avg"], CompactTensor) for st in opt.optim.state.values())
