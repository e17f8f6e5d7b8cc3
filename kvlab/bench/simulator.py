"""Simulator throughput: the LRU stack-distance sweep against plain-Python and compiled per-capacity
replays, on a Mooncake-sized trace; every method must give identical hit counts."""

from __future__ import annotations

import statistics

from .settings import Settings
from .table import Table, median_range, spread, timed

NEEDS_MODEL = False


def sweep_setup(trace=None, n_requests: int = 12_000, n_capacities: int = 16):
    """The trace the simulator benchmarks sweep and its capacities: ``n_requests`` requests of
    ``trace`` (default: the public synthetic trace, repeated with fresh ids per copy), its Replay,
    and ``n_capacities`` distinct capacities in blocks, log-spaced from 1% of its distinct blocks
    to all of them.

    Example:
        >>> t, rep, caps = sweep_setup(n_requests=300, n_capacities=4)
        >>> len(t), len(caps)
        (300, 4)
    """
    import numpy as np

    from ..experiments import traces
    from ..sim.prepare import prepare_replay

    base = trace if isinstance(trace, traces.Trace) else traces.read(trace)
    if len(base) < n_requests:
        base = base.repeat(-(-n_requests // len(base)))
    t = base.head(n_requests)
    rep = prepare_replay(t, None, 1, None)
    spaced = np.geomspace(max(1, rep.n_blocks // 100), max(1, rep.n_blocks), n_capacities).astype(np.int64)
    caps = sorted({int(x) for x in spaced})
    while len(caps) < n_capacities:  # tiny traces: pad with distinct small capacities
        caps.append(caps[-1] + 1)
    return t, rep, caps


def bench_simulator(trace=None, *, n_requests: int = 12_000, n_capacities: int = 16,
                    repeats: int = 3, python_repeats: int = 1) -> dict:
    """Sweep speed-up over plain-Python replays, and replay throughput in blocks/s.

    Sweeps ``n_capacities`` log-spaced LRU capacities of ``sweep_setup``'s trace with the stack
    kernel, and times ``n_capacities`` plain-Python LRU replays; checks the results are equal.
    Times are medians over ``repeats`` (``python_repeats`` for the slow Python side).

    Example:
        >>> b = bench_simulator(repeats=3)
        >>> b["identical"], b["speedup"]["median"] > 10
        (True, True)
    """
    import numpy as np

    from ..sim.dispatch import replay_kernel
    from ..sim.kernels_stack import lru_stack_kernel
    from ..sim.simulator import replay_python, sweep

    t, rep, caps = sweep_setup(trace, n_requests, n_capacities)
    caps_tokens = [c * rep.block_size for c in caps]
    caps_arr = np.array(caps, dtype=np.int64)
    blocks = int(rep.offsets[-1])

    lru_stack_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps_arr)
    replay_kernel(rep, "lru", caps[0])  # compile / load from cache before timing

    stack, t_sweep = timed(lambda: lru_stack_kernel(rep.flat, rep.offsets, rep.hittable,
                                                     rep.inserted, rep.n_blocks, caps_arr), repeats)
    plain, t_python = timed(lambda: [replay_python(rep, "lru", c)[0] for c in caps], python_repeats)
    kern, t_kernel = timed(lambda: [replay_kernel(rep, "lru", c)[0] for c in caps], repeats)
    # the public call end to end: preparing the block arrays and belady's ceiling included
    api, t_api = timed(lambda: sweep(t, "lru", caps_tokens), repeats)
    identical = bool(all(np.array_equal(stack[:, k], plain[k]) and np.array_equal(kern[k], plain[k])
                         for k in range(len(caps)))
                     and api["hit_tokens"].to_list() == [int(p.sum()) * rep.block_size for p in plain])
    py_med = statistics.median(t_python)
    return {
        "requests": len(t), "blocks": blocks, "distinct_blocks": rep.n_blocks,
        "capacities_tokens": caps_tokens, "identical": identical,
        "sweep_seconds": spread(t_sweep), "python_replays_seconds": spread(t_python),
        "numba_replays_seconds": spread(t_kernel), "sweep_api_seconds": spread(t_api),
        "speedup": spread([py_med / x for x in t_sweep]),
        "speedup_end_to_end": spread([py_med / x for x in t_api]),
        "speedup_vs_numba_replays": spread([statistics.median(t_kernel) / x for x in t_sweep]),
        "blocks_per_s": {
            "sweep": spread([blocks * len(caps) / x for x in t_sweep]),
            "numba_replay": spread([blocks * len(caps) / x for x in t_kernel]),
            "python_replay": spread([blocks * len(caps) / x for x in t_python]),
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
