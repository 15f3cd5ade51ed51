"""tools/bench.py's rendering of docs/benchmarks.md from pytest-benchmark JSON (no benchmark runs)."""

from __future__ import annotations

import json
import logging
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import bench
import pytest

_MACHINE = {
    "machine_info": {
        "cpu": {"brand_raw": "Test CPU", "count": 2},
        "system": "Linux",
        "machine": "x86_64",
        "python_version": "3.11.7",
    },
    "commit_info": {"id": "0123456789abcdef", "dirty": True},
    "datetime": "2026-11-21T00:34:27.123456",
}


def _stats(median: float, rounds: int) -> dict[str, float]:
    return {
        "median": median, "mean": median * 1.1, "min": median * 0.9, "max": median * 1.5,
        "stddev": median * 0.1 if rounds > 1 else 0.0, "rounds": rounds,
        "q1": median * 0.95, "q3": median * 1.05,
    }  # fmt: skip


def _write(root: Path, name: str, benchmarks: list[dict[str, Any]]) -> Path:
    out = root / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    # json.dumps writes NaN as the bare token NaN, as pytest-benchmark does.
    path.write_text(json.dumps({**_MACHINE, "benchmarks": benchmarks}))
    return path


def _fixture(root: Path) -> Path:
    return _write(
        root,
        "optim",
        [
            {
                "name": "test_bench_step",
                "stats": _stats(52.1, 1),
                "extra_info": {
                    "step_ratio_vs_ddp": 0.8144,
                    "step_ratio_vs_ddp_q1": 0.7,
                    "step_ratio_vs_ddp_q3": 0.9,
                    "consolidation_speedup_ratio_vs_fairscale": 4.1406,
                    "broken_ratio": float("nan"),
                    "loadavg_1min": [0.2197, 1.1513],
                    "results": {
                        "ddp_adam": {
                            "step_s": 0.561,
                            "state_bytes": 268566592.0,
                            "consolidate_s": float("nan"),
                        },
                        "shardkit": {
                            "step_s": 0.457,
                            "state_bytes": 134283296.0,
                            "consolidate_s": 0.1445,
                        },
                    },
                },
            },
            {
                "name": "test_timed[flat]",
                "stats": _stats(0.0376, 15),
                "extra_info": {"params": 200},
            },
            {"name": "test_timed[per_param]", "stats": _stats(1.963, 15), "extra_info": {}},
        ],
    )


def test_render_tables_ratios_first_no_nan(tmp_path: Path) -> None:
    _fixture(tmp_path)
    page = bench.render(tmp_path, tmp_path / "docs" / "benchmarks", plots=False)
    assert "nan" not in page.lower()
    section = page[page.index("## shardkit-optim") :]
    ratios = section.index("### Ratios against the references")
    absolute = section.index("### Absolute figures")
    machine = section.index("Machine: Test CPU, 2 logical cores, Linux x86_64, Python 3.11.7")
    assert ratios < absolute < machine
    # Quartiles recorded beside a ratio (`<ratio>_q1/_q3`) show as its range, not as ratios.
    assert "| `bench_step` | `step_ratio_vs_ddp` | 0.814x (0.700x to 0.900x) |" in section
    assert "`step_ratio_vs_ddp_q1`" not in section
    assert "|  | `consolidation_speedup_ratio_vs_fairscale` | 4.14x |" in section
    assert "broken_ratio" not in section  # a NaN ratio was not measured: left out
    # The per-implementation table: units from the key names, '-' where nothing was measured.
    assert "| `results` | `step_s` | `state_bytes` | `consolidate_s` |" in section
    assert "| `ddp_adam` | 561.00 ms | 256.1 MiB | - |" in section
    assert "| `shardkit` | 457.00 ms | 128.1 MiB | 144.50 ms |" in section
    # Repeated timings get a table; the one-shot harness is named as such.
    assert "| `timed[flat]` | 37.60 ms | 33.84 ms | 41.36 ms ± 3.76 ms | 15 |" in section
    assert "Single-round harnesses (`bench_step`)" in section
    assert "run 2026-11-21 00:34 UTC at commit 0123456 (with uncommitted changes)" in section
    assert "![" not in page


def _png_with_text(path: Path, key: str, value: str) -> None:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"tEXt", key.encode() + b"\0" + value.encode())
        + chunk(b"IDAT", zlib.compress(b"\x00\x00"))
        + chunk(b"IEND", b"")
    )


def test_without_matplotlib_only_up_to_date_plots_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    optim = _fixture(tmp_path)
    stale = _write(
        tmp_path, "buckets", [{"name": "test_x", "stats": _stats(1.0, 3), "extra_info": {}}]
    )
    out = tmp_path / "docs" / "benchmarks"
    _png_with_text(out / "optim.png", bench._DIGEST_KEY, bench._digest(optim))
    _png_with_text(out / "buckets.png", bench._DIGEST_KEY, "0" * 16)  # drawn from older JSON
    assert bench._digest(stale) != "0" * 16
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with caplog.at_level(logging.INFO, logger="shardkit.tools.bench"):
        page = bench.render(tmp_path, out)
    assert "![shardkit-optim benchmarks](benchmarks/optim.png)" in page
    assert "buckets.png" not in page
    assert "matplotlib is not installed: plots not redrawn (kept 1 up-to-date PNG(s) of 2)" in (
        caplog.text
    )


def test_plots_are_drawn_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is in the demo env (hatch run demo:...)")
    optim = _fixture(tmp_path)
    out = tmp_path / "docs" / "benchmarks"
    page = bench.render(tmp_path, out)
    assert "![shardkit-optim benchmarks](benchmarks/optim.png)" in page
    assert bench._png_text(out / "optim.png")[bench._DIGEST_KEY] == bench._digest(optim)


def test_render_only_command_line_runs_no_benchmark(tmp_path: Path) -> None:
    _fixture(tmp_path)
    (tmp_path / "packages").mkdir()
    assert bench.main(["--render-only", "--no-plots", "--root", str(tmp_path)]) == 0
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks\n") and "| `bench_step` | `step_ratio_vs_ddp` |" in page
