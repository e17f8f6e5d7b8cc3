"""`kvlab bench`: the side-by-side benchmark tables, printed as they finish and optionally
appended to a markdown file."""

from __future__ import annotations

import os
import time


def register(sub) -> None:
    from ..bench import SECTIONS

    s = sub.add_parser("bench", help="side-by-side benchmarks (median and spread over repeats)")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--only", default=None, help=f"comma-separated: {','.join(SECTIONS)}")
    s.add_argument("--write", default=None, help="append the tables to this markdown file")
    s.add_argument("--ttft-system-tokens", type=int, default=1000,
                   help="system prompt size of the TTFT agentic loop")
    s.set_defaults(func=bench)


def bench(args) -> int:
    from ..bench import machine, run

    only = args.only.split(",") if args.only else None
    started = time.perf_counter()
    if args.write:
        header = f"## Run of {time.strftime('%Y-%m-%d %H:%M')} — {machine()}\n\n"
        existing = open(args.write).read() if os.path.exists(args.write) else "# kvlab benchmarks\n\n"
        _replace(args.write, existing.rstrip() + "\n\n" + header)

    def emit(table) -> None:
        text = table.markdown()
        print(text, flush=True)
        if args.write:
            _replace(args.write, open(args.write).read() + text + "\n")

    run(args.model, args.repeats, only, on_table=emit, ttft_system_tokens=args.ttft_system_tokens)
    if args.write:
        print(f"kvlab: appended to {args.write} ({time.perf_counter() - started:.0f} s)")
    return 0


def _replace(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a killed run never leaves half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
