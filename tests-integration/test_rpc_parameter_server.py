"""A parameter-server run with shardkit-rpc: two parameter servers each own one stage of a small
model, a trainer runs forward/backward over RPC in distributed autograd contexts and steps
``shardkit.rpc.DistributedOptimizer`` (AdamW, two param groups, a StepLR schedule through its
``scheduler_view``). The trainer checkpoints optimizer, schedule and weights after step 3; a
second, fresh job with renamed parameter servers restores them (``owner_map``) and trains on.

Both jobs are compared bit-for-bit, step by step, with the same model trained locally with a
plain ``torch.optim.AdamW`` + ``StepLR`` in the pytest process.

[Note: Fresh processes for RPC]
torch 2.13 cannot initialise RPC again in a process where it was shut down, so these jobs cannot
use the reused ``shardkit.testing.world`` processes: each job starts fresh processes running this
file's ``_child_main`` (imported under one stable module name, so functions sent over RPC pickle
by reference), under a hard timeout that kills every process and reports their output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from shardkit.rpc import DistributedOptimizer
from shardkit.testing import free_port
from torch import nn

_ALIAS = "_shardkit_it_rpc_parameter_server"
_STEPS = 5
_CKPT_AFTER = 3  # steps done when the checkpoint is written
_GROUPS = ({"lr": 1e-2}, {})
_DEFAULTS = {"lr": 3e-3, "weight_decay": 0.1}
_SCHEDULE = {"step_size": 2, "gamma": 0.5}
_JOB_TIMEOUT = 180.0

_MODULE: list[nn.Module] = []  # the stage this parameter server owns


def _stage(kind: str) -> nn.Module:
    torch.manual_seed(0 if kind == "a" else 1)
    if kind == "a":
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.LayerNorm(16))
    return nn.Linear(16, 4)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


# ------------------------------------------------------------------ functions run over RPC
def _build(kind: str, state: dict[str, torch.Tensor] | None) -> list[rpc.RRef[torch.Tensor]]:
    module = _stage(kind)
    if state is not None:
        module.load_state_dict(state)
    _MODULE[:] = [module]
    return [rpc.RRef(p) for p in module.parameters()]


def _forward(x: torch.Tensor) -> torch.Tensor:
    return _MODULE[0](x)


def _weights() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _MODULE[0].state_dict().items()}


# ------------------------------------------------------------------ the trainer
def _train(out: Path, job: str, servers: tuple[str, str]) -> None:
    resume = job == "resume"
    ckpt = torch.load(out / "ckpt.pt") if resume else None
    states = ckpt["weights"] if ckpt is not None else (None, None)
    rrefs = [
        rpc.rpc_sync(s, _build, args=(k, st))
        for s, k, st in zip(servers, "ab", states, strict=True)
    ]
    opt = DistributedOptimizer(
        torch.optim.AdamW,
        [{"params": r, **g} for r, g in zip(rrefs, _GROUPS, strict=True)],
        **_DEFAULTS,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt.scheduler_view, **_SCHEDULE)
    first = 0
    if ckpt is not None:
        # The servers were renamed between the jobs: map the saved owners to the new ones.
        opt.load_state_dict(ckpt["optim"], owner_map={"ps0": servers[0], "ps1": servers[1]})
        sched.load_state_dict(ckpt["sched"])
        first = _CKPT_AFTER
    trajectory = []
    for step in range(first, _STEPS):
        x, y = _batch(step)
        with dist_autograd.context() as cid:
            h = rpc.rpc_sync(servers[0], _forward, args=(x,))
            pred = rpc.rpc_sync(servers[1], _forward, args=(h,))
            loss = (pred - y).square().mean()
            dist_autograd.backward(cid, [loss])
            opt.step(cid, timeout=60)
        sched.step()
        weights = tuple(rpc.rpc_sync(s, _weights) for s in servers)
        trajectory.append({"loss": loss.detach(), "weights": weights})
        if not resume and step + 1 == _CKPT_AFTER:
            state = {"optim": opt.state_dict(timeout=60), "sched": sched.state_dict()}
            torch.save({**state, "weights": weights}, out / "ckpt.pt")
    torch.save(trajectory, out / f"trajectory-{job}.pt")


def _child_main(argv: list[str]) -> None:
    rank, port, out, job, *names = argv
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60, num_worker_threads=8
    )
    rpc.init_rpc(
        names[int(rank)], rank=int(rank), world_size=len(names), rpc_backend_options=options
    )
    try:
        if int(rank) == 0:
            _train(Path(out), job, (names[1], names[2]))
    finally:
        rpc.shutdown()  # graceful: waits for every worker, the job's rendezvous


_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location({alias!r}, {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[{alias!r}] = module
spec.loader.exec_module(module)
module._child_main(sys.argv[1:])
"""


