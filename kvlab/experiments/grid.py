"""Run one notebook over a parameter grid (``kvlab grid``) and collect every run's results table.

The grid's cartesian product runs in parallel processes, or on a Dask cluster; each run is a
kvlab.experiments.runner run in its own folder, and every run's table, with the run's parameters as columns,
is collected into ``grid.parquet``. (Not to be confused with ``kv.sweep``: that sweeps cache
capacities in the model-free simulator.)

Example:
    >>> df = kv.grid.run_grid("notebooks/01_multi_turn.ipynb", {"turns": [2, 3], "seed": [0, 1]})
    >>> df.select("turns", "seed", "run").unique().height
    4
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Mapping

from ..errors import KvlabError
from ..primitives import timing
from .runner import DEFAULT_RUNS, new_run_dir, notebook_parameters, run_notebook, save_results

GRID_FILE = "grid.parquet"


class GridError(KvlabError, RuntimeError):
    """A grid in which some runs failed; ``frame`` holds the runs that succeeded."""

    def __init__(self, message: str, frame=None, failures: list | None = None):
        super().__init__(message)
        self.frame = frame
        self.failures = failures or []
def load_grid(grid) -> dict[str, list]:
    """A grid from a YAML file path or a mapping: {parameter: [values]} (a scalar means one value)."""
    import yaml

    if isinstance(grid, (str, os.PathLike)):
        p = Path(grid)
        if not p.is_file():
            raise GridError(f"no grid file at {p}")
        try:
            grid = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise GridError(f"{p} is not valid YAML: {e}") from e
    if not isinstance(grid, Mapping) or not grid:
        raise GridError("a grid is a YAML mapping of parameter name -> list of values, e.g.\n"
                         "  turns: [2, 3]\n  seed: [0, 1]")
    out = {}
    for name, values in grid.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise GridError(f"grid key {name!r} is not a parameter name")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise GridError(f"grid parameter {name!r} has no values")
        out[name] = values
    return out


def grid_points(grid: Mapping[str, list]) -> list[dict]:
    """The cartesian product of a grid, in order (the last parameter varies fastest)."""
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def _slug(params: dict) -> str:
    text = ",".join(f"{k}={v}" for k, v in params.items())
    return re.sub(r"[^A-Za-z0-9_.,=-]+", "_", text)[:80]


def _run_spec(spec: dict) -> dict:
    """One grid run (in a worker process or on a Dask worker); returns its table, not a path,
    so the client needs no shared filesystem to collect results."""
    try:
        r = run_notebook(spec["notebook"], spec["parameters"], spec["out_dir"],
                         kernel_name=spec.get("kernel_name"), timeout=spec.get("timeout"),
                         html_export=spec.get("html_export", True), raise_on_error=False)
        frame = r.results if r.ok else None
        return {"index": spec["index"], "parameters": spec["parameters"], "run_dir": str(r.run_dir),
                "error": r.error, "seconds": r.seconds, "frame": frame}
    except Exception as e:  # bad parameters etc.: report, do not kill the grid
        return {"index": spec["index"], "parameters": spec["parameters"], "run_dir": spec["out_dir"],
                "error": f"{type(e).__name__}: {e}", "seconds": 0.0, "frame": None}


def _with_params(frame, params: dict, run: str):
    import polars as pl

    def lit(v):
        return pl.lit(v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v))

    clash = {c: f"{c}_result" for c in frame.columns if c in params or c == "run"}
    frame = frame.rename(clash) if clash else frame
    cols = [lit(v).alias(k) for k, v in params.items()] + [pl.lit(run).alias("run")]
    return frame.select(*cols, pl.all()) if frame.width else pl.select(*cols)


def run_grid(path, grid, *, parameters: Mapping | None = None, workers: int = 2, out_dir=None,
             scheduler=None, kernel_name: str | None = None, timeout: float | None = None,
             html_export: bool = True, runs_dir=DEFAULT_RUNS, verbose: bool = False):
    """Run ``path`` for every point of ``grid`` (a mapping or a YAML file) and collect the tables.

    Runs in ``workers`` processes, or on a Dask cluster when ``scheduler`` is an address (or a
    ``distributed.Client``); on a multi-machine cluster ``out_dir`` must be on a shared disk for
    the artefacts, though the table itself comes back over the wire. Returns one polars frame:
    the grid (and fixed ``parameters``) as columns, ``run`` (the run's folder) and each run's
    results columns; it is also written to ``<out_dir>/grid.parquet``. Raises GridError (with
    ``.frame`` of the runs that worked) when any run fails.

    Example:
        >>> df = run_grid("notebooks/01_multi_turn.ipynb", {"turns": [2, 3], "seed": [0, 1]})
        >>> df.select("turns", "seed", "run").unique().height
        4
    """
    import polars as pl

    notebook = Path(path)
    if not notebook.is_file():
        raise GridError(f"no notebook at {notebook}")
    grid = load_grid(grid)
    fixed = dict(parameters or {})
    overlap = sorted(set(fixed) & set(grid))
    if overlap:
        raise GridError(f"{', '.join(overlap)} both fixed and in the grid; give each parameter once")
    declared = notebook_parameters(notebook)
    unknown = sorted((set(grid) | set(fixed)) - set(declared))
    if unknown:
        raise GridError(f"{notebook.name} has no parameter {', '.join(map(repr, unknown))}; its "
                         f"parameters are: {', '.join(sorted(declared))}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise GridError(f"workers must be a positive int, got {workers!r}")
    grid_dir = Path(out_dir) if out_dir is not None else new_run_dir(Path(runs_dir), f"{notebook.stem}-grid")
    grid_dir.mkdir(parents=True, exist_ok=True)
    grid_dir = grid_dir.resolve()
    points = grid_points(grid)
    specs = [{"index": i, "notebook": str(notebook.resolve()), "parameters": {**p, **fixed},
              "out_dir": str(grid_dir / f"run-{i:03d}-{_slug(p)}"), "kernel_name": kernel_name,
              "timeout": timeout, "html_export": html_export} for i, p in enumerate(points)]
    if scheduler is None and kernel_name is None:
        # install/refresh the kernel once here, not racily in every worker
        from .kernel import ensure_kernelspec

        kname = ensure_kernelspec()
        for s in specs:
            s["kernel_name"] = kname or "python3"
    start = timing.now()
    if scheduler is not None:
        outcomes = dask_map(_run_spec, specs, scheduler)
    elif workers == 1 or len(specs) == 1:
        outcomes = [_run_spec(s) for s in specs]
    else:
        outcomes = _process_map(specs, workers, verbose)
    outcomes.sort(key=lambda o: o["index"])

    frames, failures = [], []
    for o in outcomes:
        if o["error"] is None and o["frame"] is not None:
            frames.append(_with_params(o["frame"], o["parameters"], Path(o["run_dir"]).name))
        else:
            failures.append(o)
    frame = pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()
    save_results(frame, grid_dir / GRID_FILE)
    (grid_dir / "grid.json").write_text(json.dumps(
        {"notebook": str(notebook.resolve()), "grid": grid, "parameters": fixed,
         "runs": [{"run": Path(o["run_dir"]).name, "parameters": o["parameters"], "ok": o["error"] is None,
                   "error": o["error"], "seconds": round(o["seconds"], 3)} for o in outcomes],
         "seconds": round(timing.now() - start, 3)}, indent=2, default=str))
    if failures:
        lines = "\n".join(f"  {Path(o['run_dir']).name}: {o['error']}" for o in failures)
        raise GridError(f"{len(failures)} of {len(outcomes)} runs of {notebook.name} failed "
                         f"(the {len(frames)} that worked are in {grid_dir / GRID_FILE}):\n{lines}",
                         frame, failures)
    return frame


def _process_map(specs: list[dict], workers: int, verbose: bool) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: each worker starts clean (no forked zmq/asyncio state from this process)
    ctx = multiprocessing.get_context("spawn")
    out = []
    with ProcessPoolExecutor(max_workers=min(workers, len(specs)), mp_context=ctx) as pool:
        futures = [pool.submit(_run_spec, s) for s in specs]
        for f in as_completed(futures):
            o = f.result()
            if verbose:
                state = "ok" if o["error"] is None else "FAILED"
                print(f"kvlab: {Path(o['run_dir']).name} {state} ({o['seconds']:.1f}s)", file=sys.stderr)
            out.append(o)
    return out


def dask_map(fn, specs: list, scheduler) -> list:
    """``[fn(s) for s in specs]`` on the Dask cluster at ``scheduler`` (an address or a
    ``distributed.Client``), in order: the path ``kvlab grid --scheduler`` and the cluster
    simulator's grids (kvlab.cluster.grid) share.

    Example:
        >>> dask_map(abs, [-1, 2], "tcp://127.0.0.1:8786")
        [1, 2]
    """
    try:
        from distributed import Client
    except ImportError as e:
        raise GridError("--scheduler needs dask.distributed: pip install 'dask[distributed]'") from e
    own = not isinstance(scheduler, Client)
    try:
        client = Client(scheduler) if own else scheduler
    except Exception as e:  # OSError/TimeoutError: name the address the user gave
        raise GridError(f"cannot connect to the Dask scheduler at {scheduler!r}: {e}") from e
    try:
        futures = client.map(fn, specs, pure=False)
        return client.gather(futures)
    finally:
        if own:
            client.close()
