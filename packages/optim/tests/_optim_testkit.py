"""Training and comparison helpers shared by shardkit-optim's state and checkpoint tests."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer, save_sharded
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveStorages", "assert_state_equal", "save_run", "train"]


def train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0, batch: int = 8
) -> None:
    """Run ``steps`` MSE steps of ``model`` (Linear in, Linear out) on seeded batches.

    Step ``s`` draws its batch from a generator seeded with ``s``, so a run resumed at ``start``
    sees the same data as an uninterrupted one.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    n_in, n_out = linears[0].in_features, linears[-1].out_features
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(batch, n_in, generator=g), torch.randn(batch, n_out, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def save_run(model: nn.Module, opt: ShardedOptimizer, path: Path) -> None:
    """A run's checkpoint: ``save_sharded(opt, path)`` and, from rank 0, the model's weights in
    ``<path>.model.pt``; returns when every rank is done. Collective."""
    save_sharded(opt, path)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path.with_name(path.name + ".model.pt"))
    dist.barrier()


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two plain optimizer state dicts are equal: groups, keys, and every tensor bit for bit."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape, (i, k)
                assert torch.equal(v.cpu(), w.cpu()), (i, k)
            else:
                assert v == w, (i, k)


class LiveStorages(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated inside the mode and alive at once.

    Every op's outputs are inspected: a storage that is neither an input's nor already tracked
    is new (its bytes added); each output tensor referencing a tracked storage holds it, and the
    bytes are released when the last of them is garbage collected. Storages that existed before
    the mode (the inputs, ``out=`` targets, views of them) are never counted. Temporaries inside
    one kernel are not seen: this measures what torch ops allocate between them, the transient
    memory a chunked algorithm bounds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # data_ptr -> [holders, nbytes]

    def _release(self, ptr: int) -> None:
        entry = self._refs.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr not in self._refs:
                if ptr in inputs or nbytes == 0:
                    continue
                self._refs[ptr] = [0, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self._refs[ptr][0] += 1
            weakref.finalize(t, self._release, ptr)
        return out
