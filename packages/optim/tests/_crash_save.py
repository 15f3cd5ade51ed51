"""Run by test_checkpoint_reliability in a subprocess: train, save, and die at a commit step.

Usage: python _crash_save.py PATH STEPS CRASH_AT STORE
Trains the test model STEPS steps (world 1, Gloo), then saves to PATH; with CRASH_AT other
than "none" the process exits with status 17 (no cleanup, no atexit) at that point of the save.
"""

from __future__ import annotations

import os
import sys

import shardkit.checkpoint._commit as _commit
import torch
import torch.distributed as dist
from _optim_testkit import train
from shardkit.optim import ShardedOptimizer, save_sharded
from torch import nn


def main() -> None:
    path, steps, crash_at, store = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    train(model, opt, steps, batch=6)

    def die(name: str) -> None:
        if name == crash_at:
            os._exit(17)

    _commit.crash_point = die  # the save calls it through the module at every step
    save_sharded(opt, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
