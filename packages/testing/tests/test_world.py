"""Tests of the @world plugin: passing worlds, reuse, timeouts with stacks, rank failures, skips.

Behaviour that needs a failing or hanging test runs in an inner pytest session (pytester, in a
subprocess) so the outer session can assert on its outcome, timing and leftover processes.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from shardkit.testing import WorldSpec, free_port, rank_cuda_device, world

# -- tier 2: bodies that run on the ranks ----------------------------------------------------


@world(1)
def test_world_of_one() -> None:
    assert dist.get_world_size() == 1 and dist.get_rank() == 0


@world(2)
def test_allreduce_two(tmp_path: object) -> None:
    t = torch.ones(3) * dist.get_rank()
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]


@world(3)
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_parametrize_reaches_every_rank(scale: float) -> None:
    t = torch.tensor([scale])
    dist.all_reduce(t)
    assert t.item() == pytest.approx(3 * scale)


@world(4)
def test_world_of_four_all_gather() -> None:
    out = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(out, torch.tensor([float(dist.get_rank())]))
    assert [o.item() for o in out] == [0.0, 1.0, 2.0, 3.0]


@world(2)
def test_fixture_value_is_shared(tmp_path: os.PathLike[str]) -> None:
    marker = os.path.join(os.fspath(tmp_path), f"rank{dist.get_rank()}")
    open(marker, "w").close()
    dist.barrier()
    assert sorted(os.listdir(tmp_path)) == ["rank0", "rank1"]


@world(2)
def test_monkeypatch_on_ranks_is_undone_part1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 99)
    monkeypatch.setenv("SHARDKIT_LEAK_CHECK", "leaked")
    assert dist.get_world_size() == 99


@world(2)
def test_monkeypatch_on_ranks_is_undone_part2() -> None:
    # Same reused world as part 1 (it runs right after it): nothing leaked.
    assert dist.get_world_size() == 2
    assert "SHARDKIT_LEAK_CHECK" not in os.environ


@world(2)
def test_rank_cuda_device() -> None:
    """Each rank's CUDA device (shared GPUs over Gloo), or a clear error without a GPU."""
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU and none is visible"):
            rank_cuda_device()
        return
    device = rank_cuda_device()
    assert device.index == dist.get_rank() % torch.cuda.device_count()
    assert torch.cuda.current_device() == device.index
    t = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(t)  # Gloo over CUDA tensors
    assert t.tolist() == [3.0] * 4


def test_rank_cuda_device_needs_a_rank() -> None:
    if not torch.cuda.is_available():
        pytest.skip("the no-GPU error is covered by test_rank_cuda_device")
    with pytest.raises(RuntimeError, match="inside a @world test body"):
        rank_cuda_device()


@world(1, backend="nccl")
def test_nccl_allreduce() -> None:
    t = torch.ones(2, device="cuda")
    dist.all_reduce(t)
    assert t.sum().item() == 2.0


# -- tier 1: argument validation ------------------------------------------------------------


