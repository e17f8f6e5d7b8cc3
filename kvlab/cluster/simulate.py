"""The cluster simulator: a trace through N instances behind one routing rule, at million-request
scale (the compiled kvlab.cluster.kernel; ``engine="python"`` the plain reference).

``kv.simulate(trace, instances=N, router=..., view=..., capacity_tokens=..., policy=...)`` lands
here. Each instance has its own block cache of ``capacity_tokens`` (any kvlab eviction policy:
lru and fifo compiled, the others through the reference) and a prefill queue whose service
time is a ServiceModel (kvlab.cluster.service); requests arrive at the trace's timestamps divided
by ``load`` (2.0: twice as fast). ``requests=`` tiles the trace (fresh ids per copy,
``Trace.repeat``) to that many requests. With ``instances=1`` the hits are today's single-cache
replay's exactly. ``shared_cache_token_hit_rate`` is the ceiling of one cache of N x capacity
with the same policy (no routing loss).

Example:
    >>> r = kv.simulate(kv.traces.read(), instances=4, router="sglang_cache_aware",
    ...                 capacity_tokens=2**20)
    >>> sorted(r.json())[:3]
    ['instances', 'load_imbalance', 'per_instance']
"""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass

import numpy as np
import polars as pl

from ..errors import KvlabError, TraceError
from ..policies import POLICIES
from ..primitives import timing
from .caches import MAX_INSTANCES, new_caches, slots_for
from .decide import mix64, session_ring
from .kernel import cluster_kernel
from .routers import approximate_view, check_router, check_view, rule_params
from .service import ServiceModel

COMPILED = ("lru", "fifo", "infinite")
KINDS = {"precise": 0, "approximate": 1, "stale": 2}
JSON_KEYS = ("router", "view", "instances", "token_hit_rate", "request_hit_rate", "shared_cache_token_hit_rate",
             "per_instance", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "seconds")


@dataclass(frozen=True, eq=False)
class ClusterResult:
    """One cluster replay: ``requests`` (one row a request: instance, prompt / hit tokens, the
    view's match on the instance chosen, modelled TTFT) and ``summary`` (``json()`` gives the
    keys ``kvlab simulate --instances`` prints)."""

    requests: pl.DataFrame
    summary: dict

    def json(self) -> dict:
        return {k: self.summary[k] for k in JSON_KEYS}

    def per_instance(self) -> pl.DataFrame:
        return pl.DataFrame(self.summary["per_instance"]).with_row_index("instance")

    def __repr__(self) -> str:
        s = self.summary
        return (f"ClusterResult({s['router']}/{s['view']} x{s['instances']}: token hit {s['token_hit_rate']:.1%} "
                f"(shared ceiling {s['shared_cache_token_hit_rate']:.1%}), imbalance {s['load_imbalance']:.2f}, "
                f"TTFT p50 {s['ttft_p50_s']:.3g} s, p99 {s['ttft_p99_s']:.3g} s)")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{k}</td><td>{html.escape(str(v))}</td></tr>" for k, v in self.json().items())
        return f"<div><b>ClusterResult</b><table>{rows}</table></div>"


def simulate_cluster(source, instances: int, router: str = "round_robin", view: str = "precise",
                     capacity_tokens=None, policy: str = "lru", block_size: int | None = None, *,
                     load: float = 1.0, service: ServiceModel | None = None, requests: int | None = None,
                     router_params: dict | None = None, tokenizer=None, seed: int = 0,
                     engine: str = "auto") -> ClusterResult:
    """Route ``source`` (a Trace, a trace path, a Workload or token-id lists) over ``instances``
    instances (module docstring). ``router``: kvlab.cluster.routers.ROUTER_NAMES; ``view``:
    precise, approximate or stale:D; ``router_params`` override a rule's defaults."""
    clock = timing.timed()
    spec = prepare(source, instances, router, view, capacity_tokens, policy, block_size, load=load,
                   service=service, requests=requests, router_params=router_params, tokenizer=tokenizer, seed=seed)
    if engine not in ("auto", "numba", "python"):
        raise KvlabError(f"unknown engine {engine!r}; use one of auto, numba, python")
    python = engine == "python" or policy not in COMPILED
    if engine == "numba" and python:
        raise KvlabError(f"policy {policy!r} has no compiled cluster kernel (lru, fifo do); use engine='auto'")
    out = run(spec, policy, python)
    return _result(spec, out, clock.done())


