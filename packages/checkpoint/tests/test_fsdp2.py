"""FSDP2 (``torch.distributed.fsdp.fully_shard``) state at world 2 on Gloo: saved as DTensor
shards with ``shardkit.checkpoint.save`` (and with plain ``dcp.save``), loaded back through the
checks and CRC-32s (and through ``SafeFileSystemReader``), training resumes bit for bit;
resharded to one process without FSDP; a crafted checkpoint is refused on every rank.

Tests in this module run in order: the save writes what the later loads read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ckpt_testkit import Evil, assert_same, pickled, train
from shardkit.checkpoint import SafeFileSystemReader, UnsafeCheckpointError, load, save, verify
from shardkit.testing import world
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 3))


def _fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _job(fsdp: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _fsdp(_model()) if fsdp else _model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp2")


@world(2, timeout=180)
def test_fsdp2_state_saves_and_resumes_bit_for_bit(root: Path) -> None:
    model, opt = _job()
    train(model, opt, 2)
    state = _state(model, opt, 2)
    assert type(state["model"]["0.weight"]).__name__ == "DTensor"
    save(state, root / "ckpt", record={"step": 2})
    dcp.save(state, checkpoint_id=str(root / "plain"))  # the same state, plain DCP
    full = {k: v.full_tensor() for k, v in state["model"].items()}  # collective
    if dist.get_rank() == 0:
        torch.save(full, root / "full-model.pt")
        assert verify(root / "ckpt").checksums == "storage"
    train(model, opt, 2, start=2)  # the uninterrupted run
    for path, through_reader in ((root / "ckpt", False), (root / "plain", True)):
        fresh, fresh_opt = _job()
        dest = _state(fresh, fresh_opt, 0)
        if through_reader:
            dcp.load(dest, storage_reader=SafeFileSystemReader(path))
        else:
            load(dest, path)
        assert dest["step"] == 2
        set_state_dict(
            fresh, fresh_opt, model_state_dict=dest["model"], optim_state_dict=dest["optim"]
        )
        assert_same(state["optim"]["param_groups"], dest["optim"]["param_groups"])
        train(fresh, fresh_opt, 2, start=2)
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor())


@world(1, timeout=180)
def test_fsdp2_checkpoint_resharded_to_one_process_without_fsdp(root: Path) -> None:
    """The world-2 DTensor shards into plain tensors of an unsharded model (DCP reshards;
    every chunk it reads is checked against its CRC-32)."""
    model, opt = _job(fsdp=False)
    dest = _state(model, opt, 0)
    load(dest, root / "ckpt")
    set_state_dict(model, opt, model_state_dict=dest["model"], optim_state_dict=dest["optim"])
    want = torch.load(root / "full-model.pt", weights_only=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


@world(2, timeout=180)
def test_crafted_fsdp2_checkpoint_is_refused_on_every_rank(root: Path, tmp_path: Path) -> None:
    """A __reduce__ payload in the metadata of a sharded checkpoint: every rank refuses it and
    nothing runs."""
    import shutil

    from shardkit.checkpoint._unpickle import restricted_loads

    marker = tmp_path / "pwned"
    case = tmp_path / "case"
    if dist.get_rank() == 0:
        shutil.copytree(root / "ckpt", case)
        version = case / (case / "LATEST").read_text().strip()
        md = restricted_loads((version / ".metadata").read_bytes(), "m")
        md.planner_data = {"x": Evil(str(marker))}
        (version / ".metadata").write_bytes(pickled(md))
    dist.barrier()
    model, opt = _job()
    with pytest.raises(UnsafeCheckpointError, match=r"'posix\.system' is not allowed"):
        load(_state(model, opt, 0), case)
    assert not marker.exists()
