"""``shardkit-checkpoint inspect|verify`` (and ``python -m shardkit.checkpoint``): what it
prints, its exit status on sound, damaged, crafted and missing checkpoints, the console script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from _ckpt_testkit import model_and_optim, state_of, train
from shardkit.checkpoint import inspect, save
from shardkit.checkpoint._cli import main


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardkit.checkpoint", *args],
        capture_output=True, text=True, timeout=120, check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, opt = model_and_optim()
    train(model, opt, 1)
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    save(state_of(model, opt), path, record={"step": 1, "note": "first"})
    return path


def test_inspect_lists_items_and_record(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "layout     shardkit.checkpoint/1" in out and "world size 1" in out
    assert "record     'note': 'first'" in out
    assert "'model.0.weight'  float32 8x4  128 B" in out
    info = inspect(ckpt)
    assert info["world_size"] == 1 and info["record"]["step"] == "1"
    by_key = {i["key"]: i for i in info["items"]}
    assert by_key["model.0.weight"]["shape"] == [8, 4] and by_key["step"]["kind"] == "object"
    assert main(["inspect", str(ckpt), "--json", "--limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["items"] == info["items"]
    assert main(["inspect", str(ckpt), "--limit", "1"]) == 0
    assert "more (--limit)" in capsys.readouterr().out


def test_verify_exit_status(ckpt: Path, tmp_path: Path) -> None:
    ok = _cli("verify", str(ckpt))
    assert ok.returncode == 0 and "CRC-32 of every stored chunk" in ok.stdout, ok.stderr
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    version = damaged / (damaged / "LATEST").read_text().strip()
    f = next(version.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x20
    f.write_bytes(bytes(data))
    bad = _cli("verify", str(damaged))
    assert (
        bad.returncode == 1 and "ChecksumError" in bad.stderr and "fails its checksum" in bad.stderr
    )
    (version / "SHARDKIT_COMMIT").write_bytes(b"")
    assert _cli("verify", str(damaged)).returncode == 1
    bare = tmp_path / "bare"  # sound files, no commit record: nothing to verify against
    shutil.copytree(ckpt, bare)
    (bare / (bare / "LATEST").read_text().strip() / "SHARDKIT_COMMIT").unlink()
    unverified = _cli("verify", str(bare), "--allow-missing-commit-record")
    assert unverified.returncode == 1 and "no checksums" in unverified.stderr
    missing = _cli("verify", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "is not a committed shardkit checkpoint" in missing.stderr
    assert _cli("frobnicate").returncode == 2


def test_console_script_is_declared() -> None:
    (script,) = entry_points(group="console_scripts", name="shardkit-checkpoint")
    assert script.value == "shardkit.checkpoint._cli:main"
    assert script.load() is main
