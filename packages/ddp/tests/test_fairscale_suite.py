"""fairscale's own ShardedDataParallel tests, run against ``shardkit.ddp`` through a small shim.

No fairscale test code is stored here. Point ``SHARDKIT_FAIRSCALE_TESTS`` at a directory that
holds fairscale's ``tests/nn/data_parallel/test_sharded_ddp_features.py`` and
``test_sharded_ddp_pytorch_parity.py`` (a fairscale checkout's ``tests/nn/data_parallel``);
otherwise these tests skip. The shim copies each file into a temporary directory with two
import lines swapped (fairscale's ``ShardedDataParallel`` -> ``shardkit.ddp``, fairscale's
``OSS`` -> ``shardkit.optim.OSS``) and fairscale's CUDA skip markers neutralised on
``test_step`` only, then runs the Gloo/CPU cases in a pytest subprocess (each fairscale test
spawns its own ranks and owns the default process group, so they cannot run in this process).

Results (fairscale's tests at its main branch, fairscale 0.4.13 helpers, torch 2.13, CPU, 38
selected): 12 pass, 26 fail.

- pass: ``test_ddp_attributes``, ``test_random_attributes``, ``test_catch_grad_grad``,
  ``test_mixed_types``, and the Gloo/CPU ``test_step`` cases with ``torch.optim.SGD`` and
  ``reduce_fp16=False`` (8 cases; in one of two runs one of them failed under heavy load and
  passed when rerun alone: it spawns its ranks with a file:// rendezvous);
- fail by design: ``test_train_eval_change`` (expects ``.grad`` populated after backward:
  ZeRO-2 frees it, the reduced gradient lives in the owner's shard), ``test_two_optimizers``
  (one optimizer per wrapper), ``test_step[...-True-...]`` (``reduce_fp16=True``, 16 cases),
  ``test_step[...SGDWithPausingCompute...]`` (the optimizer takes ``rank=`` as a
  hyper-parameter that differs per rank, which shardkit-optim's construction agreement rejects
  on purpose; 16 cases, 8 of them also fp16).

The test below asserts that every case expected to pass passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_ENV = "SHARDKIT_FAIRSCALE_TESTS"
_FILES = ("test_sharded_ddp_features.py", "test_sharded_ddp_pytorch_parity.py")
_EXPECTED_PASS = (
    "test_ddp_attributes",
    "test_random_attributes",
    "test_catch_grad_grad",
    "test_mixed_types",
)


def _source_dir() -> Path:
    where = os.environ.get(_ENV)
    if not where:
        pytest.skip(f"set {_ENV} to fairscale's tests/nn/data_parallel directory to run its suite")
    path = Path(where)
    if not all((path / f).is_file() for f in _FILES):
        pytest.skip(f"{_ENV}={where} does not hold {', '.join(_FILES)}")
    try:
        import fairscale  # noqa: F401  (its testing helpers are imported by the suite)
    except ImportError:
        pytest.skip("fairscale is not installed (its test helpers are needed)")
    return path


def _adapt(text: str) -> str:
    swaps = {
        "from fairscale.nn.data_parallel import ShardedDataParallel": (
            "from shardkit.ddp import ShardedDataParallel"
        ),
        "from fairscale.optim import OSS": "from shardkit.optim import OSS",
    }
    for old, new in swaps.items():
        if old not in text:
            raise AssertionError(f"fairscale's test file no longer has {old!r}: update the shim")
        text = text.replace(old, new)
    # test_step's Gloo/CPU setup is skipped by fairscale's CUDA markers: drop them there only.
    return re.sub(
        r"@skip_if_no_cuda\n@skip_if_single_gpu\n((?:@pytest\.mark\.parametrize[^\n]*\n|"
        r"[^\n]*\n)*?)def test_step\(",
        r"\1def test_step(",
        text,
        count=1,
    )


def _run(tmp_path: Path, selection: str) -> dict[str, str]:
    src = _source_dir()
    for name in _FILES:
        (tmp_path / name).write_text(_adapt((src / name).read_text()))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-k",
            selection,
            *_FILES,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    outcome: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", line)
        if m:
            outcome[m.group(2).split("::")[-1]] = m.group(1)
    print(proc.stdout[-3000:])
    return outcome


@pytest.mark.slow
def test_fairscale_sharded_ddp_suite(tmp_path: Path) -> None:
    selection = " or ".join([*_EXPECTED_PASS, "test_train_eval_change", "test_two_optimizers"])
    selection += " or (test_step and setup1)"
    outcome = _run(tmp_path, selection)
    passed = sorted(k for k, v in outcome.items() if v == "PASSED")
    failed = sorted(k for k, v in outcome.items() if v in ("FAILED", "ERROR"))
    print(f"fairscale suite: {len(passed)} passed, {len(failed)} failed: {failed}")
    for name in _EXPECTED_PASS:
        assert outcome.get(name) == "PASSED", (name, outcome.get(name))
    steps = {k: v for k, v in outcome.items() if k.startswith("test_step[")}
    assert steps, "no Gloo/CPU test_step case ran"
    for k, v in steps.items():
        if v != "PASSED":
            assert _is_fp16_case(k) or "SGDWithPausingCompute" in k, (k, v)


def _is_fp16_case(test_id: str) -> bool:
    """Whether a ``test_step`` id has ``reduce_fp16=True``: ids read
    ``[setup-reduce_fp16-optimizer_type-reduce_buffer_size-grad_accumulation-broadcast_buffers]``
    (the decorator nearest the function comes first)."""
    params = test_id[test_id.index("[") + 1 : -1].split("-")
    return len(params) == 6 and params[1] == "True"
