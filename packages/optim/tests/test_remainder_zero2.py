"""``master_remainder=True`` under ZeRO-2 (shardkit-ddp's ShardedDataParallel): [Note: Remainder
masters under ZeRO-2]. The reference is the same run with fp32 masters: masters, moments and
every update bit for bit, params equal to the masters' nearest-ties-away rounding
(``split_master``), at world 2 and 3 (params cut between ranks), with compact moments too,
through state dicts, writes outside the optimizer and the params' gathers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _compact_testkit import groups, loss, model
from shardkit.ddp import ShardedDataParallel
from shardkit.optim import ShardedOptimizer
from shardkit.optim._compact import CompactTensor
from shardkit.optim._remainder import split_master
from shardkit.testing import world


def _run(
    remainder: bool, cap: int | None = 6000, **kw: Any
) -> tuple[torch.nn.Module, Any, ShardedOptimizer]:
    m = model(torch.bfloat16)
    opt = ShardedOptimizer(
        groups(m), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
        master_dtype=torch.float32, master_remainder=remainder, **kw,
    )  # fmt: skip
    return m, ShardedDataParallel(m, opt, reduce_buffer_size=cap), opt


def _compare(a: tuple[Any, Any, ShardedOptimizer], b: tuple[Any, Any, ShardedOptimizer]) -> None:
    """``a`` (fp32 masters) and ``b`` (remainders): masters and state bit for bit, params the
    masters' split rounding."""
    for _, sdp, _ in (a, b):
        sdp.wait_params()
    sa, sb = a[2].state_dict(all_ranks=True), b[2].state_dict(all_ranks=True)
    for i, m in sa["master_params"].items():
        assert torch.equal(sb["master_params"][i], m), f"master {i}"
        p = list(b[0].parameters())[i]
        assert torch.equal(p, split_master(m.float())[0].view(p.shape)), f"param {i}"
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(sb["state"][i][k], v), (i, k)


def _steps(runs: list[tuple[Any, Any, ShardedOptimizer]], start: int, n: int) -> None:
    """``n`` steps of both runs, compared after each; then the fp32-master run continues from
    the remainder run's exact state (its params differ at exact ties, 2**-16 of the elements,
    where a next forward would see other weights)."""
    a, b = runs
    for step in range(start, start + n):
        for _, sdp, opt in runs:
            opt.zero_grad()
            loss(sdp, step).backward()
            opt.clip_grad_norm(0.5)
            opt.step()
        _compare(a, b)
        a[0].load_state_dict(b[0].state_dict())
        a[2].load_state_dict(b[2].state_dict(all_ranks=True))


@pytest.mark.parametrize(("compact", "cap"), [(None, 6000), ("int8", 6000), ("int8", None)])
@world(2)
def test_zero2_remainders_step_as_fp32_masters(compact: str | None, cap: int | None) -> None:
    """``cap=None``: one bucket per group, stepped in parts (the joined masters beside the
    gradients would need twice the scratch of fp32 masters in one go)."""
    a, b = _run(False, cap, compact_state=compact), _run(True, cap, compact_state=compact)
    if cap is None:
        stepper = b[2].driver.stepper  # type: ignore[union-attr]
        entries = [e for e in stepper.all_entries() if e.remainder is not None]
        assert len(stepper._sub_chunks(entries)) > 1
        fp32 = a[2].driver.stepper.scratch_bytes()  # type: ignore[union-attr]
        largest = max(8 * e.tensor.numel() for e in entries)  # gradient + joined master
        assert stepper.scratch_bytes() == max(fp32, largest)
    _steps([a, b], 0, 4)
    stepper = b[2].driver.stepper  # type: ignore[union-attr]
    entries = [e for e in stepper.all_entries() if e.tensor.dtype == torch.bfloat16]
    assert entries and all(e.remainder is not None for e in entries)
    # 2 bytes per bf16 element instead of an fp32 master's 4
    held = stepper.state_bytes() - a[2].driver.stepper.state_bytes()  # type: ignore[union-attr]
    assert held == -2 * sum(e.tensor.numel() for e in entries)
    if compact:
        st = stepper.local.state[entries[0].opt]
        assert isinstance(st["exp_avg"], CompactTensor) == (entries[0].param.numel() >= 4096)


@world(3)
def test_zero2_remainders_world3_writes_and_reloads() -> None:
    a, b = _run(False), _run(True)
    _steps([a, b], 0, 2)
    # a write outside the optimizer after a step, while the gathers are in flight: both
    # masters start from the written values
    for m, _, _ in (a, b):
        with torch.no_grad():
            next(m.parameters()).mul_(0.5)
    _steps([a, b], 2, 2)
    # a reload of the fp32-master run's dict into the remainder run: exact
    sd = a[2].state_dict(all_ranks=True)
    b[2].load_state_dict(sd)
    with torch.no_grad():
        for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
            pb.copy_(pa)
    b[2].load_state_dict(sd)  # after the weights: the masters split from the dict again
    _steps([a, b], 4, 2)
    assert dist.get_world_size() == 3


@pytest.mark.parametrize("elementwise", [True, False])
@world(2)
def test_zero2_remainders_survive_the_param_gathers(elementwise: bool) -> None:
    """Several steps with no load in between (a load records every version counter): the
    gathers write the params after each step, and the remainders must outlive that (the driver
    records the counters when it waits for a gather). A small model, so that no element hits an
    exact tie in these steps (seeded: checked, not assumed) and both runs see the same
    weights. Whole-param buckets (``elementwise=False``) step the params themselves.
    """

    def small(remainder: bool) -> tuple[torch.nn.Module, Any, ShardedOptimizer]:
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
        m = m.to(torch.bfloat16)
        opt = ShardedOptimizer(
            m.parameters(), torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32,
            master_remainder=remainder,
        )  # fmt: skip
        sdp = ShardedDataParallel(m, opt, reduce_buffer_size=100, elementwise=elementwise)
        return m, sdp, opt

    a, b = small(False), small(True)
    for step in range(4):
        for m, sdp, opt in (a, b):
            opt.zero_grad()
            loss(sdp, step).backward()
            opt.step()
        for m, _, _ in (a, b):  # the next forward waits for the gathers, as training does
            m(torch.zeros(1, 16, dtype=torch.bfloat16))
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(pa, pb), "a tie: pick another seed"
    _compare(a, b)
    rem = [e.remainder for e in b[2].driver.stepper.all_entries()]  # type: ignore[union-attr]
    assert any(bool(r.any()) for r in rem if r is not None)