def test_bad_world_size_and_backend() -> None:
    with pytest.raises(ValueError, match="between 1 and 8"):
        world(0)
    with pytest.raises(TypeError, match="must be an int"):
        world(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of"):
        world(2, backend="mpi")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        world(2, timeout=0)


def test_nested_test_function_rejected() -> None:
    def local_test() -> None:
        pass

    with pytest.raises(ValueError, match="inside a function"):
        world(2)(local_test)


def test_world_spec_is_hashable_and_frozen() -> None:
    assert WorldSpec(2) == WorldSpec(2, "gloo")
    assert len({WorldSpec(2), WorldSpec(2), WorldSpec(3)}) == 2


def test_env_timeout_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.testing._config import default_timeout

    monkeypatch.setenv("SHARDKIT_TEST_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="SHARDKIT_TEST_TIMEOUT"):
        default_timeout()
    monkeypatch.setenv("SHARDKIT_TEST_TIMEOUT", "7.5")
    assert default_timeout() == 7.5


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- inner sessions: failures, timeouts, reuse, skips ----------------------------------------

_INNER = '''
import os, time, pytest, torch, torch.distributed as dist
from shardkit.testing import world

PIDS = {pids!r}

def _record(tag):
    with open(os.path.join(PIDS, f"{{tag}}-{{dist.get_rank()}}"), "w") as f:
        f.write(str(os.getpid()))
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


def _recorded_pids(path: os.PathLike[str]) -> dict[str, int]:
    return {name: int(open(os.path.join(path, name)).read()) for name in os.listdir(path)}


def test_hanging_rank_times_out_with_stacks(pytester: pytest.Pytester, tmp_path: os.PathLike[str]) -> None:
    pids = os.path.join(os.fspath(tmp_path), "pids")
    os.mkdir(pids)
    pytester.makepyfile(_INNER.format(pids=pids) + '''
@world(2, timeout=4)
def test_hangs():
    _record("hang")
    if dist.get_rank() == 1:
        time.sleep(1000)  # deliberately hangs
    dist.barrier()
''')
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "timed out after 4s" in out
    assert "still running" in out
    assert "time.sleep(1000)" in out or "in test_hangs" in out  # rank 1's stack
    assert "in test_hangs" in out
    # The test failed within seconds of its timeout (start-up of 2 ranks included).
    assert elapsed < 60, elapsed
    recorded = _recorded_pids(pids)
    assert len(recorded) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in recorded.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in recorded.values()), "orphan rank processes remain"


def test_one_rank_exception_fails_fast_and_world_is_replaced(
    pytester: pytest.Pytester, tmp_path: os.PathLike[str]
) -> None:
    pids = os.path.join(os.fspath(tmp_path), "pids")
    os.mkdir(pids)
    pytester.makepyfile(_INNER.format(pids=pids) + '''
@world(2, timeout=90)
def test_a_rank_raises():
    _record("raise")
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would wait here forever

@world(2)
def test_next_test_gets_a_fresh_world():
    _record("after")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0
''')
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str()
    assert "rank 1 of 2 raised" in out
    assert "ValueError: boom from rank one" in out
    assert elapsed < 60, elapsed  # far below the 90 s timeout: rank 0 did not hang the test
    recorded = _recorded_pids(pids)
    assert recorded["raise-0"] != recorded["after-0"], "a failed test's world must be discarded"


def test_worlds_are_reused_between_tests(pytester: pytest.Pytester, tmp_path: os.PathLike[str]) -> None:
    pids = os.path.join(os.fspath(tmp_path), "pids")
    os.mkdir(pids)
    pytester.makepyfile(_INNER.format(pids=pids) + '''
@world(2)
def test_first():
    _record("first")

@world(2)
def test_second():
    _record("second")

@world(1)
def test_other_size():
    _record("third")

def test_pool_count():
    from shardkit.testing import pool
    assert pool.started == 2
''')
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    recorded = _recorded_pids(pids)
    assert recorded["first-0"] == recorded["second-0"]
    assert recorded["first-1"] == recorded["second-1"]
    assert recorded["third-0"] != recorded["first-0"]


def test_skips(pytester: pytest.Pytester) -> None:
    pytester.makepyfile('''
import pytest, torch.distributed as dist
from shardkit.testing import world

@world(8, backend="nccl")
def test_needs_eight_gpus():
    raise AssertionError("must not run")

@world(2)
def test_rank_skips():
    pytest.skip("not relevant on this world")

@pytest.mark.cuda
def test_cuda_marked():
    import torch
    assert torch.cuda.is_available(), "must be skipped where no GPU is visible"
''')
    result = pytester.runpytest_subprocess("-q", "-rs", "-p", "no:cacheprovider")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert gpus < 8, "this test expects the 8-GPU NCCL world to be skipped"
    out = result.stdout.str()
    assert "needs 8 CUDA GPU(s) for the NCCL backend" in out
    assert "rank 0: not relevant on this world" in out
    if gpus:  # the cuda-marked test runs where a GPU is visible
        result.assert_outcomes(skipped=2, passed=1)
    else:
        result.assert_outcomes(skipped=3)
        assert "needs a CUDA GPU" in out


def test_unpicklable_fixture_is_a_clear_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile('''
import threading, pytest
from shardkit.testing import world

@pytest.fixture
def lock():
    return threading.Lock()

@world(2)
def test_uses_lock(lock):
    pass
''')
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "argument 'lock' of type lock cannot be pickled" in result.stdout.str()


def test_session_timeout_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile('''
import time
from shardkit.testing import world

@world(1)
def test_slow():
    time.sleep(60)
''')
    start = time.monotonic()
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--shardkit-timeout", "2")
    result.assert_outcomes(failed=1)
    assert "timed out after 2s" in result.stdout.str()
    assert time.monotonic() - start < 40
