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
    (lru: one stack-distance pass; the others: one kernel replay per capacity), the speed-up,
    ``kv.sweep`` end to end (it adds belady's ceiling), and whether the hits are identical.
    Compiled contenders are interleaved over ``repeats``; the slow Python side runs
    ``python_repeats`` times.

    Example:
        >>> b = bench_policies(n_requests=300, n_capacities=4, repeats=2, policies=["lru", "arc"])
        >>> b["policies"]["arc"]["identical"]
        True
    """
    import numpy as np

    from .. import traces
    from ..policies import POLICIES
    from ..sim.dispatch import run_kernel
    from ..sim.kernels_stack import lru_stack_kernel
    from ..sim.prepare import prepare_replay
    from ..sim.reference import run_python
    from ..simulator import sweep

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
            return [per[:, k].astype(np.int64) for k in range(len(caps))]
        return [run_kernel(rep, name, c, reasons=False).hits for c in caps]

    def api(name):
        return sweep(t, name, [c * rep.block_size for c in caps])

    for name in names:  # compile, or load from numba's cache, before timing
        compiled(name)
    times = {name: {"compiled": [], "api": []} for name in names}
    results = {}
    for _ in range(max(1, repeats)):
        for name in names:
            t0 = time.perf_counter()
            results[name] = compiled(name)
            times[name]["compiled"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            frame = api(name)
            times[name]["api"].append(time.perf_counter() - t0)
            times[name]["frame"] = frame
    out = {}
    for name in names:
        py_times, plain = [], None
        for _ in range(max(1, python_repeats)):
            t0 = time.perf_counter()
            plain = [run_python(rep, name, c, reasons=False).hits for c in caps]
            py_times.append(time.perf_counter() - t0)
        py = statistics.median(py_times)
        frame = times[name]["frame"]
        identical = (all(np.array_equal(a, b) for a, b in zip(plain, results[name]))
                     and frame["hit_tokens"].to_list() == [int(p.sum()) * rep.block_size for p in plain])
        out[name] = {"python_seconds": _stats(py_times), "compiled_seconds": _stats(times[name]["compiled"]),
                     "sweep_api_seconds": _stats(times[name]["api"]),
                     "speedup": _stats([py / x for x in times[name]["compiled"]]),
                     "speedup_end_to_end": _stats([py / x for x in times[name]["api"]]),
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
                 "lru's compiled sweep is one stack-distance pass; the others replay each capacity.")


def table(s: Settings) -> Table:
    return bench_policies_table(s.repeats)
