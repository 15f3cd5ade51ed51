#!/usr/bin/env python3
"""Run every package's benchmarks and write docs/benchmarks.md plus the raw JSON.

Each package's ``benchmarks/bench_*.py`` runs in its own pytest process (benchmarks may own the
process's default process group), with pytest-benchmark writing
``docs/benchmarks/<package>.json``. The Markdown page then shows, per package, a plot, the ratios
each benchmark recorded in ``extra_info`` first, then the absolute figures (timings, and the
figures each benchmark recorded, per implementation where it recorded a table), then the machine
the figures come from (read from the JSON). NaN figures (not measured) show as ``-``.

Plots (``docs/benchmarks/<package>.png``) are drawn with matplotlib, which is not a dependency of
the default env: ``hatch run demo:bench-plots`` renders in the demo env, which has it. Without
matplotlib the page keeps the existing PNGs that were drawn from the same JSON bytes (a digest is
stored in each PNG) and a note is logged.

GPU figures live apart, in ``docs/benchmarks/gpu/<package>.json`` (the CUDA benchmarks only,
``-k cuda``), with the device, torch, CUDA and NCCL versions recorded beside pytest-benchmark's
machine info; the page shows them in their own section.

Usage:
    python tools/bench.py                 # all packages
    python tools/bench.py optim buckets   # some packages
    python tools/bench.py --gpu offload   # the CUDA benchmarks, on a machine with a GPU
    python tools/bench.py --render-only   # rebuild docs/benchmarks.md from the JSON files
    python tools/bench.py --render-only --no-plots   # tables only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "render"]

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("shardkit.tools.bench")


def _packages(root: Path) -> list[str]:
    return sorted(
        p.name for p in (root / "packages").iterdir() if list((p / "benchmarks").glob("bench_*.py"))
    )


def _run(root: Path, package: str, out_dir: Path, extra: list[str]) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{package}.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-o",
        "python_files=bench_*.py",
        "-p",
        "no:cacheprovider",
        f"--benchmark-json={json_path}",
        str(root / "packages" / package / "benchmarks"),
        *extra,
    ]
    print(f"=== {package}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    rc = subprocess.call(cmd, cwd=root)
    print(f"=== {package}: exit {rc} in {time.monotonic() - start:.0f}s", flush=True)
    return rc


def _record_device(json_path: Path) -> None:
    """Adds the GPU, driver-side versions and host to a GPU run's JSON (``shardkit_device``)."""
    import torch

    data = json.loads(json_path.read_text())
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    data["shardkit_device"] = {
        "gpu": f"{props.name} ({props.total_memory // 2**20} MiB)",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": nccl,
        "host": f"{os.cpu_count()} CPU cores",
        "python": platform.python_version(),
    }
    json_path.write_text(json.dumps(data, indent=1))


