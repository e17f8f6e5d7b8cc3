"""Simulator throughput: the LRU stack-distance sweep against plain-Python and compiled per-capacity
replays, on a Mooncake-sized trace; every method must give identical hit counts."""

from __future__ import annotations

import statistics
import time

from .settings import Settings
from .table import Table, median_range

NEEDS_MODEL = False


def bench_simulator(trace=None, *, n_requests: int = 12_000, n_capacities: int = 16,
                    repeats: int = 3, python_repeats: int = 1) -> dict:
    """Sweep speed-up over plain-Python replays, and replay throughput in blocks/s.

    Builds an ``n_requests`` trace from ``trace`` (default: the public synthetic trace, repeated
    with fresh ids per copy), sweeps ``n_capacities`` log-spaced LRU capacities with the stack
    kernel, and times ``n_capacities`` plain-Python LRU replays; checks the results are equal.
    Times are medians over ``repeats`` (``python_repeats`` for the slow Python side).

    Example:
        >>> b = bench_simulator(repeats=3)
        >>> b["identical"], b["speedup"]["median"] > 10
        (True, True)
    """
    import numpy as np

    from ..experiments import traces
    from ..sim.dispatch import replay_kernel
    from ..sim.kernels_stack import lru_stack_kernel
    from ..sim.simulator import prepare_replay, replay_python, sweep

    base = trace if isinstance(trace, traces.Trace) else traces.read(trace)
    if len(base) < n_requests:
        base = base.repeat(-(-n_requests // len(base)))
    t = base.head(n_requests)
    rep = prepare_replay(t, None, 1, None)
    distinct = rep.n_blocks
    spaced = np.geomspace(max(1, distinct // 100), distinct, n_capacities).astype(np.int64)
    caps_tokens = sorted({int(x) * rep.block_size for x in spaced})
    while len(caps_tokens) < n_capacities:  # tiny traces: pad with distinct small capacities
        caps_tokens.append(caps_tokens[-1] + rep.block_size)
    caps = [c // rep.block_size for c in caps_tokens]
    caps_arr = np.array(caps, dtype=np.int64)
    blocks = int(rep.offsets[-1])

    lru_stack_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps_arr)
    replay_kernel(rep, "lru", caps[0])  # compile / load from cache before timing

    def timed(fn, n):
        out, times = None, []
        for _ in range(max(1, n)):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return out, times

    stack, t_sweep = timed(lambda: lru_stack_kernel(rep.flat, rep.offsets, rep.hittable,
                                                     rep.inserted, rep.n_blocks, caps_arr), repeats)
    plain, t_python = timed(lambda: [replay_python(rep, "lru", c)[0] for c in caps], python_repeats)
    kern, t_kernel = timed(lambda: [replay_kernel(rep, "lru", c)[0] for c in caps], repeats)
    # the public call end to end: preparing the block arrays included
    api, t_api = timed(lambda: sweep(t, "lru", caps_tokens), repeats)
    identical = bool(all(np.array_equal(stack[:, k], plain[k]) and np.array_equal(kern[k], plain[k])
                         for k in range(len(caps)))
                     and api["hit_tokens"].to_list() == [int(p.sum()) * rep.block_size for p in plain])

    def stats(xs):
        med = statistics.median(xs)
        return {"median": med, "min": min(xs), "max": max(xs), "n": len(xs)}

    py_med = statistics.median(t_python)
    return {
        "requests": len(t), "blocks": blocks, "distinct_blocks": distinct,
        "capacities_tokens": caps_tokens, "identical": identical,
        "sweep_seconds": stats(t_sweep), "python_replays_seconds": stats(t_python),
        "numba_replays_seconds": stats(t_kernel), "sweep_api_seconds": stats(t_api),
        "speedup": stats([py_med / x for x in t_sweep]),
        "speedup_end_to_end": stats([py_med / x for x in t_api]),
        "speedup_vs_numba_replays": stats([statistics.median(t_kernel) / x for x in t_sweep]),
        "blocks_per_s": {
            "sweep": stats([blocks * len(caps) / x for x in t_sweep]),
            "numba_replay": stats([blocks * len(caps) / x for x in t_kernel]),
            "python_replay": stats([blocks * len(caps) / x for x in t_python]),
        },
    }


def bench_simulator_table(repeats: int) -> Table:
    """bench_simulator's numbers as a table.

    Example:
        >>> bench_simulator_table(2).rows[2]
        ('results identical to plain replays', True)
    """
    r = bench_simulator(repeats=repeats)
    rows = [("trace", f"{r['requests']} requests, {r['blocks']} block references, "
                      f"{r['distinct_blocks']} distinct blocks"),
            ("capacities", f"{len(r['capacities_tokens'])} (LRU, {r['capacities_tokens'][0]:,}-"
                           f"{r['capacities_tokens'][-1]:,} tokens)"),
            ("results identical to plain replays", r["identical"])]
    for key in ("sweep_seconds", "sweep_api_seconds", "numba_replays_seconds", "python_replays_seconds",
                "speedup", "speedup_end_to_end", "speedup_vs_numba_replays"):
        rows.append((key, median_range(r[key])))
    for key, v in r["blocks_per_s"].items():
        rows.append((f"{key} block lookups/s (x capacities)", median_range(v)))
    return Table("simulator throughput and sweep speed-up", f"kvlab bench --only simulator --repeats {repeats}",
                 ("measure", "median (min-max)"), tuple(rows),
                 "Target: a 16-capacity LRU sweep over a 12k-request trace >= 10x faster than 16 "
                 "plain-Python replays, identical results. `speedup` = python replays / stack-distance sweep.",
                 values=r)


def table(s: Settings) -> Table:
    return bench_simulator_table(s.repeats)
