"""Command line: ``python -m shardkit.optim consolidate CKPT_DIR OUT.pt``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from shardkit.optim._checkpoint import load_consolidated

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m shardkit.optim",
        description="Tools for shardkit.optim sharded checkpoints.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser(
        "consolidate",
        help="turn a sharded DCP checkpoint into one plain torch optimizer state dict",
    )
    cons.add_argument("checkpoint", help="directory written by shardkit.optim.save_sharded")
    cons.add_argument("output", help="file to write with torch.save")
    cons.add_argument(
        "--allow-pickle",
        action="store_true",
        help="also read a format-1 checkpoint, whose records are pickles: loading it can run "
        "code its writer put there; only for checkpoints you trust (docs/security.md)",
    )
    cons.add_argument(
        "--allow-missing-commit-record",
        action="store_true",
        help="read a version whose SHARDKIT_COMMIT record is missing or damaged (see "
        "load_consolidated's docstring for what stays verified)",
    )
    args = parser.parse_args(argv)
    try:
        sd = load_consolidated(
            args.checkpoint,
            allow_pickle=args.allow_pickle,
            allow_missing_commit_record=args.allow_missing_commit_record,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.save(sd, args.output)
    n = sum(len(g["params"]) for g in sd["param_groups"])
    print(f"wrote {args.output}: {n} params, {len(sd['state'])} with state")
    return 0
