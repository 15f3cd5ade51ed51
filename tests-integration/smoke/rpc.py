"""Smoke test of shardkit-rpc installed alone: a one-worker RPC session, DistributedOptimizer
over RRefs in a distributed autograd context, exactly like plain SGD with momentum."""

from __future__ import annotations

import copy
import socket

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc import DistributedOptimizer, RemoteOptimizerError
from torch import nn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{_port()}")
    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
    try:
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        ref = copy.deepcopy(model)
        opt = DistributedOptimizer(
            torch.optim.SGD, [rpc.RRef(p) for p in model.parameters()], lr=0.1, momentum=0.9
        )
        plain = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [model(x).square().sum()])
                opt.step(cid, timeout=30)
            ref(x).square().sum().backward()
            plain.step()
            plain.zero_grad()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q), f"step {step}: params differ from plain SGD"
        sd = opt.state_dict(timeout=30)
        assert len(sd["state"]) == 2 and sd["param_groups"][0]["lr"] == 0.1, sd
        assert issubclass(RemoteOptimizerError, RuntimeError)
        try:
            opt.step("not a context id")  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError("step() with a bad context id did not raise")
        del opt
    finally:
        rpc.shutdown()
    print("smoke ok: shardkit-rpc")


if __name__ == "__main__":
    main()
