"""all_gather_objects: NumPy-free object exchange (see [Note: Object collectives without NumPy])."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from shardkit.partition import all_gather_objects, comm_device
from shardkit.testing import world


def _forbid_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_numpy(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)


@world(3)
def test_gathers_objects_of_different_sizes_without_numpy() -> None:
    with pytest.MonkeyPatch.context() as mp:
        _forbid_numpy(mp)
        rank = dist.get_rank()
        mine = {"rank": rank, "payload": "x" * (rank * 1000), "nested": (rank, [1.5] * rank)}
        got = all_gather_objects(mine)
        # torch's own implementation needs NumPy, which is what this replaces.
        with pytest.raises(RuntimeError, match="Numpy is not available"):
            dist.all_gather_object([None] * 3, mine)
    assert [g["rank"] for g in got] == [0, 1, 2]
    assert [len(g["payload"]) for g in got] == [0, 1000, 2000]
    assert got[2]["nested"] == (2, [1.5, 1.5])
    assert comm_device() == torch.device("cpu")


@world(2)
def test_unpicklable_object_raises_on_every_rank() -> None:
    obj: object = threading.Lock() if dist.get_rank() == 1 else "fine"
    with pytest.raises(TypeError, match=r"rank\(s\) \[1\] cannot be pickled"):
        all_gather_objects(obj)
    # The group is still usable afterwards.
    assert all_gather_objects(dist.get_rank()) == [0, 1]


@world(3)
def test_subgroup_gather() -> None:
    sub = dist.new_group([0, 2])
    if dist.get_rank() in (0, 2):
        assert all_gather_objects(("r", dist.get_rank()), sub) == [("r", 0), ("r", 2)]
    dist.barrier()
