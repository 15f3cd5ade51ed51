"""The README's first command, in short mode: ``docs/examples/demo.py --short`` launches 2 local
Gloo ranks with ``torchrun --standalone``, trains on the shipped text, saves a sharded checkpoint,
resumes it at 1 rank (a second launch) and writes the loss curve.

Checked from the outside, as a user sees it: exit status 0, the loss fell from the first step of
the first phase to the last step of the resumed one, the second phase continues the first's step
count, ``loss.png`` is a well-formed PNG (signature, chunk CRCs, IHDR, pixel data of the declared
size) with a curve drawn on it (when matplotlib, which the demo's hatch env installs, is importable;
otherwise the demo must say that it skipped the plot), and the checkpoint directory is a committed
shardkit-optim checkpoint that loads offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
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


def _losses(out: Path, phase: str) -> list[tuple[int, float]] | None:
    path = out / f"loss-{phase}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if isinstance(data, dict):  # {"world_size": n, "losses": [[step, loss], ...]}
        data = data["losses"]
    return [(int(s), float(v)) for s, v in data]


@pytest.mark.slow
def test_demo_short_mode(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, str(_DEMO), "--short", "--world-size", "2", "--resume-world-size", "1",
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

    # The loss fell, across the checkpoint and the change of world size.
    train, resume = _losses(out, "train"), _losses(out, "resume")
    if train is not None and resume is not None:
        assert train and resume, log
        assert resume[0][0] == train[-1][0] + 1, f"the resumed run restarted its step count\n{log}"
        first, last = train[0][1], resume[-1][1]
    else:  # the per-phase logs are an implementation detail: fall back to the summary line
        found = re.search(r"loss\s+([0-9.]+)\s*->\s*([0-9.]+)", proc.stdout)
        assert found, f"no loss summary ('loss A -> B') in the demo output\n{log}"
        first, last = float(found.group(1)), float(found.group(2))
    assert last < 0.95 * first, f"the loss did not fall visibly: {first:.4f} -> {last:.4f}\n{log}"

    png = out / "loss.png"
    if importlib.util.find_spec("matplotlib") is None:
        # The plot needs the demo env's matplotlib (`hatch run demo`); without it the demo says so.
        assert "matplotlib is not installed" in proc.stdout and not png.exists(), log
    else:
        _check_plot(png, log)

    ckpt = out / "checkpoint"
    assert (ckpt / "LATEST").is_file(), f"no committed checkpoint at {ckpt}\n{log}"
    state = load_consolidated(ckpt)
    assert state["state"] and state["param_groups"], "the checkpoint holds no optimizer state"


def _check_plot(png: Path, log: str) -> None:
    assert png.is_file(), f"no {png}\n{log}"
    width, height, bpp, rows = _png_rows(png.read_bytes())
    colours = {row[i : i + bpp] for row in rows for i in range(0, len(row), bpp)}
    assert len(colours) >= 3, f"loss.png ({width}x{height}) has {len(colours)} colour(s): no curve"