def prepare(source, instances, router, view, capacity_tokens, policy, block_size, *, load=1.0, service=None,
            requests=None, router_params=None, tokenizer=None, seed=0) -> dict:
    """Every array and setting the kernel (and the reference) reads, checked."""
    from ..sim.prepare import parse_capacity, prepare_replay

    info = check_router(router)
    kind, delay = check_view(view)
    if isinstance(instances, bool) or not isinstance(instances, (int, np.integer)) or not 1 <= instances <= MAX_INSTANCES:
        raise KvlabError(f"instances must be an int from 1 to {MAX_INSTANCES}, got {instances!r}")
    if policy not in POLICIES and policy != "infinite":
        raise KvlabError(f"unknown policy {policy!r}; use one of infinite, {', '.join(POLICIES)}")
    if policy == "belady":
        raise KvlabError("belady needs the future of each instance, which routing decides; use "
                         "router='optimal' for the offline optimum of the shared cache")
    if not load > 0:
        raise KvlabError(f"load must be > 0 (2.0: arrivals twice as fast), got {load!r}")
    trace = _trace(source, block_size, tokenizer)
    if requests is not None:
        trace = trace.repeat(-(-int(requests) // len(trace))).head(int(requests))
    rep = prepare_replay(trace, None, 1, None)
    bs = rep.block_size
    cap_tokens = parse_capacity(capacity_tokens, policy)
    cap = -1 if cap_tokens is None else cap_tokens // bs
    service = service or ServiceModel()
    prm = np.array(service.slots(bs) + (rule_params(info, router_params) if info else []), np.float64)
    vcap, ttl = approximate_view(info, cap, bs)
    arrival = _arrivals(trace) / float(load)
    max_ins = int(rep.inserted.max()) if len(rep.inserted) else 0
    window_s = float(info.params.get("window_s", 0.0)) if info else 0.0
    n_ring = _window_blocks(arrival, rep.inserted, delay) if kind == "stale" else 0
    n_ttl = _window_blocks(arrival, rep.inserted, ttl) if kind == "approximate" and ttl > 0 else 0
    refs = int(rep.inserted.sum())
    vslots = (n_ttl + instances + max_ins) if ttl > 0 else slots_for(instances, None if vcap < 0 else vcap, max_ins,
                                                                      refs)
    ring_pos, ring_own = session_ring(instances, int(info.params.get("vnodes", 100)) if info else 100, seed)
    st = np.array([seed, 0], np.int64)
    given = np.array([-1], np.int64)
    if router in ("shared", "optimal"):
        given = _shared_hits(rep, "belady" if router == "optimal" else policy, cap, instances)
    return {"rep": rep, "trace": trace, "router": router, "view": view, "policy": policy, "code": info.code if info else -1,
            "n_inst": int(instances), "prm": prm, "st": st, "ring_pos": ring_pos, "ring_own": ring_own,
            "flat": rep.flat, "offsets": rep.offsets, "hittable": rep.hittable, "inserted": rep.inserted,
            "tokens": rep.tokens, "outs": trace.frame["output_length"].to_numpy().astype(np.int64),
            "arrival": arrival, "session": _sessions(trace, rep), "cap": cap, "cap_tokens": cap_tokens,
            "view_kind": KINDS[kind], "delay": delay, "vcap": vcap, "ttl": float(ttl) if kind == "approximate" else 0.0,
            "vslots": vslots, "given": given, "window_s": window_s if window_s > 0 else np.inf,
            "ring_size": 2 * (n_ring + max_ins) + 2, "max_ins": max_ins, "service": service}


def run(spec: dict, policy: str, python: bool = False) -> tuple:
    """(instance, hit blocks, TTFT, view match) per request, compiled or through the reference."""
    if python:
        from .reference import reference

        return reference(spec, "lru" if policy == "infinite" else policy)
    n, rep = spec["n_inst"], spec["rep"]
    cap = spec["cap"]
    true_mc = new_caches(rep.n_blocks, n, slots_for(n, None if cap < 0 else cap, spec["max_ins"],
                                                    int(rep.inserted.sum())))
    stale = spec["view_kind"] == 2
    view_mc = new_caches(rep.n_blocks if spec["view_kind"] else 1, n, 0 if stale else spec["vslots"])
    return cluster_kernel(spec["flat"], spec["offsets"], spec["hittable"], spec["inserted"], spec["tokens"],
                          spec["outs"], spec["arrival"], spec["session"], n, spec["code"], spec["prm"],
                          spec["st"].copy(), spec["ring_pos"], spec["ring_own"], cap, policy != "fifo",
                          spec["view_kind"], spec["delay"], spec["vcap"], spec["ttl"], spec["given"],
                          spec["window_s"], spec["ring_size"], true_mc, view_mc)


def _result(spec: dict, out: tuple, seconds: float) -> ClusterResult:
    inst, hits, ttft, vmatch = (np.asarray(x) for x in out)
    rep, n, bs = spec["rep"], spec["n_inst"], spec["rep"].block_size
    prompt = rep.tokens
    hit_tokens = hits * bs
    frame = pl.DataFrame({"request": np.arange(len(prompt)), "instance": inst, "prompt_tokens": prompt,
                          "hit_tokens": hit_tokens, "view_match_tokens": vmatch * bs, "arrival_s": spec["arrival"],
                          "ttft_s": ttft})
    per = [{"requests": int((inst == i).sum()), "prompt_tokens": int(prompt[inst == i].sum()),
            "hit_tokens": int(hit_tokens[inst == i].sum())} for i in range(n)]
    total = int(prompt.sum())
    served = np.array([p["prompt_tokens"] for p in per], np.float64)
    shared = spec["given"] if spec["router"] in ("shared",) else _shared_hits(rep, spec["policy"], spec["cap"], n)
    summary = {"router": spec["router"], "view": spec["view"], "instances": n,
               "token_hit_rate": float(hit_tokens.sum()) / total if total else 0.0,
               "request_hit_rate": float((hits > 0).mean()) if len(hits) else 0.0,
               "shared_cache_token_hit_rate": float(shared.sum() * bs) / total if total else 0.0,
               "per_instance": per, "load_imbalance": float(served.max() / served.mean()) if served.sum() else 0.0,
               "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else 0.0,
               "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
               "seconds": round(seconds, 3), "policy": spec["policy"], "capacity_tokens": spec["cap_tokens"],
               "block_size": bs, "requests": len(prompt), "service": repr(spec["service"])}
    return ClusterResult(frame, summary)


def _shared_hits(rep, policy: str, cap: int, n: int) -> np.ndarray:
    """Hit blocks per request of one cache of n x capacity (the ceilings)."""
    from ..sim.dispatch import run_kernel
    from ..sim.kernels_ceiling import UNBOUNDED, belady_ceiling_kernel
    from ..sim.reference import run_python

    shared = None if cap < 0 else cap * n
    if policy == "belady":
        caps = np.array([UNBOUNDED if shared is None else shared], np.int64)
        return belady_ceiling_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps)[:, 0]
    run_ = run_kernel if policy in COMPILED else run_python
    return np.asarray(run_(rep, policy, shared, reasons=False).hits, np.int64)


def _trace(source, block_size, tokenizer):
    from ..experiments import traces
    from ..workloads import Request, Workload

    if isinstance(source, traces.Trace):
        if block_size is not None and block_size != source.block_size:
            from ..errors import BlockSizeError

            raise BlockSizeError(f"this trace's hash_ids cover {source.block_size}-token blocks; block_size "
                                 f"must be {source.block_size} or None, got {block_size!r}")
        return source
    if isinstance(source, str) or hasattr(source, "__fspath__"):
        return traces.read(source, block_size=block_size or traces.MOONCAKE_BLOCK_SIZE)
    bs = 16 if block_size is None else block_size
    if isinstance(source, (list, tuple)) and source and all(isinstance(r, Request) for r in source):
        source = Workload("requests", tuple(source))
    if isinstance(source, Workload):
        return traces.from_workload(source, tokenizer, bs)
    if isinstance(source, (list, tuple)):
        return traces.from_requests(source, 0, bs)
    raise TraceError(f"cannot simulate a {type(source).__name__}; pass a Trace, a trace path, a Workload "
                     "or a list of token-id sequences")


def _arrivals(trace) -> np.ndarray:
    ts = trace.frame["timestamp"]
    if ts.null_count():
        rows = trace.frame.with_row_index("row").filter(pl.col("timestamp").is_null())["row"].head(5).to_list()
        raise TraceError(f"rows {rows} have no timestamp; the cluster simulator queues requests at their "
                         "arrival times: give every row a timestamp (ms)")
    t = ts.to_numpy().astype(np.float64) / 1000.0
    back = np.flatnonzero(np.diff(t) < 0)
    if len(back):
        raise TraceError(f"row {int(back[0]) + 1} arrives before row {int(back[0])} (timestamps must not "
                         "decrease); sort the trace by timestamp")
    return t


def _sessions(trace, rep) -> np.ndarray:
    """A 64-bit key per request: its ``session`` column if the trace has one, else its first block."""
    f = trace.frame
    if "session" in f.columns:
        keys = [int.from_bytes(hashlib.blake2b(str(s).encode(), digest_size=8).digest(), "big")
                for s in f["session"].to_list()]
        return mix64(np.array(keys, np.uint64))
    n = len(rep.tokens)
    first = np.full(n, -1, np.int64)
    has = np.diff(rep.offsets) > 0
    first[has] = rep.flat[rep.offsets[:-1][has]]
    return mix64(first.astype(np.uint64))


def _window_blocks(arrival: np.ndarray, inserted: np.ndarray, window: float) -> int:
    """The most blocks inserted within any ``window`` seconds (at least one request's)."""
    if not len(arrival):
        return 0
    csum = np.concatenate([[0], np.cumsum(inserted)])
    lo = np.searchsorted(arrival, arrival - window, side="left")
    return int((csum[1:] - csum[lo]).max())
