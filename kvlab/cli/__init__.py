"""The `kvlab` command: argument parsing and printing only; every command calls the library.

Each command group is a module with ``register(subparsers)``; a new group is a new module added to
``COMMANDS``.

Example:
    $ kvlab simulate --workload prefix_repetition --passes 2
    >>> main(["simulate", "--workload", "prefix_repetition", "--json"])
    0
"""

from __future__ import annotations

import argparse
import sys

from ..errors import KvlabError
from . import (audit, bench, checkpoints, conformance, loadgen, notebooks, press, proxy, route, serving, setup,
               simulate, workload)

__all__ = ["COMMANDS", "build_parser", "main"]

# the command groups, in the order `kvlab --help` lists them
COMMANDS = (setup, bench, simulate, workload, notebooks, serving, proxy, route, loadgen, checkpoints, conformance,
            audit, press)
# old command names kept for one release: old -> new
RENAMED = {"load": "loadgen", "run": "execute"}


def build_parser() -> argparse.ArgumentParser:
    """The `kvlab` parser with every group's subcommands; each sets ``func(args) -> exit code``."""
    p = argparse.ArgumentParser(prog="kvlab", description="KV-cache and prefix-cache experiments on MLX")
    sub = p.add_subparsers(dest="command", required=True)
    for group in COMMANDS:
        group.register(sub)
    return p


def main(argv=None) -> int:
    """Run one `kvlab` command; a kvlab error prints ``kvlab: error: ...`` and exits 2."""
    args = build_parser().parse_args(argv)
    if args.command in RENAMED:
        print(f"kvlab: `kvlab {args.command}` is deprecated and will be removed in the next release: "
              f"use `kvlab {RENAMED[args.command]}`", file=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KvlabError as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
