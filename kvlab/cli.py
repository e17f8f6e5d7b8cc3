"""The `kvlab` command. Every subcommand is a thin shell over a library function."""

from __future__ import annotations

import argparse
import json
import sys

from . import _blas

_blas.load_fast_blas()


def _simulate(args) -> int:
    from .simulator import run_cli

    return run_cli(args)


def _prepare(args) -> int:
    from .kernel import install_kernelspec
    from .models import prepare

    prepare()
    install_kernelspec()
    return 0


def _demo(args) -> int:
    from .demo import main as demo

    return demo(args.model)


def _bench(args) -> int:
    from .bench import run_cli

    return run_cli(args)


def _run(args) -> int:
    from .runner import parse_parameters, run_notebook

    r = run_notebook(args.notebook, parse_parameters(args.param), args.out, kernel_name=args.kernel,
                     timeout=args.timeout, progress=sys.stderr.isatty())
    print(r.summary())
    return 0


def _sweep(args) -> int:
    from .runner import SweepError, parse_parameters, sweep

    try:
        frame = sweep(args.notebook, args.grid, parameters=parse_parameters(args.param),
                      workers=args.workers, out_dir=args.out, scheduler=args.scheduler,
                      kernel_name=args.kernel, timeout=args.timeout, verbose=True)
    except SweepError as e:
        if e.frame is not None and e.frame.height:
            print(e.frame)
        raise
    import polars as pl

    with pl.Config(tbl_rows=50, tbl_cols=20, fmt_str_lengths=40):
        print(frame)
    print(f"kvlab: {frame.select('run').n_unique() if frame.height else 0} runs -> "
          f"{frame.height} rows")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlab", description="KV-cache and prefix-cache experiments on MLX")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare", help="convert the embedded model, build the tiny ones, install the kernel")
    s.set_defaults(func=_prepare)

    s = sub.add_parser("demo", help="a short report on the embedded model")
    s.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a folder")
    s.set_defaults(func=_demo)

    s = sub.add_parser("bench", help="side-by-side benchmarks (median and spread over repeats)")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--only", default=None, help="comma-separated: ttft,snapshot,memory,hashing,simulator")
    s.add_argument("--write", default=None, help="append the tables to this markdown file")
    s.add_argument("--ttft-system-tokens", type=int, default=1000,
                   help="system prompt size of the TTFT agentic loop")
    s.set_defaults(func=_bench)

    s = sub.add_parser("simulate", help="replay a trace or workload through a cache policy (no model)")
    s.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace")
    s.add_argument("--block-size", type=int, default=None, help="tokens per block (trace: 512)")
    s.add_argument("--policy", default="lru", choices=["infinite", "lru", "fifo", "lfu"])
    s.add_argument("--capacity-tokens", default="inf", help="cache capacity in tokens, or inf")
    s.add_argument("--sweep", default=None, help="comma-separated capacities in tokens")
    s.add_argument("--workload", default=None, help="generate a workload instead of reading a trace")
    s.add_argument("--prefix-len", type=int, default=256)
    s.add_argument("--suffix-len", type=int, default=256)
    s.add_argument("--num-prompts", type=int, default=None)
    s.add_argument("--num-prefixes", type=int, default=1,
                   help="prefixes (default 1 as in seed 004; vLLM's dataset default is 10)")
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--passes", type=int, default=1, help="replay the workload this many times")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=_simulate)

    s = sub.add_parser("run", help="execute a notebook with papermill into a run folder")
    s.add_argument("notebook", help="the .ipynb to run (its cell tagged 'parameters' is overridden)")
    s.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a parameter; VALUE is read as YAML (3, 0.5, true, tiny)")
    s.add_argument("--out", default=None, help="run folder (default runs/<stem>-<timestamp>/)")
    s.add_argument("--kernel", default=None, help="Jupyter kernel (default: kvlab, installed if needed)")
    s.add_argument("--timeout", type=float, default=None, help="seconds allowed per cell")
    s.set_defaults(func=_run)

    s = sub.add_parser("sweep", help="run a notebook over a parameter grid and collect the results")
    s.add_argument("notebook", help="the .ipynb to run")
    s.add_argument("--grid", required=True, help="YAML mapping: parameter -> list of values")
    s.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="a fixed parameter for every run (VALUE read as YAML)")
    s.add_argument("--workers", type=int, default=2, help="parallel runs (processes, default 2)")
    s.add_argument("--scheduler", default=None, help="run on this Dask scheduler address instead")
    s.add_argument("--out", default=None, help="sweep folder (default runs/<stem>-sweep-<timestamp>/)")
    s.add_argument("--kernel", default=None, help="Jupyter kernel (default: kvlab)")
    s.add_argument("--timeout", type=float, default=None, help="seconds allowed per cell")
    s.set_defaults(func=_sweep)
    return p


def main(argv=None) -> int:
    from .errors import KvlabError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvlabError as e:
        print(f"kvlab: error: {e}", file=sys.stderr)
        return 2


def print_result(obj, as_json: bool) -> None:
    """JSON for machines with --json, an aligned listing for people otherwise."""
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
        return
    for k, v in obj.items():
        print(f"{k:>24}: {v}")


if __name__ == "__main__":
    sys.exit(main())
