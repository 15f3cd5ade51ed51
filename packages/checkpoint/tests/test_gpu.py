"""CUDA state: saved and loaded through shardkit.checkpoint (skipped with the reason where no GPU
is visible). CRC-32s are computed from the stored bytes, so CUDA tensors cost one device-to-host
copy, as DCP's own write does; the loaded tensors keep the destination's device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _ckpt_testkit import assert_same
from shardkit.checkpoint import load, save, verify
from shardkit.testing import rank_cuda_device, world
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@pytest.mark.cuda
def test_cuda_state_round_trips_in_one_process(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 32, device="cuda"), "b": torch.arange(7, device="cuda")}
    save(state, tmp_path / "ckpt")
    dest = {
        "w": torch.empty(64, 32, device="cuda"),
        "b": torch.empty(7, dtype=torch.int64, device="cuda"),
    }
    load(dest, tmp_path / "ckpt")
    assert dest["w"].device.type == "cuda"
    assert_same(state, dest)
    assert verify(tmp_path / "ckpt").checksums == "storage"


@pytest.mark.nccl
@world(1, backend="nccl")
def test_fsdp2_on_cuda_nccl(tmp_path: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    device = rank_cuda_device()

    def job() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = job()
    model(torch.randn(8, 16, device=device)).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    save({"model": msd, "optim": osd}, tmp_path / "ckpt")
    fresh, fresh_opt = job()
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    state = {"model": fmsd, "optim": fosd}
    load(state, tmp_path / "ckpt")
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    dist.barrier()
