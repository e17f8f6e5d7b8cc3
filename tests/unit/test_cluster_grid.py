"""Cluster-simulator grids through the Dask path of ``kvlab grid --scheduler``: a local Dask
cluster of two workers gives exactly the frame a local run gives."""

import pytest

import kvlab as kv
from kvlab.cluster.grid import cluster_grid, points
from kvlab.errors import KvlabError

distributed = pytest.importorskip("distributed")


def test_dask_grid_equals_local_run():
    trace = kv.traces.read().head(200)
    grid = {"router": ["round_robin", "llmd_weighted"], "view": ["precise", "stale:2"], "instances": [2, 3],
            "capacity_tokens": [2**17], "load": [1.0, 4.0]}
    local = cluster_grid(trace, grid)
    # every listener on loopback (processes=False alone listens on all interfaces, its dashboard on :8787)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp://",
                                  host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster:
        remote = cluster_grid(trace, grid, scheduler=cluster.scheduler_address)
    assert local.height == 16
    # catches a grid that reorders points or loses one on a worker: every column equal but wall time
    assert local.drop("seconds").equals(remote.drop("seconds"))
    assert local["token_hit_rate"].n_unique() > 1


def test_grid_axes_are_checked():
    with pytest.raises(KvlabError, match="cluster grid axes are router, view"):
        points({"routers": ["random"]})
    assert len(points({"instances": [1, 2], "load": [1, 2, 3]})) == 6