def _finite(value: Any) -> bool:
    """A real number that is not NaN or infinite (``bool`` excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt_seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def _fmt_number(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.4g}" if abs(value) >= 1e4 else f"{value:.3g}"


def _fmt_value(key: str, value: Any) -> str:
    """A recorded figure with the unit its key names (``_s``, ``_ms``, ``_mb``, ``bytes``); NaN: -."""
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt_value(key, v) for v in value) or "-"
    if not _finite(value):
        return "-"
    if key.endswith("_s"):
        return _fmt_seconds(value)
    if key.endswith("_ms"):
        return _fmt_seconds(value / 1e3)
    if key.endswith(("_mb", "_mib")):
        return f"{value:,.1f} MiB"
    if key.endswith("bytes"):
        return f"{value / 2**20:,.1f} MiB"
    return _fmt_number(value)


def _is_ratio(key: str) -> bool:
    return any(part in key for part in ("ratio", "_over_", "_vs_", "speedup")) or key.endswith("_x")


def _fmt_ratio(value: float) -> str:
    """Three significant digits, but never fewer than two decimals below 10 (1.00x, 0.814x)."""
    if abs(value) < 1:
        return f"{value:.3f}x"
    return f"{value:.2f}x" if abs(value) < 10 else f"{value:.3g}x"


def _short(name: str) -> str:
    return name.removeprefix("test_")


def _machine(data: dict[str, Any]) -> str:
    """Where and when the figures were measured (from the JSON, not from this machine)."""
    device = data.get("shardkit_device")
    when = data.get("datetime", "")[:16].replace("T", " ")
    commit = data.get("commit_info", {})
    at = ""
    if commit.get("id"):
        at = f" at commit {commit['id'][:7]}" + (
            " (with uncommitted changes)" if commit.get("dirty") else ""
        )
    if device:
        return (
            f"{device['gpu']}; {device['host']}; torch {device['torch']}, CUDA {device['cuda']}, "
            f"NCCL {device['nccl']}, Python {device['python']}; run {when} UTC{at}"
        )
    info = data.get("machine_info", {})
    cpu_info = info.get("cpu", {})
    cpu = cpu_info.get("brand_raw") or info.get("processor") or "unknown CPU"
    cores = f", {cpu_info['count']} logical cores" if cpu_info.get("count") else ""
    system = " ".join(x for x in (info.get("system"), info.get("machine")) if x)
    return (
        f"{cpu}{cores}, {system or 'unknown OS'}, Python {info.get('python_version', '?')}; "
        f"run {when} UTC{at}"
    )


_QUARTILES = ("_q1", "_q3")


def _quartile_of(key: str, info: dict[str, Any]) -> bool:
    """Whether ``key`` is ``<ratio>_q1`` / ``<ratio>_q3`` of a ratio ``<ratio>`` in ``info``:
    shown with that ratio (whiskers, a range), not as a ratio of its own."""
    return key.endswith(_QUARTILES) and key[:-3] in info


def _ratios(benches: list[dict[str, Any]]) -> list[tuple[str, str, float]]:
    return [
        (_short(b["name"]), k, float(v))
        for b in benches
        for k, v in b.get("extra_info", {}).items()
        if _is_ratio(k) and _finite(v) and not _quartile_of(k, b.get("extra_info", {}))
    ]


def _ratio_range(benches: list[dict[str, Any]], name: str, key: str) -> tuple[float, float] | None:
    """The quartiles recorded beside ratio ``key`` of benchmark ``name`` (``<key>_q1/_q3``)."""
    for b in benches:
        info = b.get("extra_info", {})
        if _short(b["name"]) == name and all(_finite(info.get(key + q)) for q in _QUARTILES):
            return float(info[key + "_q1"]), float(info[key + "_q3"])
    return None


def _timed(benches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Benchmarks with enough rounds for their timing to be the figure (not a one-shot harness)."""
    return [
        b for b in benches if b["stats"].get("rounds", 0) >= 3 and _finite(b["stats"]["median"])
    ]


def _ratio_table(benches: list[dict[str, Any]]) -> list[str]:
    rows = _ratios(benches)
    if not rows:
        return []
    out = ["| benchmark | ratio | value |", "|---|---|---:|"]
    previous = None
    for name, key, value in rows:
        shown = f"`{name}`" if name != previous else ""
        quartiles = _ratio_range(benches, name, key)
        spread = "" if quartiles is None else " ({} to {})".format(*map(_fmt_ratio, quartiles))
        out.append(f"| {shown} | `{key}` | {_fmt_ratio(value)}{spread} |")
        previous = name
    return [*out, ""]


