"""A mistake on one rank ends the job (issue 36): real ``torchrun --standalone`` jobs.

Each job (``_rank_failure_job.py``) trains a small model in one of the three modes (ZeRO-1 +
torch DDP, the overlap hook, ShardedDataParallel) and makes one rank-dependent mistake at step
2, in a script without try/except, with ``collective_timeout`` = 5 s: a state dict on rank 0
only (the others in ``dist.barrier()``, or training on), a forward without backward on one
rank, ``no_sync()`` on one rank, a per-rank learning rate, a Python error in one rank's forward.
Every job must exit non-zero (torchrun reporting the failure) within ``collective_timeout`` +
45 s of the mistake, with the error in its output. Before issue 36 five of these jobs never
ended: the rank that raised hung in ``~ProcessGroupGloo`` joining the agreement's pending
all-reduce while the other rank waited in its barrier or DDP's all-reduce.

The jobs run three at a time (2 cores: each job is torchrun plus N rank processes); each has a
hard limit, after which its whole process tree (torchrun starts the ranks in sessions of their
own) is killed and the test fails. World 2 for every case, world 4 for a subset.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

_JOB = Path(__file__).resolve().parent / "_rank_failure_job.py"
_COLLECTIVE_TIMEOUT_S = 5.0
_GRACE_S = 45.0  # the job must have ended this long after collective_timeout
_HARD_LIMIT_S = 240.0  # per job, start-up included: then its process tree is killed
_PARALLEL = 3

_MODES = ("zero1", "overlap", "zero2")
_MISUSES = (
    "state_dict_vs_barrier",
    "state_dict_vs_training",
    "no_backward",
    "no_sync",
    "per_rank_lr",
    "forward_error",
)
_WORLD4 = (
    ("zero1", "state_dict_vs_barrier"),
    ("overlap", "state_dict_vs_barrier"),
    ("zero2", "state_dict_vs_barrier"),
    ("zero1", "no_backward"),
)
_CASES = [(2, mode, misuse) for mode in _MODES for misuse in _MISUSES] + [
    (4, mode, misuse) for mode, misuse in _WORLD4
]

_SAVED_ALONE = (
    r"(called ShardedOptimizer\.state_dict\(\) \(implicit consolidation onto every rank\) and "
    r"waited 0:00:05|different collective calls: .*ShardedOptimizer\.state_dict\(\))"
)
_STEP_ALONE = (
    r"called ShardedOptimizer\.step\(\) and waited 0:00:05 .*global rank\(s\) \[[0-9, ]+\] did not"
)
_NOT_SYNCED = r"no backward pass with gradient synchronisation ran on rank {rank}"
_BACKWARD_VS_STEP = (
    r"different collective calls: some in ShardedDataParallel backward \(gradient "
    r"reduce-scatter\) \(global rank\(s\) \[[0-9, ]+\]\), others in ShardedOptimizer\.step\(\)"
)


def _expected(world: int, mode: str, misuse: str) -> str:
    """The error the job's output must hold."""
    last = world - 1
    if misuse in ("state_dict_vs_barrier", "state_dict_vs_training"):
        return _SAVED_ALONE
    if misuse == "no_backward":
        return {"zero1": _STEP_ALONE, "overlap": _NOT_SYNCED.format(rank=last)}.get(
            mode, _BACKWARD_VS_STEP
        )
    if misuse == "no_sync":
        return {"zero1": _STEP_ALONE, "overlap": _NOT_SYNCED.format(rank=0)}.get(
            mode, _BACKWARD_VS_STEP
        )
    if misuse == "per_rank_lr":
        return (
            r"ranks step with different hyper-parameters.*lr=0\.01 on rank 0 but lr=0\.02 on rank 1"
        )
    return rf"ValueError: bad batch on rank {last} \(the job's own error\)"


@dataclass(frozen=True)
class _Job:
    returncode: int | None  # None: killed at the hard limit
    seconds: float  # launch to exit
    after_mistake_s: float | None  # first "MISTAKE" line to exit
    output: str


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(world: int, mode: str, misuse: str) -> _Job:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if torch.cuda.is_available():  # keep the jobs on Gloo and the CPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(world), str(_JOB), mode, misuse, str(_COLLECTIVE_TIMEOUT_S),
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=_HARD_LIMIT_S)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate()
        code = None
    end = time.time()
    marks = [float(m) for m in re.findall(r"^MISTAKE ([0-9.]+)", out, flags=re.MULTILINE)]
    return _Job(code, end - start, end - min(marks) if marks else None, out)


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest) -> dict[tuple[int, str, str], _Job]:
    """Runs the jobs of every selected test of this module, ``_PARALLEL`` at a time."""
    wanted: list[tuple[int, str, str]] = []
    for item in request.session.items:
        spec: Any = getattr(item, "callspec", None)
        if spec is not None and getattr(item, "module", None) is request.module:
            case = (spec.params["world"], spec.params["mode"], spec.params["misuse"])
            if case not in wanted:
                wanted.append(case)
    with ThreadPoolExecutor(_PARALLEL) as pool:
        done = dict(zip(wanted, pool.map(lambda c: _run(*c), wanted), strict=True))
    for (world, mode, misuse), job in done.items():  # the figures of the README (pytest -s)
        after = "-" if job.after_mistake_s is None else f"{job.after_mistake_s:.1f} s"
        print(
            f"world {world} {mode:8s} {misuse:24s} exit {job.returncode}, {after} after the "
            f"mistake, {job.seconds:.1f} s in all"
        )
    return done


@pytest.mark.slow
@pytest.mark.parametrize(("world", "mode", "misuse"), _CASES)
def test_a_mistake_on_one_rank_ends_the_job(
    jobs: dict[tuple[int, str, str], _Job], world: int, mode: str, misuse: str
) -> None:
    job = jobs[(world, mode, misuse)]
    tail = job.output[-6000:]
    assert job.returncode is not None, (
        f"the job was still running after {_HARD_LIMIT_S:.0f} s and was killed:\n{tail}"
    )
    assert job.returncode != 0, f"the job exited 0 despite the mistake:\n{tail}"
    assert "FINISHED" not in job.output, f"a rank finished its training:\n{tail}"
    assert job.after_mistake_s is not None, f"no rank reached the mistake:\n{tail}"
    assert job.after_mistake_s <= _COLLECTIVE_TIMEOUT_S + _GRACE_S, (
        f"the job ended {job.after_mistake_s:.1f} s after the mistake:\n{tail}"
    )
    assert "ChildFailedError" in job.output, f"torchrun did not report the failure:\n{tail}"
    expected = _expected(world, mode, misuse)
    assert re.search(expected, job.output), f"no error matching {expected!r}:\n{tail}"
