"""fairscale's own ShardedDataParallel tests, run against ``shardkit.ddp`` through a small shim.

No fairscale test code is stored here. Point ``SHARDKIT_FAIRSCALE_TESTS`` at a directory that
holds fairscale's ``tests/nn/data_parallel/test_sharded_ddp_features.py`` and
``test_sharded_ddp_pytorch_parity.py`` (a fairscale checkout's ``tests/nn/data_parallel``);
otherwise these tests skip. The shim copies each file into a temporary directory with two
import lines swapped (fairscale's ``ShardedDataParallel`` -> ``shardkit.ddp``, fairscale's
``OSS`` -> ``shardkit.optim.OSS``) and fairscale's CUDA skip markers neutralised on
``test_step`` only, then runs the Gloo/CPU cases in a pytest subprocess (each fairscale test
spawns its own ranks and owns the default process group, so they cannot run in this process).

Results (fairscale's tests at its main branch, commit 146f1602, fairscale 0.4.13 helpers,
torch 2.13, CPU, 38 selected): 21 pass, 17 fail.

- pass: ``test_ddp_attributes``, ``test_random_attributes``, ``test_catch_grad_grad``,
  ``test_mixed_types``, ``test_two_optimizers`` and the 16 Gloo/CPU ``test_step`` cases with
  ``torch.optim.SGD`` (``reduce_fp16`` True and False, buckets 0 and 2**20, with and without
  ``no_sync`` accumulation and buffer broadcast);
- fail, not ours: the 16 ``test_step[...SGDWithPausingCompute...]`` cases: that optimizer opens
  a ``torch.cuda.Stream`` in ``step()``, so they fail on a CPU-only machine with fairscale's own
  ``ShardedDataParallel`` too (checked: "torch.cuda.Stream requires CUDA support"). Against
  shardkit they stop earlier, at construction, on every rank, and would on a GPU too: the
  optimizer takes ``rank=`` as a per-rank hyper-parameter, which shardkit-optim's construction
  agreement rejects on purpose (a ValueError naming the mismatch).
- fail by design: ``test_train_eval_change`` asserts that, after a train -> eval -> train
  switch, backward leaves a ``.grad`` on the first param on every rank. ZeRO-2 keeps no
  ``.grad`` (the reduced gradient lives in the owner's shard). fairscale passes only because
  its hooks are not re-armed after the switch: its gradients there are the unreduced local
  ones, different on every rank (checked by printing them). Since issue 26 ``.grad`` holds a
  reduced-grad placeholder, and the test's ``torch.norm(p.grad)`` raises the error that names
  ``ShardedDataParallel.clip_grad_norm_``.

``test_sharded_ddp_pytorch_parity.py`` (``test_fairscale_parity_suite_on_cpu``): fairscale runs
it on every visible GPU over NCCL; ``_cpu_parity`` runs it on CPU over Gloo at world 2 (device,
backend, ``device_ids`` and the CUDA markers swapped; no AMP cases). 50 cases run (16 more are
skipped by fairscale itself): 48 ``test_ddp_parity`` and 2 ``test_ddp_parity_two_optim``. Before
issue 26 all 50 failed at the test's ``copy.deepcopy`` of the wrapped module. Now 34 pass: both
``two_optim`` cases and the 32 ``test_ddp_parity`` cases that do not clip after the step
(buckets 0 and 2**20, with and without accumulation, manual ``reduce()``, a module run twice
per forward, and the ``change_train_graph`` cases that flip ``requires_grad`` after the first
step: the next forward rebuilds the bucket layout, see [Note: Trainable refresh]), equal to
DDP. 16 fail by design: with ``clip_grad_norm`` (and without ``change_train_graph``, where the
suite's clip runs) they call ``optimizer.clip_grad_norm`` *after* ``step()`` and compare with
DDP's norm of the stale gradients; issue 26 makes a clip after the step raise (the step
consumed the gradients).

fairscale's own ``ShardedDataParallel`` on the same 50 CPU cases (``_adapt(..., swap=False)``):
47 pass, 3 fail its own comparison with DDP (``check_same_model_params``, atol 1e-3: "Model
parameters differ"); rerun, two of those pass and ``two_optim[1048576]`` fails again (a bias
1.2e-3 off at step 3), so fairscale is intermittent there, and passes the 16 cases failing here
by design (it keeps gradients after its step).

The tests below assert that every case expected to pass passes and that nothing else fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_ENV = "SHARDKIT_FAIRSCALE_TESTS"
_PARITY = "test_sharded_ddp_pytorch_parity.py"
_FILES = ("test_sharded_ddp_features.py", _PARITY)
_EXPECTED_PASS = (
    "test_ddp_attributes",
    "test_random_attributes",
    "test_catch_grad_grad",
    "test_mixed_types",
    "test_two_optimizers",
)
_EXPECTED_FAIL = ("test_train_eval_change",)


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


def _replace(text: str, old: str, new: str) -> str:
    if old not in text:
        raise AssertionError(f"fairscale's test file no longer has {old!r}: update the shim")
    return text.replace(old, new)


def _adapt(text: str, name: str = _FILES[0], swap: bool = True) -> str:
    """fairscale's test file ``name``, run against shardkit (``swap``) or fairscale itself."""
    if swap:
        text = _replace(
            text,
            "from fairscale.nn.data_parallel import ShardedDataParallel",
            "from shardkit.ddp import ShardedDataParallel",
        )
        text = _replace(text, "from fairscale.optim import OSS", "from shardkit.optim import OSS")
    if name == _PARITY:
        return _cpu_parity(text)
    # test_step's Gloo/CPU setup is skipped by fairscale's CUDA markers: drop them there only.
    return re.sub(
        r"@skip_if_no_cuda\n@skip_if_single_gpu\n((?:@pytest\.mark\.parametrize[^\n]*\n|"
        r"[^\n]*\n)*?)def test_step\(",
        r"\1def test_step(",
        text,
        count=1,
    )


