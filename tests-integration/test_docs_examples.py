"""Every script in ``docs/examples/`` runs in CI, launched the way the docs tell a reader to.

``first_loop.py`` (included whole in docs/getting-started.md): ``torchrun --standalone
--nproc-per-node 2`` over Gloo on the CPU; it trains, clips, saves a sharded checkpoint, reloads
it, and writes a plain torch optimizer state dict that a plain ``torch.optim.AdamW`` loads.
``demo.py`` is launched by ``test_demo.py`` (its short mode, 2 ranks then a resume at 1).
A new file in ``docs/examples/`` fails ``test_every_example_is_launched`` until a test runs it.

The Python blocks of the Markdown docs themselves are run by the root ``conftest.py`` (sybil):
see [Note: Docs run in CI] there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
_EXAMPLES = _ROOT / "docs" / "examples"
_TIMEOUT_S = 300

# docs/examples/<file> -> the test that launches it.
_LAUNCHED_BY = {
    "first_loop.py": "tests-integration/test_docs_examples.py::test_first_loop_under_torchrun",
    "demo.py": "tests-integration/test_demo.py::test_demo_short_mode",
}


def test_every_example_is_launched() -> None:
    scripts = sorted(p.name for p in _EXAMPLES.glob("*.py"))
    assert scripts == sorted(_LAUNCHED_BY), (
        f"docs/examples/ holds {scripts}, the tests launch {sorted(_LAUNCHED_BY)}: every example "
        "must run in CI; add a test that launches the new one (and list it here)"
    )
    for name, test in _LAUNCHED_BY.items():
        path, func = test.split("::")
        assert f"def {func}(" in (_ROOT / path).read_text(), f"{name}: {test} does not exist"


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"ran past {_TIMEOUT_S}s: {' '.join(cmd)}\n{(exc.stdout or b'')[-4000:]!r}")


@pytest.mark.slow
def test_first_loop_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "OUT": str(out)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if torch.cuda.is_available():  # the script picks NCCL when it sees GPUs: keep this on Gloo
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(_EXAMPLES / "first_loop.py"),
    ]  # fmt: skip
    proc = _run(cmd, tmp_path, env)
    log = f"$ {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    assert proc.returncode == 0, f"first_loop.py exited with {proc.returncode}\n{log}"
    assert "step  20" in proc.stdout, f"no training log\n{log}"
    for rank in (0, 1):
        assert f"rank {rank}/2: owns" in proc.stdout, f"rank {rank} did not report its shard\n{log}"
    assert "loaded into a plain torch.optim.AdamW" in proc.stdout, log
    plain = torch.load(out / "adamw.pt", weights_only=True)
    assert len(plain["state"]) == 10, sorted(plain["state"])  # 5 Linear layers: weight + bias
    assert (out / "optim").is_dir(), "no sharded checkpoint directory"
