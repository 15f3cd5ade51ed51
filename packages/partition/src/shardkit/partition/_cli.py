"""``python -m shardkit.partition``: plan optimizer-state memory per rank from a shape file."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

from shardkit.partition._format import _human, _table
from shardkit.partition._partition import ALGORITHMS, Partition, partition
from shardkit.partition._shapes import available_shapes, load_shapes
from shardkit.partition._spec import param_costs

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardkit.partition",
        description="Plan how parameters (and their optimizer state) spread over ranks.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="per-rank load and imbalance of one or more algorithms")
    plan.add_argument(
        "--shapes",
        required=True,
        help=f"shipped shape name ({', '.join(available_shapes())}) or a JSON file path",
    )
    plan.add_argument("--world", required=True, type=int, nargs="+", help="world size(s)")
    plan.add_argument(
        "--algo",
        action="append",
        help=f"algorithm, repeatable or comma-separated: {', '.join(ALGORITHMS)} or 'all' "
        f"(default: sorted_greedy)",
    )
    plan.add_argument(
        "--bytes-per-element",
        type=float,
        default=None,
        help="optimizer-state bytes per trainable element (e.g. 8 for fp32 Adam, 12 for "
        "mixed-precision Adam); default: the parameter's own element size",
    )
    plan.add_argument("--freeze", default=None, help="regex: freeze parameters whose name matches")
    plan.add_argument(
        "--brief", action="store_true", help="only the comparison, no per-rank tables"
    )
    sub.add_parser("list", help="list the shipped shape files")
    return p


def _algos(values: Sequence[str] | None) -> list[str]:
    if not values:
        return ["sorted_greedy"]
    out: list[str] = []
    for v in values:
        for name in v.split(","):
            name = name.strip()
            if name == "all":
                out.extend(a for a in ALGORITHMS if a not in out)
            elif name not in ALGORITHMS:
                raise ValueError(
                    f"unknown algorithm {name!r}; expected one of {', '.join(ALGORITHMS)}, all"
                )
            elif name not in out:
                out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = _parser().parse_args(argv)
    if args.command == "list":
        rows = []
        for name in available_shapes():
            shapes = load_shapes(name)
            rows.append([name, str(len(shapes.specs)), f"{shapes.numel:,}", shapes.source])
        print(_table(["name", "params", "elements", "source"], rows, left=(0, 3)))
        return 0
    try:
        algos = _algos(args.algo)
        shapes = load_shapes(args.shapes)
        if args.freeze:
            shapes = shapes.freeze(args.freeze)
        costs = param_costs(shapes.specs, per_element=args.bytes_per_element)
        for w in args.world:
            if w < 1:
                raise ValueError(f"--world must be >= 1, got {w}")
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{shapes.name}: {len(shapes.specs)} parameters, {shapes.numel:,} elements "
        f"({sum(1 for s in shapes.specs if not s.requires_grad)} frozen); cost = "
        + (
            "parameter bytes"
            if args.bytes_per_element is None
            else f"{args.bytes_per_element:g} B/element"
        )
    )
    summary: list[list[str]] = []
    for w in args.world:
        for algo in algos:
            t0 = time.perf_counter()
            result: Partition = partition(shapes.specs, w, algorithm=algo, costs=costs)
            loads = list(result.loads)
            bound = result.lower_bound
            ms = (time.perf_counter() - t0) * 1e3
            if not args.brief:
                print()
                print(result.describe())
            mean = math.fsum(loads) / w
            summary.append(
                [
                    str(w),
                    algo,
                    _human(max(loads), "bytes"),
                    _human(bound, "bytes"),
                    f"{max(loads) / bound:.4f}" if bound > 0 else "-",
                    _human(min(loads), "bytes"),
                    f"{result.imbalance:.4f}",
                    f"{bound / mean:.4f}" if mean > 0 else "-",
                    f"{ms:.1f}",
                ]
            )
    if len(summary) > 1 or args.brief:
        print()
        print(
            _table(
                [
                    "world",
                    "algorithm",
                    "max load",
                    "lower bound",
                    "max/bound",
                    "min load",
                    "imbalance",
                    "bound/mean",
                    "ms",
                ],
                summary,
                left=(1,),
            )
        )
        print(
            "lower bound = max(largest param, mean load): no plan's max load is below it; "
            "max/bound <= 1.0000 means optimal"
        )
    return 0
