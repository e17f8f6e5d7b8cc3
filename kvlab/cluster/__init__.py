"""Routing across serving instances: one routing interface (kvlab.cluster.decide) shared by a
million-request cluster simulator (kvlab.cluster.simulate, through ``kv.simulate(...,
instances=N)``) and a real router in front of ``kvlab serve`` instances fed by vLLM-format KV
events (kvlab.cluster.router); the rules, their defaults and sources in kvlab.cluster.routers.

Example:
    >>> import kvlab as kv
    >>> kv.simulate(kv.traces.read(), instances=8, router="preble_e2", capacity_tokens=2**21)
    ClusterResult(preble_e2/precise x8: ...)
"""

from .routers import (CACHE_AWARE, CEILINGS, LOAD_ONLY, ROUTER_NAMES, ROUTERS, VIEWS, RouterInfo, check_router,
                      check_view)
from .service import ServiceModel

__all__ = ["ROUTERS", "ROUTER_NAMES", "CEILINGS", "CACHE_AWARE", "LOAD_ONLY", "VIEWS", "RouterInfo", "ServiceModel", "check_router",
           "check_view", "simulate_cluster", "ClusterResult", "route", "Router", "up", "Cluster"]
_LAZY = {"simulate_cluster": "simulate", "ClusterResult": "simulate", "route": "router", "Router": "router",
         "up": "launch", "Cluster": "launch"}


_SUBMODULES = ("grid", "fleet", "realrun", "launch", "router", "live", "views", "feed", "simulate")


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
