"""The README's first command, in short mode: ``docs/examples/demo.py --short`` launches 2 local
Gloo ranks with ``torchrun --standalone``, trains on the shipped text with ZeRO-2
(``ShardedDataParallel``) and, on the same batches, with DDP + AdamW, checkpoints both through
shardkit-checkpoint, resumes both at 3 ranks (a second launch) and plots the loss and the bytes
per parameter each rank held.

Checked from the outside, as a user sees it: exit status 0, the loss fell from the first step of
the first phase to the last step of the resumed one, the second phase continues the first's step
count, ZeRO-2's loss follows DDP's (within 1e-4 per step: the same math, reduced in another
order), ZeRO-2 held fewer bytes per parameter than DDP on every rank at both world sizes (about
``4 + 12/N`` against 16 for fp32 AdamW), ``loss.png`` is a well-formed PNG (signature, chunk CRCs,
IHDR, pixel data of the declared size) with curves drawn on it (when matplotlib, which the demo's
hatch env installs, is importable; otherwise the demo must say that it skipped the plot), and the
checkpoints are committed and verify (``shardkit.checkpoint.verify``), the sharded optimizer one
loading offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from shardkit.checkpoint import verify
from shardkit.optim import load_consolidated

_DEMO = Path(__file__).resolve().parents[1] / "docs" / "examples" / "demo.py"
_TIMEOUT_S = 480
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel (8-bit, no palette)


def _png_rows(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """Validates a PNG and returns (width, height, bytes per pixel, unfiltered rows)."""
    assert data.startswith(_PNG_SIGNATURE), f"not a PNG: starts with {data[:8]!r}"
    pos, chunks = len(_PNG_SIGNATURE), []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert len(body) == length, f"chunk {kind!r} truncated"
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"chunk {kind!r} has a bad CRC"
        chunks.append((kind, body))
        pos += 12 + length
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert width > 0 and height > 0, (width, height)
    assert depth == 8 and colour in _CHANNELS and interlace == 0, (depth, colour, interlace)
    bpp = _CHANNELS[colour]
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    stride = 1 + width * bpp
    assert len(raw) == height * stride, (
        f"pixel data is {len(raw)} bytes, expected {height * stride}"
    )
    rows, prev = [], bytes(width * bpp)
    for y in range(height):
        kind, line = raw[y * stride], bytearray(raw[y * stride + 1 : (y + 1) * stride])
        assert kind <= 4, f"row {y}: unknown filter type {kind}"
        for i in range(len(line)):  # undo the PNG row filters
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = bytes(line)
    return width, height, bpp, rows


def _record(out: Path, phase: str) -> dict[str, object]:
    """``{"world_size": n, "zero2" / "ddp": {"losses": [[step, loss]], "bytes_per_param": [..]}}``"""
    path = out / f"loss-{phase}.json"
    assert path.is_file(), f"no {path}"
    data: dict[str, object] = json.loads(path.read_text())
    return data


def _losses(record: dict[str, object], job: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in record[job]["losses"]]  # type: ignore[index]


@pytest.mark.slow
def test_demo_short_mode(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, str(_DEMO), "--short", "--world-size", "2", "--resume-world-size", "3",
        "--out", str(out),
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-4000:]
        pytest.fail(f"the demo ran past {_TIMEOUT_S}s: {' '.join(cmd)}\n{tail!r}")
    log = f"$ {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"the demo exited with {proc.returncode}\n{log}"

    # The loss fell, across the checkpoint and the change of world size; ZeRO-2 follows DDP.
    records = {phase: _record(out, phase) for phase in ("train", "resume")}
    assert [r["world_size"] for r in records.values()] == [2, 3], log
    train, resume = _losses(records["train"], "zero2"), _losses(records["resume"], "zero2")
    assert train and resume, log
    assert resume[0][0] == train[-1][0] + 1, f"the resumed run restarted its step count\n{log}"
    first, last = train[0][1], resume[-1][1]
    assert last < 0.95 * first, f"the loss did not fall visibly: {first:.4f} -> {last:.4f}\n{log}"
    for phase, record in records.items():
        zero2, ddp = _losses(record, "zero2"), _losses(record, "ddp")
        assert [s for s, _ in zero2] == [s for s, _ in ddp], log
        gap = max(abs(a - b) for (_, a), (_, b) in zip(zero2, ddp, strict=True))
        assert gap < 1e-4, f"{phase}: ZeRO-2's loss left DDP's by {gap}\n{log}"
        held = record["zero2"]["bytes_per_param"], record["ddp"]["bytes_per_param"]  # type: ignore[index]
        n = record["world_size"]
        assert all(z < 0.8 * d for z, d in zip(*held, strict=True)), (phase, held)
        assert all(15.9 < d < 17 for d in held[1]), (phase, held)  # fp32 params, grads, 2 moments
        # params 4, grad shard and AdamW state 12/N, the staging pool of two 0.25 MiB buckets
        # and, on Gloo, two receive buffers of (N-1)/N of one (shardkit.optim's [Note: Gloo
        # reduce-scatter point to point])
        assert all(-0.1 < z - (4 + 12 / n) < 1.8 for z in held[0]), (phase, n, held)  # type: ignore[operator]

    png = out / "loss.png"
    if importlib.util.find_spec("matplotlib") is None:
        # The plot needs the demo env's matplotlib (`hatch run demo`); without it the demo says so.
        assert "matplotlib is not installed" in proc.stdout and not png.exists(), log
    else:
        _check_plot(png, log)

    ckpt = out / "checkpoint"
    for name in ("zero2-model", "zero2-optimizer", "ddp"):
        assert (ckpt / name / "LATEST").is_file(), (
            f"no committed checkpoint at {ckpt / name}\n{log}"
        )
        assert verify(ckpt / name).checksums in ("storage",), name
    state = load_consolidated(ckpt / "zero2-optimizer")
    assert state["state"] and state["param_groups"], "the checkpoint holds no optimizer state"


def _check_plot(png: Path, log: str) -> None:
    assert png.is_file(), f"no {png}\n{log}"
    width, height, bpp, rows = _png_rows(png.read_bytes())
    colours = {row[i : i + bpp] for row in rows for i in range(0, len(row), bpp)}
    assert len(colours) >= 3, f"loss.png ({width}x{height}) has {len(colours)} colour(s): no curve"


@pytest.mark.slow
def test_demo_short_mode_with_the_int8_wire(tmp_path: Path) -> None:
    """``--wire int8``: the same two launches with ZeRO-2's quantized collectives; the loss
    falls across the resume and stays within 2 % of DDP's on the same batches."""
    out = tmp_path / "demo-out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, str(_DEMO), "--short", "--world-size", "2", "--resume-world-size", "3",
        "--out", str(out), "--wire", "int8",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    log = f"$ {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"the demo exited with {proc.returncode}\n{log}"
    records = {phase: _record(out, phase) for phase in ("train", "resume")}
    train, resume = _losses(records["train"], "zero2"), _losses(records["resume"], "zero2")
    assert resume[0][0] == train[-1][0] + 1, log
    assert resume[-1][1] < 0.95 * train[0][1], log
    for phase, record in records.items():
        zero2, ddp = _losses(record, "zero2"), _losses(record, "ddp")
        gap = max(abs(a - b) / b for (_, a), (_, b) in zip(zero2, ddp, strict=True))
        assert gap < 0.02, f"{phase}: the int8 wire's loss left DDP's by {gap:.2%}\n{log}"
