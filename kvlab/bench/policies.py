"""Every eviction policy's compiled sweep against its plain-Python replay, side by side on the
12k-request Mooncake trace (the public synthetic trace, three copies with fresh ids): median and
spread over repeats, results checked identical; and belady, the optimum, over 16 capacities."""

from __future__ import annotations

import statistics

from .settings import Settings
from .simulator import sweep_setup
from .table import Table, median_range, spread, timed

NEEDS_MODEL = False


def bench_policies(trace=None, *, n_requests: int = 12_000, n_capacities: int = 16, repeats: int = 3,
                   python_repeats: int = 1, policies=None) -> dict:
    """Per policy: seconds for ``n_capacities`` plain-Python replays and for the compiled sweep
    (lru and belady: one pass over every capacity; the others: a kernel replay per capacity,
    capacities in parallel threads), the speed-up, ``kv.sweep`` end to end (it adds belady's
    ceiling), and whether the hits are identical. The trace and capacities are
    ``bench.simulator.sweep_setup``'s. Each policy's contenders run back to back (the compiled
    ones ``repeats`` times, the slow Python side ``python_repeats`` times), so they share the load.

    Example:
        >>> b = bench_policies(n_requests=300, n_capacities=4, repeats=2, policies=["lru", "arc"])
        >>> b["policies"]["arc"]["identical"]
        True
    """
    import numpy as np

    from ..policies import POLICIES
    from ..sim.dispatch import sweep_kernel
    from ..sim.reference import run_python
    from ..sim.simulator import ONE_PASS, one_pass, sweep

    t, rep, caps = sweep_setup(trace, n_requests, n_capacities)
    names = list(policies or POLICIES)

    def compiled(name):
        return one_pass(rep, name, caps) if name in ONE_PASS else sweep_kernel(rep, name, caps)

    out = {}
    for name in names:  # one policy at a time, its contenders back to back under the same load
        compiled(name)  # compile, or load from numba's cache, before timing
        plain, py_times = timed(lambda: [run_python(rep, name, c, reasons=False).hits for c in caps],
                                python_repeats)
        fast, fast_times = timed(lambda: compiled(name), repeats)
        frame, api_times = timed(lambda: sweep(t, name, [c * rep.block_size for c in caps]), repeats)
        py = statistics.median(py_times)
        identical = (all(np.array_equal(p, fast[:, k]) for k, p in enumerate(plain))
                     and frame["hit_tokens"].to_list() == [int(p.sum()) * rep.block_size for p in plain])
        out[name] = {"python_seconds": spread(py_times), "compiled_seconds": spread(fast_times),
                     "sweep_api_seconds": spread(api_times),
                     "speedup": spread([py / x for x in fast_times]),
                     "speedup_end_to_end": spread([py / x for x in api_times]),
                     "identical": bool(identical)}
    return {"requests": len(t), "blocks": int(rep.offsets[-1]), "distinct_blocks": rep.n_blocks,
            "capacities_blocks": caps, "policies": out}


def bench_policies_table(repeats: int, **kw) -> Table:
    """bench_policies as a table, one row per policy.

    Example:
        >>> bench_policies_table(2, n_requests=300, n_capacities=4, policies=["lru"]).columns[0]
        'policy'
    """
    r = bench_policies(repeats=repeats, **kw)
    rows = tuple((name, f"{v['python_seconds']['median']:.2f}", median_range(v["compiled_seconds"]),
                  median_range(v["speedup"]), median_range(v["sweep_api_seconds"]),
                  median_range(v["speedup_end_to_end"]), v["identical"])
                 for name, v in r["policies"].items())
    caps = r["capacities_blocks"]
    return Table(f"eviction policies: compiled sweep vs plain-Python replays ({r['requests']:,} requests, "
                 f"{len(caps)} capacities)", f"kvlab bench --only policies --repeats {repeats}",
                 ("policy", "python s", "compiled s", "speed-up", "kv.sweep s (with belady)",
                  "speed-up end to end", "identical"), rows,
                 f"{r['blocks']:,} block references, {r['distinct_blocks']:,} distinct; capacities "
                 f"{caps[0]:,}-{caps[-1]:,} blocks, log-spaced. Targets: every policy's compiled sweep "
                 ">= 20x its plain-Python replays with identical hits; belady over 16 capacities < 10 s. "
                 "lru's and belady's compiled sweeps are one pass each (stack distances; the ceiling's "
                 "levels); the others replay each capacity, capacities in parallel threads. kv.sweep adds preparing the trace and belady's ceiling.",
                 values=r)


def table(s: Settings) -> Table:
    return bench_policies_table(s.repeats)
