"""Format-3 sharded checkpoints of compact state ([Note: Compact checkpoint items]): codes and
scales are stored as they are held (no fp32 moments on disk), and every reader gets what it
can hold: the same bits in a compact optimizer of the same kind at any world size, fp32
moments in a plain optimizer and in ``load_consolidated``, re-quantized values in another
kind; items that do not make a compact moment of their param are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _compact_testkit import J, K, Reference, equal, groups, model, train
from shardkit.checkpoint import UnsafeCheckpointError, open_checkpoint
from shardkit.optim import ShardedOptimizer, load_consolidated, load_sharded, save_sharded
from shardkit.optim._checkpoint import _compact_moment
from shardkit.optim._compact import CompactTensor, moment_formats, stores_compact
from shardkit.optim._load_checks import parse_key
from shardkit.testing import world
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compact_format3")


def _states(opt: ShardedOptimizer) -> dict[int, dict[str, object]]:
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return {index[id(p)]: st for p, st in opt.optim.state.items()}


@world(2)
def test_save_writes_codes_and_scales(ckpt_root: Path) -> None:
    m = model()
    opt = ShardedOptimizer(groups(m), torch.optim.AdamW, compact_state="int4", lr=1e-2)
    train(m, opt, K)
    save_sharded(opt, ckpt_root / "int4")
    mine = {
        i: {k: v.clone() for k, v in st.items() if isinstance(v, CompactTensor)}
        for i, st in _states(opt).items()
    }
    torch.save(mine, ckpt_root / f"int4.rank{dist.get_rank()}.pt")
    ck = open_checkpoint(ckpt_root / "int4")
    assert ck.record is not None and ck.record["format"] == "shardkit.optim.sharded/3"
    keys = ck.metadata.state_dict_metadata
    params = list(m.parameters())
    for i, p in enumerate(params):
        for k in ("exp_avg", "exp_avg_sq"):
            if stores_compact(p.numel(), p.dtype):  # codes: half a byte per element
                assert f"state/{i}/{k}" not in keys
                assert tuple(keys[f"compact/{i}/{k}/codes"].size) == ((p.numel() + 1) // 2,)
                assert keys[f"compact/{i}/{k}/scales"].properties.dtype == torch.float32
            else:
                assert f"state/{i}/{k}" in keys and f"compact/{i}/{k}/codes" not in keys
    dist.barrier()


@world(1)
def test_every_reader_gets_what_it_holds(ckpt_root: Path) -> None:
    saved: dict[int, dict[str, CompactTensor]] = {}
    for r in range(2):
        saved.update(torch.load(ckpt_root / f"int4.rank{r}.pt", weights_only=False))
    # the same kind: the same bits (world 2 -> 1)
    m = model()
    opt = ShardedOptimizer(groups(m), torch.optim.AdamW, compact_state="int4", lr=1e-2)
    load_sharded(opt, ckpt_root / "int4")
    got = _states(opt)
    assert any(saved.values())
    for i, moments in saved.items():
        for k, v in moments.items():
            have = got[i][k]
            assert isinstance(have, CompactTensor) and have.equal(v), (i, k)
    # a plain optimizer (compact_state=None), and load_consolidated: fp32 moments
    plain = ShardedOptimizer(groups(model()), torch.optim.AdamW, lr=1e-2)
    load_sharded(plain, ckpt_root / "int4")
    offline = load_consolidated(ckpt_root / "int4")
    torch.optim.AdamW(groups(model()), lr=1e-2).load_state_dict(offline)  # plain torch loads it
    for i, moments in saved.items():
        for k, v in moments.items():
            want = v.dequantize()
            assert torch.equal(_states(plain)[i][k], want), (i, k)  # type: ignore[arg-type]
            assert torch.equal(offline["state"][i][k], want), (i, k)
    # another kind: re-quantized from the values
    int8 = ShardedOptimizer(groups(model()), torch.optim.AdamW, compact_state="int8", lr=1e-2)
    load_sharded(int8, ckpt_root / "int4")
    first, second = moment_formats("int8")
    for i, moments in saved.items():
        for k, v in moments.items():
            fmt = first if k == "exp_avg" else second
            want8 = CompactTensor.from_tensor(v.dequantize(), fmt)
            have8 = _states(int8)[i][k]
            assert isinstance(have8, CompactTensor) and have8.equal(want8), (i, k)


def test_items_that_make_no_compact_moment_are_refused() -> None:
    """Single process: the assembly of a moment from its items checks every size and field
    (the load's own checks bound each item by its param already)."""
    assert parse_key("compact/3/exp_avg/codes") == ("compact", 3, "exp_avg/codes")
    assert parse_key("compact/3/exp_avg/other") is None
    assert parse_key("compact/3/codes") is None
    fmt = moment_formats("int8")[0]
    good = CompactTensor.from_tensor(torch.randn(300), fmt)
    record = {0: {"exp_avg": {"compact": {"map": fmt.map_name, "block": fmt.block}}}}
    items = {"codes": good.codes, "scales": good.scales}
    assert _compact_moment(0, "exp_avg", items, record, [(300,)]).equal(good)
    bad_cases = [
        ({"codes": good.codes}, record, [(300,)]),  # scales missing
        ({"codes": good.codes[:-1], "scales": good.scales}, record, [(300,)]),  # short codes
        (items, record, [(600,)]),  # another param's size
        (items, {0: {"exp_avg": {"compact": {"map": "nope", "block": 256}}}}, [(300,)]),
        (items, {0: {"exp_avg": {"compact": {"map": fmt.map_name, "block": 3}}}}, [(300,)]),
        (items, {0: {"exp_avg": 1.0}}, [(300,)]),  # no record
        (items, record, None),  # no shapes (no header)
    ]
    for got, rec, shapes in bad_cases:
        with pytest.raises(UnsafeCheckpointError, match="damaged or crafted"):
            _compact_moment(0, "exp_avg", got, rec, shapes)  # type: ignore[arg-type]


@world(2)
def test_dcp_state_dict_save_world2(ckpt_root: Path) -> None:
    """torch.distributed.checkpoint's own path (``get_state_dict`` + ``dcp.save``, as
    torchtitan and Accelerate do): the optimizer's dict carries fp32 moments."""
    m = model()
    opt = ShardedOptimizer(groups(m), torch.optim.AdamW, compact_state="int8", lr=1e-2)
    train(m, opt, K)
    msd, osd = get_state_dict(m, optimizers=opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt_root / "dcp"))


@world(3)
def test_dcp_state_dict_resumes_at_world3_bit_for_bit(ckpt_root: Path) -> None:
    ref = Reference(model(), torch.optim.AdamW, "int8", lr=1e-2)
    train(ref.model, ref, K + J)
    m = model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()  # the checkpoint must restore every weight
    opt = ShardedOptimizer(groups(m), torch.optim.AdamW, compact_state="int8", lr=1e-2)
    msd, osd = get_state_dict(m, optimizers=opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(ckpt_root / "dcp"))
    set_state_dict(m, optimizers=opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert all(
        isinstance(st["exp_avg"], CompactTensor) == (p.numel() >= 4096)
        for p, st in opt.optim.state.items()
    )
    train(m, opt, J, start=K)
    equal(ref.model, m, "DCP state dict, world 2 -> 3")
