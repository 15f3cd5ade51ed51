"""Command line: ``shardkit-checkpoint inspect|verify PATH`` (or ``python -m shardkit.checkpoint``).

Exit status: 0 the checkpoint is sound (``verify``) or was listed (``inspect``); 1 it is damaged
or crafted, or ``verify`` had nothing to check against; 2 no committed checkpoint at ``PATH`` or
bad usage. Everything printed from the checkpoint is described with bounds (see [Note: Bounded
work on untrusted input]).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from shardkit.checkpoint._describe import describe
from shardkit.checkpoint._verify import inspect, verify

__all__ = ["main"]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _print_inspect(info: dict[str, Any], limit: int) -> None:
    print(f"checkpoint {info['path']}")
    print(f"  version    {info['version']}")
    print(f"  layout     {info['layout'] or '(none: shardkit-optim 0.3 or earlier, or no record)'}")
    print(f"  world size {info['world_size']}, token {info['token']}")
    for k, v in info["record"].items():
        print(f"  record     {describe(k)}: {v}")
    items = info["items"]
    print(f"  {len(items)} items, {_human(info['total_bytes'])}")
    for item in items[:limit]:
        shape = "" if item["shape"] is None else "x".join(map(str, item["shape"])) or "()"
        kind = f"{item['dtype']} {shape}" if item["kind"] == "tensor" else "object"
        chunks = f", {item['chunks']} chunks" if item["chunks"] > 1 else ""
        print(f"    {describe(item['key'], 1)}  {kind}  {_human(item['bytes'])}{chunks}")
    if len(items) > limit:
        print(f"    ... {len(items) - limit} more (--limit)")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="shardkit-checkpoint",
        description="Inspect and verify torch.distributed.checkpoint checkpoints safely (no "
        "code from the checkpoint runs).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="list the items of a checkpoint (reads no payload)")
    ins.add_argument("path", help="a directory written by shardkit.checkpoint.save")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ins.add_argument("--limit", type=int, default=50, help="items listed (default 50)")
    ver = sub.add_parser(
        "verify", help="read every stored chunk and check it (CRC-32, structure, sizes)"
    )
    ver.add_argument("path", help="a directory written by shardkit.checkpoint.save")
    for p in (ins, ver):
        p.add_argument(
            "--allow-missing-commit-record",
            action="store_true",
            help="open a version whose commit record is missing or damaged (nothing is then "
            "checked against checksums)",
        )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            info = inspect(args.path, allow_missing_commit_record=args.allow_missing_commit_record)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                _print_inspect(info, max(args.limit, 0))
            return 0
        report = verify(args.path, allow_missing_commit_record=args.allow_missing_commit_record)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"damaged or crafted: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if report.checksums == "none":
        print(
            f"{report.version}: structure and sizes of {report.chunks} stored chunks are sound, "
            f"but there are no checksums to verify the bytes against",
            file=sys.stderr,
        )
        return 1
    what = "stored chunk" if report.checksums == "storage" else "item"
    print(
        f"ok: {report.version}: {report.items} items, {report.chunks} stored chunks, "
        f"{_human(report.nbytes)} verified (CRC-32 of every {what})"
    )
    return 0