def _cpu_parity(text: str) -> str:
    """``test_ddp_parity`` / ``test_ddp_parity_two_optim`` on CPU over Gloo, world 2.

    fairscale runs them on every visible GPU over NCCL; nothing in them needs a GPU but AMP
    (``torch.cuda.amp``, a no-op with a warning on CPU), whose cases are dropped. So: the
    device is the CPU, DDP gets no ``device_ids``, the backend is Gloo, the world 2, the CUDA
    skip markers go, and ``torch.cuda.set_device`` / ``synchronize`` become no-ops.
    """
    text = _replace(text, 'device = torch.device("cuda")', 'device = torch.device("cpu")')
    text = _replace(text, "torch.cuda.set_device(rank)", "pass  # CPU")
    text = _replace(text, "torch.cuda.synchronize(device)", "pass  # CPU")
    text = _replace(text, "device_ids=[rank]", "device_ids=None")
    text = _replace(text, "backend = dist.Backend.NCCL", "backend = dist.Backend.GLOO")
    text = _replace(text, "world_size = torch.cuda.device_count()", "world_size = 2")
    text = _replace(text, "@skip_if_no_cuda\n@skip_if_single_gpu\n", "")
    return _replace(
        text,
        'if hasattr(torch.cuda.amp, "autocast"):\n    _test_amp.append(True)',
        "if torch.cuda.is_available():  # CPU: no AMP cases\n    _test_amp.append(True)",
    )


def _run(
    tmp_path: Path, selection: str, files: tuple[str, ...] = _FILES, swap: bool = True
) -> dict[str, str]:
    return _run_with_errors(tmp_path, selection, files, swap)[0]


