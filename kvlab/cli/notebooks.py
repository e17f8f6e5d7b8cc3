"""`kvlab execute` (one notebook run) and `kvlab grid` (a notebook over a parameter grid)."""

from __future__ import annotations

import sys


def register(sub) -> None:
    s = sub.add_parser("execute", aliases=["run"], help="execute a notebook with papermill into a run folder")
    s.add_argument("notebook", help="the .ipynb to run (its cell tagged 'parameters' is overridden)")
    s.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a parameter; VALUE is read as YAML (3, 0.5, true, tiny)")
    s.add_argument("--out", default=None, help="run folder (default runs/<stem>-<timestamp>/)")
    s.add_argument("--kernel", default=None, help="Jupyter kernel (default: kvlab, installed if needed)")
    s.add_argument("--timeout", type=float, default=None, help="seconds allowed per cell")
    s.set_defaults(func=run)

    s = sub.add_parser("grid", help="run a notebook over a parameter grid and collect the results")
    s.add_argument("notebook", help="the .ipynb to run")
    s.add_argument("--grid", required=True, help="YAML mapping: parameter -> list of values")
    s.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="a fixed parameter for every run (VALUE read as YAML)")
    s.add_argument("--workers", type=int, default=2, help="parallel runs (processes, default 2)")
    s.add_argument("--scheduler", default=None, help="run on this Dask scheduler address instead")
    s.add_argument("--out", default=None, help="grid folder (default runs/<stem>-grid-<timestamp>/)")
    s.add_argument("--kernel", default=None, help="Jupyter kernel (default: kvlab)")
    s.add_argument("--timeout", type=float, default=None, help="seconds allowed per cell")
    s.set_defaults(func=grid)


def run(args) -> int:
    from ..experiments.runner import parse_parameters, run_notebook

    r = run_notebook(args.notebook, parse_parameters(args.param), args.out, kernel_name=args.kernel,
                     timeout=args.timeout, progress=sys.stderr.isatty())
    print(r.summary())
    return 0


def grid(args) -> int:
    import polars as pl

    from ..experiments.grid import GridError, run_grid
    from ..experiments.runner import parse_parameters

    try:
        frame = run_grid(args.notebook, args.grid, parameters=parse_parameters(args.param),
                         workers=args.workers, out_dir=args.out, scheduler=args.scheduler,
                         kernel_name=args.kernel, timeout=args.timeout, verbose=True)
    except GridError as e:
        if e.frame is not None and e.frame.height:
            print(e.frame)
        raise
    with pl.Config(tbl_rows=50, tbl_cols=20, fmt_str_lengths=40):
        print(frame)
    print(f"kvlab: {frame.select('run').n_unique() if frame.height else 0} runs -> "
          f"{frame.height} rows")
    return 0
