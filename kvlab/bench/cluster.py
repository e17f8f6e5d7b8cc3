"""Cluster simulator throughput: the public synthetic trace tiled (fresh ids per copy) to a million
requests, routed over 8 instances with 2 Mi-token LRU caches by a load-only rule, llm-d's
precise scorer and SGLang's approximate tree; end-to-end seconds of ``kv.simulate(...,
instances=8)`` (preparing the block arrays and the shared-cache ceiling included), compiled
kernels on one core. CPU seconds beside wall seconds: on a shared machine the wall clock also
counts the time other processes held the core."""

from __future__ import annotations

from ..primitives import timing
from .settings import Settings
from .table import Table, median_range, spread, timed

NEEDS_MODEL = False
CONTENDERS = (("round_robin", "precise"), ("llmd_weighted", "precise"), ("sglang_cache_aware", "approximate"))


def bench_cluster(n_requests: int = 1_000_000, instances: int = 8, capacity_tokens: int = 2**21,
                  repeats: int = 1) -> dict:
    """Seconds per contender (median and spread over ``repeats``, interleaved) and its hit rate.

    Example:
        >>> bench_cluster(n_requests=5_000, repeats=1)["runs"]["round_robin/precise"]["requests"]
        5000
    """
    from ..cluster.simulate import simulate_cluster
    from ..experiments import traces

    base = traces.read()
    trace = base.repeat(-(-n_requests // len(base))).head(n_requests)
    simulate_cluster(base.head(50), instances, "llmd_weighted", capacity_tokens=capacity_tokens)  # compile
    seconds = {f"{r}/{v}": [] for r, v in CONTENDERS}
    cpu = {k: [] for k in seconds}
    results = {}
    for _ in range(max(1, repeats)):
        for router, view in CONTENDERS:
            c0 = timing.cpu()
            out, t = timed(lambda: simulate_cluster(trace, instances, router, view, capacity_tokens), 1)
            cpu[f"{router}/{view}"].append(timing.cpu() - c0)
            seconds[f"{router}/{view}"] += t
            results[f"{router}/{view}"] = out.json()
    runs = {k: {"seconds": spread(seconds[k]), "cpu_seconds": spread(cpu[k]), "requests": n_requests,
                "token_hit_rate": results[k]["token_hit_rate"], "load_imbalance": results[k]["load_imbalance"],
                "shared_cache_token_hit_rate": results[k]["shared_cache_token_hit_rate"]} for k in seconds}
    return {"requests": n_requests, "instances": instances, "capacity_tokens": capacity_tokens, "runs": runs}


def table(s: Settings) -> Table:
    r = bench_cluster(repeats=s.repeats)
    rows = tuple((name, median_range(v["seconds"]), median_range(v["cpu_seconds"]), f"{v['token_hit_rate']:.1%}",
                  f"{v['load_imbalance']:.2f}") for name, v in r["runs"].items())
    return Table(f"cluster simulator: {r['requests']:,} requests over {r['instances']} instances",
                 f"kvlab bench --only cluster --repeats {s.repeats}",
                 ("router/view", "wall seconds median (min-max)", "CPU seconds", "token hit rate", "load imbalance"), rows,
                 f"Target: {r['requests']:,} requests over {r['instances']} instances in < 60 s on one core "
                 f"(the Mooncake synthetic trace tiled, {r['capacity_tokens']:,}-token LRU caches; "
                 f"shared-cache ceiling {next(iter(r['runs'].values()))['shared_cache_token_hit_rate']:.1%}).",
                 values=r)