def _run_with_errors(
    tmp_path: Path, selection: str, files: tuple[str, ...] = _FILES, swap: bool = True
) -> tuple[dict[str, str], list[str]]:
    """Outcome per case id, and the ``E ...Error`` lines of the failures."""
    src = _source_dir()
    for name in _FILES:
        (tmp_path / name).write_text(_adapt((src / name).read_text(), name, swap))
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
            *files,
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
    errors = [
        ln
        for ln in proc.stdout.splitlines()
        if ln.startswith("E ") and any(w in ln for w in ("Error", "Exception", "timed out"))
    ]
    print("\n".join(errors[:60]))  # the first error lines of the failures, for diagnosis
    print(proc.stdout[-3000:])
    return outcome, errors


@pytest.mark.slow
def test_fairscale_sharded_ddp_suite(tmp_path: Path) -> None:
    selection = " or ".join([*_EXPECTED_PASS, *_EXPECTED_FAIL])
    selection += " or (test_step and setup1)"
    outcome = _run(tmp_path, selection)
    passed = sorted(k for k, v in outcome.items() if v == "PASSED")
    failed = sorted(k for k, v in outcome.items() if v in ("FAILED", "ERROR"))
    print(f"fairscale suite: {len(passed)} passed, {len(failed)} failed: {failed}")
    for name in _EXPECTED_PASS:
        assert outcome.get(name) == "PASSED", (name, outcome.get(name))
    steps = {k: v for k, v in outcome.items() if k.startswith("test_step[")}
    assert len(steps) == 32, sorted(steps)  # 2 optimizers x 2^4 settings, Gloo/CPU setup
    for k, v in steps.items():
        if "SGDWithPausingCompute" not in k:  # CUDA-only helper, see the module docstring
            assert v == "PASSED", (k, v)
    unexpected = [k for k in failed if k not in _EXPECTED_FAIL and not k.startswith("test_step[")]
    assert not unexpected, unexpected


# test_ddp_parity's case ids: multiple_fw-manual_reduction-amp-clip_grad_norm-fp16_reduction-
# change_train_graph-grad_accumulation-reduce_buffer_size (fairscale main 146f1602).
_PARITY_FIELDS = ("multiple_fw", "manual", "amp", "clip", "fp16", "change_train", "accumulate")
_BY_DESIGN = (
    # clip_grad_norm (without change_train_graph) calls optimizer.clip_grad_norm *after* step(),
    # which issue 26 makes raise (the step consumed the gradients; fairscale measures the stale
    # ones).
    "ShardedDataParallel.clip_grad_norm_ / optimizer.clip_grad_norm found no gradient to clip",
)


@pytest.mark.slow
def test_fairscale_parity_suite_on_cpu(tmp_path: Path) -> None:
    """fairscale's ``test_sharded_ddp_pytorch_parity.py`` on CPU/Gloo (see ``_cpu_parity``):
    50 cases run (48 ``test_ddp_parity`` without AMP, 16 more skipped by fairscale itself, and
    2 ``test_ddp_parity_two_optim``). Every case passes (32 + 2) but the 16 that clip after the
    step (``clip_grad_norm`` without ``change_train_graph``), which fail by design with the error
    above.
    """
    outcome, errors = _run_with_errors(tmp_path, "test_ddp_parity", (_PARITY,))
    ran = {k: v for k, v in outcome.items() if k.startswith("test_ddp_parity")}
    assert len(ran) == 50, sorted(ran)
    for k, v in ran.items():
        if k.startswith("test_ddp_parity_two_optim"):
            assert v == "PASSED", (k, v)
            continue
        flags = dict(zip(_PARITY_FIELDS, (f == "True" for f in k[16:-1].split("-")), strict=False))
        by_design = flags["clip"] and not flags["change_train"]  # its clip runs only then
        assert v == ("FAILED" if by_design else "PASSED"), (k, v)
    raised = [e for e in errors if re.match(r"^E\s+\w+(Error|Exception): ", e)]
    assert raised and all(any(d in e for d in _BY_DESIGN) for e in raised), raised