def _timing_table(benches: list[dict[str, Any]]) -> list[str]:
    out = [
        "| benchmark | median | min | mean ± stddev | rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    for b in benches:
        st = b["stats"]
        spread = (
            f"{_fmt_seconds(st['mean'])} ± {_fmt_seconds(st['stddev'])}"
            if st.get("rounds", 0) >= 2 and _finite(st.get("stddev"))
            else "-"
        )
        minimum = _fmt_seconds(st["min"]) if st.get("rounds", 0) >= 2 else "-"
        out.append(
            f"| `{_short(b['name'])}` | {_fmt_seconds(st['median'])} | {minimum} | {spread} "
            f"| {st.get('rounds', '-')} |"
        )
    return [*out, ""]


def _nested_tables(bench: dict[str, Any]) -> list[str]:
    """One table per dict-of-dicts figure (``results``: row, e.g. implementation -> measure -> value)."""
    out: list[str] = []
    for key, value in bench.get("extra_info", {}).items():
        if not isinstance(value, dict) or not value:
            continue
        if all(isinstance(v, dict) for v in value.values()):
            columns: list[str] = []
            for row in value.values():
                columns += [c for c in row if c not in columns and any(
                    _finite(r.get(c)) or isinstance(r.get(c), str) for r in value.values()
                )]  # fmt: skip
            out += [
                f"`{_short(bench['name'])}`, `{key}`:",
                "",
                f"| `{key}` | " + " | ".join(f"`{c}`" for c in columns) + " |",
                "|---|" + "---:|" * len(columns),
            ]
            for impl, row in value.items():
                cells = [_fmt_value(c, row.get(c)) for c in columns]
                out.append(f"| `{impl}` | " + " | ".join(cells) + " |")
            out.append("")
    return out


def _figure_rows(bench: dict[str, Any]) -> list[tuple[str, str]]:
    """Non-ratio figures of a benchmark as (key, formatted value); flat dicts are expanded."""
    rows: list[tuple[str, str]] = []
    for key, value in bench.get("extra_info", {}).items():
        if _is_ratio(key):
            continue
        if isinstance(value, dict):
            if value and all(isinstance(v, dict) for v in value.values()):
                continue  # rendered by _nested_tables
            rows += [
                (f"{key}.{k}", _fmt_value(k, v))
                for k, v in value.items()
                if _finite(v) or isinstance(v, str)
            ]
        elif _finite(value) or isinstance(value, (str, list)):
            rows.append((key, _fmt_value(key, value)))
    return rows


def _figures_table(benches: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for b in benches:
        out += _nested_tables(b)
    rows = [(b, k, v) for b in benches for k, v in _figure_rows(b)]
    if rows:
        out += ["| benchmark | figure | value |", "|---|---|---:|"]
        previous = None
        for b, key, value in rows:
            name = _short(b["name"])
            out.append(f"| {f'`{name}`' if name != previous else ''} | `{key}` | {value} |")
            previous = name
        out.append("")
    return out


# ----------------------------------------------------------------------------- plots

_DIGEST_KEY = "shardkit-bench-source"


def _digest(json_path: Path) -> str:
    return hashlib.sha256(json_path.read_bytes()).hexdigest()[:16]


def _png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG (read without matplotlib): {} when unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return {}
    pos, out = 8, {}
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"tEXt" and b"\0" in body:
            k, v = body.split(b"\0", 1)
            out[k.decode("latin-1")] = v.decode("latin-1")
        if kind == b"IEND":
            break
        pos += 12 + length
    return out


def _plot_name(json_path: Path, out_dir: Path) -> str:
    gpu = json_path.parent != out_dir
    return f"{'gpu-' if gpu else ''}{json_path.stem}.png"


def _plot(json_path: Path, data: dict[str, Any], png: Path, title: str) -> bool:
    """Writes ``png``: the ratios (1 = the reference) and the repeated timings; False if nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = data.get("benchmarks", [])
    ratios, timed = _ratios(benches), _timed(benches)
    panels = [p for p in ("ratios", "timings") if (ratios if p == "ratios" else len(timed) >= 2)]
    if not panels:
        return False
    heights = [
        max(1.6, 0.28 * (len(ratios) if p == "ratios" else len(timed)) + 0.9) for p in panels
    ]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, sum(heights)), dpi=110, squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )  # fmt: skip
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        if panel == "ratios":
            labels = [f"{name}: {key}" for name, key, _ in ratios]
            values = [v for _, _, v in ratios]
            ranges = [_ratio_range(benches, name, key) for name, key, _ in ratios]
            err = [
                [v - r[0] if r else 0.0 for v, r in zip(values, ranges, strict=True)],
                [r[1] - v if r else 0.0 for v, r in zip(values, ranges, strict=True)],
            ]
            y = range(len(values))
            # whether higher is better depends on the ratio; whiskers: recorded quartiles
            ax.barh(y, values, xerr=err, color="tab:blue", ecolor="0.3", capsize=2)
            ax.axvline(1.0, color="0.2", lw=1, ls="--")
            ax.set_yticks(list(y), labels, fontsize=7)
            ax.invert_yaxis()
            if max(values) / max(min(values), 1e-12) > 50:
                ax.set_xscale("log")
            ax.set_xlabel(
                "ratio (shardkit / reference, same run; dashed: parity; whiskers: quartiles)"
            )
            for yi, v, r in zip(y, values, ranges, strict=True):
                ax.annotate(_fmt_ratio(v), (max(v, r[1]) if r else v, yi), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=7)  # fmt: skip
        else:
            names = [_short(b["name"]) for b in timed]
            med = [b["stats"]["median"] * 1e3 for b in timed]
            err = [
                [max(0.0, (b["stats"]["median"] - b["stats"]["q1"]) * 1e3) for b in timed],
                [max(0.0, (b["stats"]["q3"] - b["stats"]["median"]) * 1e3) for b in timed],
            ]
            y = range(len(med))
            ax.barh(y, med, xerr=err, color="tab:blue", ecolor="0.3", capsize=2)
            ax.set_yticks(list(y), names, fontsize=7)
            ax.invert_yaxis()
            if max(med) / max(min(med), 1e-12) > 50:
                ax.set_xscale("log")
            ax.set_xlabel("median time per round (ms); whiskers: interquartile range")
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, metadata={_DIGEST_KEY: _digest(json_path)})
    plt.close(fig)
    return True


def _plots(out_dir: Path, jsons: list[Path], plots: bool | None) -> dict[Path, str]:
    """{json: PNG file name} for the plots to embed.

    ``plots`` True: (re)draw them with matplotlib; None: draw if matplotlib is importable, else
    keep only the existing PNGs drawn from the same JSON bytes (a digest stored in the PNG),
    logging a note; False: none.
    """
    if plots is False:
        return {}
    if plots is None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            kept = {
                j: _plot_name(j, out_dir)
                for j in jsons
                if _png_text(out_dir / _plot_name(j, out_dir)).get(_DIGEST_KEY) == _digest(j)
            }
            log.warning(
                "matplotlib is not installed: plots not redrawn (kept %d up-to-date PNG(s) of %d); "
                "`hatch run demo:bench-plots` redraws them",
                len(kept), len(jsons),
            )  # fmt: skip
            return kept
    made: dict[Path, str] = {}
    for j in jsons:
        name = _plot_name(j, out_dir)
        gpu = j.parent != out_dir
        title = f"shardkit-{j.stem}" + (" on GPU" if gpu else "")
        if _plot(j, json.loads(j.read_text()), out_dir / name, title):
            made[j] = name
        else:
            (out_dir / name).unlink(missing_ok=True)
    log.info("drew %d plot(s) in %s", len(made), out_dir)
    return made


def render(root: Path, out_dir: Path, plots: bool | None = None) -> str:
    """The Markdown page for every ``<package>.json`` under ``out_dir`` (and ``out_dir/gpu``).

    Per package: a plot (when drawn, see ``_plots``), the ratios against the references, the
    absolute figures, then the machine. NaN figures (not measured) show as ``-`` or are left out.
    """
    jsons = [*sorted(out_dir.glob("*.json")), *sorted((out_dir / "gpu").glob("*.json"))]
    pngs = _plots(out_dir, jsons, plots)
    rel = (
        out_dir.relative_to(root / "docs").as_posix()
        if out_dir.is_relative_to(root / "docs")
        else str(out_dir)
    )
    lines = [
        "# Benchmarks",
        "",
        "Generated by tools/bench.py from the pytest-benchmark JSON files in `docs/benchmarks/`",
        "(`hatch run bench` measures and rewrites them; `python tools/bench.py --render-only`",
        "only rebuilds this page). Do not edit by hand.",
        "",
        "Each package section shows first the **ratios** its benchmarks recorded against the",
        "reference implementations measured in the same run (`X_ratio_vs_Y` is shardkit's X",
        "divided by reference Y's: below 1 means less time or memory than the reference;",
        "`speedup` ratios are the other way round, above 1 is faster), then the **absolute",
        "figures**, then the **machine** they come from. Absolute times on a shared 2-core VM are",
        "noisy; the ratios are the figures to compare. `-` marks a figure that was not measured.",
        "",
    ]
    for json_path in jsons:
        data = json.loads(json_path.read_text())
        gpu = json_path.parent != out_dir
        benches = data.get("benchmarks", [])
        lines += [f"## shardkit-{json_path.stem}" + (" on GPU" if gpu else ""), ""]
        if json_path in pngs:
            lines += [f"![shardkit-{json_path.stem} benchmarks]({rel}/{pngs[json_path]})", ""]
        ratio_table = _ratio_table(benches)
        if ratio_table:
            lines += ["### Ratios against the references", "", *ratio_table]
        lines += ["### Absolute figures", ""]
        timed = _timed(benches)
        if timed:
            lines += _timing_table(timed)
        once = [b for b in benches if b not in timed]
        if once:
            names = ", ".join(f"`{_short(b['name'])}`" for b in once)
            lines += [
                f"Single-round harnesses ({names}) time their own runs inside; their figures:",
                "",
            ]
        lines += _figures_table(benches)
        lines += [f"Machine: {_machine(data)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("packages", nargs="*", help="packages to benchmark (default: all)")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rebuild docs/benchmarks.md (and the plots) from the JSON files; run nothing",
    )
    parser.add_argument(
        "--no-plots", action="store_true", help="write the tables only (no matplotlib needed)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="run the CUDA benchmarks into docs/benchmarks/gpu/"
    )
    parser.add_argument("--pytest-args", default="", help="extra arguments for pytest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="bench: %(message)s")
    root: Path = args.root.resolve()
    out_dir = root / "docs" / "benchmarks"
    failures: list[str] = []
    if not args.render_only:
        available = _packages(root)
        chosen = args.packages or available
        unknown = sorted(set(chosen) - set(available))
        if unknown:
            parser.error(f"no benchmarks for {unknown}; packages with benchmarks: {available}")
        extra = args.pytest_args.split() + (["-k", "cuda"] if args.gpu else [])
        run_dir = out_dir / "gpu" if args.gpu else out_dir
        for package in chosen:
            if _run(root, package, run_dir, extra) != 0:
                failures.append(package)
            elif args.gpu:
                _record_device(run_dir / f"{package}.json")
    (root / "docs" / "benchmarks.md").write_text(
        render(root, out_dir, plots=False if args.no_plots else None)
    )
    print(f"wrote {root / 'docs' / 'benchmarks.md'}")
    if failures:
        print(f"benchmarks failed for: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
