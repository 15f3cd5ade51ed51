"""ShardedOptimizer inside the trainers people use: HF Accelerate and Lightning (DDP).

Each case runs this file as a script under ``torchrun --standalone --nproc-per-node 2`` on the
CPU (Gloo): the trainers bring their own launch and process-group set-up, which
``shardkit.testing.world`` would pre-empt. The script compares a resumed run with an
uninterrupted one bit for bit (same world size, data and reduction order) and prints ``OK``.
The tests skip where the trainer is not installed (the default hatch environment has neither;
docs/packages/optim.md has the recipes).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

_TRAINED, _MORE = 3, 3


def _run(case: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            case,
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "OK" in proc.stdout.split(), output[-6000:]


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install {module}; not in the default env)")


def test_accelerate_prepare_save_state_load_state(tmp_path: Path) -> None:
    _require("accelerate")
    _run("accelerate", tmp_path)


def test_lightning_ddp_train_and_resume(tmp_path: Path) -> None:
    _require("lightning")
    _run("lightning", tmp_path)


# ---------------------------------------------------------------- the scripts (rank processes)
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _accelerate_main(out: str) -> None:
    """prepare(model, ShardedOptimizer), train, save_state, train on (the uninterrupted run);
    a fresh pair prepared and restored with load_state takes the same steps."""
    from accelerate import Accelerator
    from shardkit.optim import ShardedOptimizer

    accelerator = Accelerator(cpu=True)

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    model = _mlp()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    model, opt = accelerator.prepare(model, opt)
    train(model, opt, range(_TRAINED))
    # safetensors would drop the params that share a flat buffer (it takes views of one
    # storage for tied weights): save with torch.save. See docs/packages/optim.md.
    accelerator.save_state(out, safe_serialization=False)
    train(model, opt, range(_TRAINED, _TRAINED + _MORE))
    want = [p.detach().clone() for p in model.parameters()]

    model2 = _mlp()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # other weights: load_state must overwrite them
    opt2 = ShardedOptimizer(model2.parameters(), torch.optim.AdamW, lr=0.5, weight_decay=0.0)
    accelerator = Accelerator(cpu=True)  # a new run: it registers only the restored objects
    model2, opt2 = accelerator.prepare(model2, opt2)
    accelerator.load_state(out)
    assert opt2.param_groups[0]["lr"] == 1e-2, opt2.param_groups[0]["lr"]
    train(model2, opt2, range(_TRAINED, _TRAINED + _MORE))
    for i, (a, b) in enumerate(zip(want, model2.parameters(), strict=True)):
        assert torch.equal(a, b.detach()), f"param {i} differs after load_state"
    dist.barrier()
    if accelerator.is_main_process:
        print("OK")


def _lightning_main(out: str) -> None:
    """Trainer(strategy="ddp") with a ShardedOptimizer: one epoch, save_checkpoint, resume a
    fresh module for a second epoch; equal to an uninterrupted two-epoch run."""
    import lightning as L
    from shardkit.optim import ShardedOptimizer
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> ShardedOptimizer:
            return ShardedOptimizer(self.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g))
    root = Path(out)

    def fit(module: Module, epochs: int, ckpt: Path | None = None) -> L.Trainer:
        trainer = L.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(module, DataLoader(data, batch_size=4, shuffle=False), ckpt_path=ckpt)
        return trainer

    straight = Module()
    fit(straight, 2)
    first = Module()
    fit(first, 1).save_checkpoint(root / "epoch1.ckpt")
    resumed = Module()
    fit(resumed, 2, root / "epoch1.ckpt")
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming"
    dist.barrier()
    if dist.get_rank() == 0:
        print("OK")


if __name__ == "__main__":
    {"accelerate": _accelerate_main, "lightning": _lightning_main}[sys.argv[1]](sys.argv[2])
