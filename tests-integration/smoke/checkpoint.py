"""Smoke test of shardkit-checkpoint installed alone (torch only, no NumPy): one process saves a
model's and an optimizer's state atomically, loads it back verified, a flipped byte is refused
naming the item, a crafted ``.metadata`` is refused without running, and ``verify`` / ``inspect``
and the CLI work."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from shardkit.checkpoint import (
    ChecksumError,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    inspect,
    load,
    save,
    verify,
)
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": seed}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        want = _state(0)
        version = save(want, root / "ckpt", record={"step": 0})
        got = _state(1)
        load(got, root / "ckpt")
        assert got["step"] == 0
        for k, v in want["model"].items():  # type: ignore[attr-defined]
            assert torch.equal(v, got["model"][k]), k  # type: ignore[index]
        assert verify(root / "ckpt").checksums == "storage"
        assert inspect(root / "ckpt")["world_size"] == 1
        cli = subprocess.run(
            [sys.executable, "-m", "shardkit.checkpoint", "verify", str(root / "ckpt")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        f = next(version.glob("*.distcp"))
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 1
        f.write_bytes(bytes(data))
        try:
            load(_state(1), root / "ckpt")
        except UnsafeCheckpointError as exc:
            assert isinstance(exc, ChecksumError) or "damaged" in str(exc), exc
        else:
            raise AssertionError("a flipped byte loaded")

        marker = root / "pwned"
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(root / "plain"), no_dist=True)
        md = pickle.loads((root / "plain" / ".metadata").read_bytes())
        md.planner_data = {"x": _Evil(str(marker))}
        (root / "plain" / ".metadata").write_bytes(pickle.dumps(md))
        try:
            dcp.load(
                {"w": torch.empty(2)},
                storage_reader=SafeFileSystemReader(root / "plain"),
                no_dist=True,
            )
        except CheckpointException as exc:
            assert "is not allowed" in str(exc), exc
        else:
            raise AssertionError("a crafted checkpoint loaded")
        assert not marker.exists()
    print("smoke ok: shardkit-checkpoint")


if __name__ == "__main__":
    main()
