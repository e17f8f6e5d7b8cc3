"""The routing rules kvlab compares, their defaults and where each comes from, and the views a
cache-aware rule can read. The rules themselves are kvlab.cluster.decide (one compiled function
shared by the simulator and the real router).

Rules (``ROUTERS``):

- ``random``, ``round_robin`` (request i to instance i mod N), ``least_loaded`` (fewest requests
  in flight), ``power_of_two`` (two random instances, the less loaded; Mitzenmacher),
  ``session`` (consistent hash of a session id, 100 points per instance on the ring).
- ``sglang_cache_aware``: SGLang's router (sgl-router ``policies/cache_aware.rs``): an
  approximate radix tree per worker built from what it routed; if the load is imbalanced
  (``max - min > balance_abs_threshold`` = 64 and ``max > balance_rel_threshold`` = 1.5 x min)
  route to the least loaded, else to the longest match if match / prompt >= ``cache_threshold``
  = 0.3, else to the worker with the smallest tree. Its tree evicts LRU down to
  ``max_tree_size`` = 2^26 characters (here 2^24 tokens at 4 characters a token). Two fixes
  its users proposed, as flags: ``fix_miss_load`` (sglang PR 14305/14532: on a miss go to the
  least loaded worker, not the smallest tree, which sent all traffic to one busy worker) and
  ``fix_rebalance`` (sglang PR 32195: when imbalanced, keep the longest match among workers
  within ``balance_abs_threshold`` of the least load instead of throwing locality away).
- ``ray_prefix_affinity``: Ray Serve's ``PrefixCacheAffinityRouter`` (``ray/llm/_internal/serve/
  request_router/prefix_aware/prefix_aware_router.py``, defaults read there): if the longest and
  shortest queues differ by more than ``imbalanced_threshold`` (10) fall back to power of two;
  else the replicas with the highest match rate if it is >= ``match_rate_threshold`` (0.1), else
  those with the smallest tree, the least loaded among them. Its prefix tree evicts only when
  ``do_eviction`` is set (default False; then at 400,000 characters): approximate view unbounded.
- ``aibrix_prefix``: AIBrix's ``prefix-cache`` router (``pkg/plugins/gateway/algorithms/
  prefix_cache.go``, defaults read there): least running requests if ``max - min`` > 8
  (``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT``); else the pod with the
  highest prefix match whose running count is within mean + 1 standard deviation
  (``..._STANDARD_DEVIATION_FACTOR``), else the least loaded. Its hash table forgets a block
  unused for ``AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS`` = 20 min: the approximate view's TTL
  of 1200 s (its cap of 200,000 blocks over all pods is not modelled).
- ``llmd_weighted``: llm-d's precise prefix-cache scorer with the queue and KV-cache usage
  scorers, weights 2 / 1 / 1 (llm-d's precise-prefix-cache-routing configuration:
  precise-prefix-cache-scorer 2.0, kv-cache-utilization-scorer 1.0, queue-scorer 1.0): prefix =
  the longest run of cached blocks from the prompt's start over its blocks, queue = (max - q) /
  (max - min), KV = 1 - usage; the highest total wins. Fed by vLLM's KV events; its approximate
  scorer (gateway-api-inference-extension ``plugins/multi/prefix/plugin.go``) keeps an LRU of
  ``DefaultLRUCapacityPerServer`` = 31,250 blocks per server (``maxPrefixBlocksToMatch`` = 256
  is not modelled).
- ``dynamo_cost``: NVIDIA Dynamo's KV router (``lib/llm/src/kv_router/scheduler.rs``): minimise
  ``overlap_score_weight`` (1.0) x prefill blocks not cached + decode blocks (the blocks of the
  worker's active requests, this one's included); ``router_temperature`` > 0 samples from a
  softmax of the normalised costs (default 0: argmin). Without events (``--no-router-kv-events``)
  its indexer forgets a routed block after ``--router-ttl-secs`` = 120 s (its tree cap of 2^20
  blocks, ``--router-max-tree-size``, is not modelled).
- ``preble_e2``: Preble's E2 (ICLR 2025, "Preble: Efficient Distributed Prompt Scheduling for
  LLM Serving"): exploit when the longest cached prefix is longer than the new part (route
  there), else explore: the instance with the least load, the prefill seconds routed to it in
  the last ``window_s`` (180 s) plus this request's prefill there. Its global radix tree
  mirrors each GPU's LRU eviction: approximate view = LRU at the instance's capacity.
- ``mooncake_ttft``: Mooncake's conductor (FAST'25, "Mooncake: Trading More Storage for Less
  Computation", 4.2): estimate each instance's TTFT as its queue's wait plus the prefill of
  what it does not hold, pick the smallest (KV transfer between instances and SLO rejection
  not modelled). Approximate view as Preble's.
- Ceilings: ``shared`` (one cache of N x capacity, the same eviction policy, requests to the
  least loaded instance: no routing loss) and ``optimal`` (the offline optimum kvlab already
  has, belady, on that shared cache).

Views (``check_view``): ``precise`` (what each instance holds, from its KV events),
``approximate`` (the router's own record of what it routed where, evicted as the rule's
original does: ``APPROXIMATE``), ``stale:D`` (the precise view D seconds late).

Example:
    >>> check_router("sglang_cache_aware").params["cache_threshold"]
    0.3
    >>> check_view("stale:2.5")
    ('stale', 2.5)
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from ..errors import KvlabError
from . import decide as d

SGLANG_TREE_TOKENS = 2 ** 26 // 4  # max_tree_size characters at ~4 characters a token


@dataclass(frozen=True)
class RouterInfo:
    """One rule: its code in kvlab.cluster.decide, its parameters and defaults, whether it reads
    a view, how its approximate view evicts (``kind`` lru / ttl / none, ``size``: ``tokens``
    or ``instance`` for the instance's own capacity; ``ttl_s``) and its source."""

    name: str
    code: int
    params: dict = field(default_factory=dict)
    cache_aware: bool = True
    approximate: tuple = ("lru", "instance", 0.0)
    source: str = ""

    def __repr__(self) -> str:
        ps = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"RouterInfo({self.name}{': ' + ps if ps else ''})"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code> <small>{html.escape(self.source)}</small>"


def _r(name, code, params=None, cache_aware=True, approximate=("lru", "instance", 0.0), source=""):
    return RouterInfo(name, code, dict(params or {}), cache_aware, approximate, source)


ROUTERS = {r.name: r for r in (
    _r("random", d.R_RANDOM, cache_aware=False, source="uniform"),
    _r("round_robin", d.R_ROUND_ROBIN, cache_aware=False, source="request i to instance i mod N"),
    _r("least_loaded", d.R_LEAST_LOADED, cache_aware=False, source="fewest requests in flight"),
    _r("power_of_two", d.R_POWER_OF_TWO, cache_aware=False, source="Mitzenmacher's two choices"),
    _r("session", d.R_SESSION, {"vnodes": 100}, cache_aware=False, source="consistent hash of the session"),
    _r("sglang_cache_aware", d.R_SGLANG, {"cache_threshold": 0.3, "balance_abs_threshold": 64,
                                          "balance_rel_threshold": 1.5, "fix_miss_load": 0, "fix_rebalance": 0},
       approximate=("lru", SGLANG_TREE_TOKENS, 0.0), source="sgl-router policies/cache_aware.rs"),
    _r("ray_prefix_affinity", d.R_RAY, {"imbalanced_threshold": 10, "match_rate_threshold": 0.1},
       approximate=("none", None, 0.0), source="Ray Serve PrefixCacheAffinityRouter"),
    _r("aibrix_prefix", d.R_AIBRIX, {"imbalance_abs": 8, "std_factor": 1.0},
       approximate=("ttl", None, 1200.0), source="AIBrix prefix-cache router"),
    _r("llmd_weighted", d.R_LLMD, {"w_prefix": 2.0, "w_queue": 1.0, "w_kv": 1.0},
       approximate=("lru", "llmd", 0.0), source="llm-d precise prefix-cache scorer + queue + kv-usage"),
    _r("dynamo_cost", d.R_DYNAMO, {"overlap_weight": 1.0, "temperature": 0.0},
       approximate=("ttl", None, 120.0), source="NVIDIA Dynamo KV router"),
    _r("preble_e2", d.R_PREBLE, {"window_s": 180.0}, source="Preble E2 (ICLR 2025)"),
    _r("mooncake_ttft", d.R_MOONCAKE, source="Mooncake conductor (FAST'25)"),
)}
LLMD_LRU_BLOCKS = 31_250  # llm-d's approximate prefix scorer: entries kept per server
CACHE_AWARE = tuple(r for r, info in ROUTERS.items() if info.cache_aware)
LOAD_ONLY = tuple(r for r, info in ROUTERS.items() if not info.cache_aware)
CEILINGS = ("shared", "optimal")
ROUTER_NAMES = tuple(ROUTERS) + CEILINGS
VIEWS = ("precise", "approximate", "stale:D")


def check_router(name: str) -> RouterInfo | None:
    """The RouterInfo of ``name`` (None for the ceilings ``shared`` / ``optimal``); KvlabError
    listing every name for an unknown one."""
    if name in CEILINGS:
        return None
    if name not in ROUTERS:
        raise KvlabError(f"unknown router {name!r}; use one of {', '.join(ROUTER_NAMES)}")
    return ROUTERS[name]


def check_view(view: str) -> tuple[str, float]:
    """``(kind, delay_s)`` of a view spec: precise, approximate or stale:D (D seconds >= 0)."""
    if view in ("precise", "approximate"):
        return view, 0.0
    if isinstance(view, str) and view.startswith("stale:"):
        try:
            delay = float(view[6:])
        except ValueError:
            delay = -1.0
        if delay >= 0:
            return "stale", delay
        raise KvlabError(f"view {view!r}: stale:D needs D, a delay in seconds >= 0 (e.g. stale:2)")
    raise KvlabError(f"unknown view {view!r}; use one of {', '.join(VIEWS)} (D: seconds the events are late)")


def rule_params(info: RouterInfo, overrides: dict | None = None) -> list[float]:
    """The rule's parameters in decide's order, ``overrides`` applied (unknown names refused)."""
    values = dict(info.params)
    for k, v in (overrides or {}).items():
        if k not in values:
            raise KvlabError(f"router {info.name} has no parameter {k!r}; its parameters are: "
                             f"{', '.join(values) or 'none'}")
        values[k] = v
    return [float(v) for v in values.values()]


def approximate_view(info: RouterInfo | None, cap_blocks: int, block_size: int) -> tuple[int, float]:
    """How the rule's approximate view forgets: (blocks it keeps per instance, -1 for no bound;
    seconds a block lives unused, 0 for no TTL). ``cap_blocks``: the instance's capacity (-1: none).

    Example:
        >>> approximate_view(check_router("llmd_weighted"), -1, 16)
        (31250, 0.0)
    """
    kind, size, ttl = info.approximate if info else ("none", None, 0.0)
    if kind == "none":
        return -1, 0.0
    named = {None: -1, "instance": cap_blocks, "llmd": LLMD_LRU_BLOCKS}
    return (named[size] if size is None or isinstance(size, str) else int(size) // block_size), float(ttl)
