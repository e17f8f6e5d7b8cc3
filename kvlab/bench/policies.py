"""Every eviction policy's compiled sweep against its plain-Python replay, side by side on the
12k-request Mooncake trace (the public synthetic trace, three copies with fresh ids): median and
spread over repeats, results checked identical; and belady, the optimum, over 16 capacities."""

from __future__ import annotations

import statistics
import time

from .settings import Settings
from .table import Table, median_range

NEEDS_MODEL = False


def bench_policies(trace=None, *, n_requests: int = 12_000, n_capacities: int = 16, repeats: int = 3,
                   python_repeats: int = 1, policies=None) -> dict:
    """Per policy: seconds for ``n_capacities`` plain-Python replays and for the compiled sweep
    (lru: one stack-distance pass; the others: a kernel replay per capacity, capacities in
    parallel threads), the speed-up, ``kv.sweep`` end to end (it adds belady's ceiling), and
    whether the hits are identical. Each policy's contenders run back to back (the compiled ones
    ``repeats`` times, the slow Python side ``python_repeats`` times), so they share the load.

    Example:
        >>> b = bench_policies(n_requests=300, n_capacities=4, repeats=2, policies=["lru", "arc"])
        >>> b["policies"]["arc"]["identical"]
        True
    """
    import numpy as np

    from ..experiments import traces
    from ..policies import POLICIES
    from ..sim.dispatch import sweep_kernel
    from ..sim.kernels_stack import lru_stack_kernel
    from ..sim.prepare import prepare_replay
    from ..sim.reference import run_python
    from ..sim.simulator import sweep

    base = trace if isinstance(trace, traces.Trace) else traces.read(trace)
    if len(base) < n_requests:
        base = base.repeat(-(-n_requests // len(base)))
    t = base.head(n_requests)
    rep = prepare_replay(t, None, 1, None)
    spaced = np.geomspace(max(1, rep.n_blocks // 100), max(1, rep.n_blocks), n_capacities).astype(np.int64)
    caps = sorted({int(x) for x in spaced})
    while len(caps) < n_capacities:
        caps.append(caps[-1] + 1)
    caps_arr = np.array(caps, dtype=np.int64)
    names = list(policies or POLICIES)

    def compiled(name):
        if name == "lru":
            per = lru_stack_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps_arr)
            return per.astype(np.int64)
        return sweep_kernel(rep, name, caps)

    def timed(fn, n):
        out, times = None, []
        for _ in range(max(1, n)):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return out, times

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
        out[name] = {"python_seconds": _stats(py_times), "compiled_seconds": _stats(fast_times),
                     "sweep_api_seconds": _stats(api_times),
                     "speedup": _stats([py / x for x in fast_times]),
                     "speedup_end_to_end": _stats([py / x for x in api_times]),
                     "identical": bool(identical)}
    return {"requests": len(t), "blocks": int(rep.offsets[-1]), "distinct_blocks": rep.n_blocks,
            "capacities_blocks": caps, "policies": out}


def _stats(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


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
                 "lru's compiled sweep is one stack-distance pass; the others replay each capacity, "
                 "capacities in parallel threads. kv.sweep adds preparing the trace and belady's ceiling.",
                 values=r)


def table(s: Settings) -> Table:
    return bench_policies_table(s.repeats)