def _job(out: Path, job: str, names: tuple[str, str, str]) -> None:
    """Runs one job (trainer + two servers) in fresh processes. See [Note: Fresh processes for RPC]."""
    code = _CHILD.format(alias=_ALIAS, path=os.path.abspath(__file__))
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), port, str(out), job, *names],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        for r in range(len(names))
    ]
    deadline = time.monotonic() + _JOB_TIMEOUT
    outputs: list[str] = []
    timed_out = False
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    p.kill()
            text, _ = proc.communicate()
        outputs.append(text.decode(errors="replace"))
    codes = [p.wait() for p in procs]
    if timed_out or any(codes):
        logs = "\n".join(
            f"----- {n} (exit {c}) -----\n{o}"
            for n, c, o in zip(names, codes, outputs, strict=True)
        )
        raise AssertionError(
            f"RPC job {job!r} {'timed out' if timed_out else 'failed'} (limit {_JOB_TIMEOUT:.0f}s):\n{logs}"
        )


def _reference() -> list[dict[str, Any]]:
    """The same training, local and unsharded: plain AdamW + StepLR.

    One intra-op thread, as in the jobs (``OMP_NUM_THREADS=1``): with more, LayerNorm's
    backward splits its bias/weight reductions over threads and sums in another order.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run()
    finally:
        torch.set_num_threads(threads)


def _reference_run() -> list[dict[str, Any]]:
    stages = [_stage("a"), _stage("b")]
    opt = torch.optim.AdamW(
        [{"params": s.parameters(), **g} for s, g in zip(stages, _GROUPS, strict=True)], **_DEFAULTS
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, **_SCHEDULE)
    out = []
    for step in range(_STEPS):
        x, y = _batch(step)
        loss = (stages[1](stages[0](x)) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        weights = tuple({k: v.detach().clone() for k, v in s.state_dict().items()} for s in stages)
        out.append({"loss": loss.detach(), "weights": weights})
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert torch.equal(got["loss"], want["loss"]), f"{where}: loss {got['loss']} vs {want['loss']}"
    for g, w in zip(got["weights"], want["weights"], strict=True):
        for key in w:
            assert torch.equal(g[key], w[key]), (
                f"{where}: {key} differs, max |diff| {(g[key] - w[key]).abs().max().item():.3e}"
            )


def test_parameter_server_training_and_resume_match_local_adamw(tmp_path: Path) -> None:
    want = _reference()
    _job(tmp_path, "train", ("trainer", "ps0", "ps1"))
    first = torch.load(tmp_path / "trajectory-train.pt")
    assert len(first) == _STEPS
    for step, (got, ref) in enumerate(zip(first, want, strict=True)):
        _assert_same(got, ref, f"first job, step {step}")

    _job(tmp_path, "resume", ("trainer", "ps_a", "ps_b"))
    resumed = torch.load(tmp_path / "trajectory-resume.pt")
    assert len(resumed) == _STEPS - _CKPT_AFTER
    for step, (got, ref) in enumerate(zip(resumed, want[_CKPT_AFTER:], strict=True), _CKPT_AFTER):
        _assert_same(got, ref, f"resumed job, step {step}")
    assert want[-1]["loss"] < want[0]["loss"]
