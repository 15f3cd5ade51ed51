"""Smoke test of shardkit-testing installed alone: the plugin runs a 2-rank @world test."""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap

import pytest
from shardkit.testing import MAX_WORLD_SIZE, WorldSpec, free_port

_TEST = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from shardkit.testing import world


    @world(2)
    def test_allreduce(tmp_path):
        t = torch.ones(3) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        assert t.tolist() == [3.0, 3.0, 3.0]
        assert tmp_path.exists()
    """
)


def main() -> None:
    spec = WorldSpec(2)
    assert (spec.world_size, spec.backend) == (2, "gloo"), spec
    for bad in (0, MAX_WORLD_SIZE + 1):
        try:
            WorldSpec(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"WorldSpec({bad}) did not raise")
    assert 0 < free_port() < 65536
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "test_smoke_world.py")
        with open(path, "w") as f:
            f.write(_TEST)
        code = pytest.main([path, "-q", "-p", "no:cacheprovider", "--rootdir", tmp])
    assert code == 0, f"the @world(2) test failed (pytest exit code {code})"
    print("smoke ok: shardkit-testing")


if __name__ == "__main__":
    main()
    sys.exit(0)
