"""Smoke test of shardkit-partition installed alone: partitions, consistency and object gather."""

from __future__ import annotations

import torch
import torch.distributed as dist
from shardkit.partition import ALGORITHMS, all_gather_objects, check_consistent, partition


def main() -> None:
    params = [
        torch.empty(10, 10),
        torch.empty(50),
        torch.empty(30),
        torch.empty(20),
        torch.empty(7),
    ]
    for algorithm in ALGORITHMS:
        for world_size in (1, 2, 3):
            p = partition(params, world_size, algorithm=algorithm)
            owned = sorted(i for r in range(world_size) for i in p.params_of(r))
            assert owned == list(range(len(params))), (algorithm, world_size, owned)
    try:
        partition(params, 0)
    except (ValueError, TypeError):
        pass
    else:
        raise AssertionError("partition(params, 0) did not raise")

    # The NumPy-free object collective and the consistency check, on a world-1 Gloo group.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        obj = {"a": [1, 2.5, "x"], "b": None}
        assert all_gather_objects(obj, None) == [obj]
        check_consistent(params)
    finally:
        dist.destroy_process_group()
    print("smoke ok: shardkit-partition")


if __name__ == "__main__":
    main()
