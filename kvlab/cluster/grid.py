"""Cluster-simulator grids (router x view x instances x capacity x load x policy): one
``kv.simulate(..., instances=N)`` per point, locally or on a Dask cluster through the same path
``kvlab grid --scheduler`` runs notebooks on (kvlab.experiments.grid.dask_map); a point's result
does not depend on where it ran, so both give the same frame.

Watch a grid from JupyterLab with dask-labextension (``pip install dask-labextension``: the
scheduler's dashboard panels inside the lab).

Example:
    >>> frame = cluster_grid(kv.traces.read(), {"router": ["round_robin", "llmd_weighted"],
    ...                                         "instances": [2, 4], "capacity_tokens": [2**20]})
    >>> frame.height
    4
"""

from __future__ import annotations

import itertools

import polars as pl

from ..errors import KvlabError

AXES = ("router", "view", "instances", "capacity_tokens", "load", "policy")
DEFAULTS = {"router": "round_robin", "view": "precise", "instances": 2, "capacity_tokens": None, "load": 1.0,
            "policy": "lru"}


def points(grid: dict) -> list[dict]:
    """The grid's cartesian product (the last axis fastest), every axis filled with its default."""
    unknown = sorted(set(grid) - set(AXES))
    if unknown:
        raise KvlabError(f"cluster grid axes are {', '.join(AXES)}; not {', '.join(unknown)}")
    axes = {k: (list(grid[k]) if isinstance(grid.get(k), (list, tuple)) else [grid.get(k, DEFAULTS[k])])
            for k in AXES}
    return [dict(zip(AXES, combo)) for combo in itertools.product(*axes.values())]


def run_point(spec: dict) -> dict:
    """One point: its settings and the cluster result's JSON (per_instance dropped), on any worker."""
    from .simulate import simulate_cluster

    p = spec["point"]
    r = simulate_cluster(spec["source"], p["instances"], p["router"], p["view"], p["capacity_tokens"], p["policy"],
                         load=p["load"], service=spec.get("service"), requests=spec.get("requests"))
    out = {k: v for k, v in r.json().items() if k not in ("per_instance", "seconds")}
    return {**p, **out, "seconds": r.summary["seconds"]}


def cluster_grid(source, grid: dict, *, scheduler=None, service=None, requests: int | None = None) -> pl.DataFrame:
    """One row per grid point, in grid order; ``scheduler`` (an address or a ``distributed.Client``)
    runs the points on Dask, else they run here one after the other."""
    specs = [{"source": source, "point": p, "service": service, "requests": requests} for p in points(grid)]
    if scheduler is None:
        rows = [run_point(s) for s in specs]
    else:
        from ..experiments.grid import dask_map

        rows = dask_map(run_point, specs, scheduler)
    return pl.DataFrame(rows, schema_overrides={"capacity_tokens": pl.Int64})
