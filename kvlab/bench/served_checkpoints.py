"""Checkpoint policies served: a hybrid tiny model (tiny:qwen3_5, GatedDeltaNet state beside
attention: reusable only where a snapshot was taken) under agentic load through ``kvlab serve``,
mlx-lm's own ``segment_ends`` against kvlab's policies at equal bytes.

Equal bytes: one calibration run serves the load with ``segment_ends`` and no budget; the peak
bytes its store held become the radix store's ``--budget`` for every row. ``segment_ends`` holds
the same under that budget as without one; a policy that snapshots more must evict to stay within
it. So every row holds at most the same bytes, and ``bytes held`` (the store's peak) shows how
much each used. Each server is a child process on loopback, started fresh for each repeat and
stopped by its pid (``kvlab.serving.peers``); repeats are interleaved across rows.

Example:
    >>> t = bench_served_checkpoints(1, policies=("segment_ends", "message_ends"))
    >>> t.columns[:3]
    ('policy', 'budget', 'reused tokens median (min-max)')
"""

from __future__ import annotations

from .serving import served_load
from .settings import Settings
from .table import Table, spread

NEEDS_MODEL = False  # the section loads its own hybrid model whatever --model says
MODEL = "tiny:qwen3_5"
BASE = "segment_ends"  # mlx-lm's server
POLICIES = (BASE, "message_ends", "cost_aware")
COLUMNS = ("policy", "budget", "reused tokens median (min-max)", "token hit rate",
           "TTFT p50 ms median (min-max)", "TTFT p99 ms median", "bytes held (peak)",
           "reused vs segment_ends", "TTFT p50 vs segment_ends")
# system_tokens: the floor for 2 tools (the same prompt as every smaller value; a load run refuses less)
LOAD = dict(concurrency=3, users=3, turns=3, system_tokens=340, tools=2, result_tokens=40,
            billing_header=False, max_tokens=8)


def bench_served_checkpoints(repeats: int, *, policies=POLICIES, model: str = MODEL, load=None) -> Table:
    """One row per checkpoint policy: reused tokens, TTFT p50/p99 and bytes held, each served
    with the same store budget (see module docstring), and the ratios to ``segment_ends``."""
    from ..primitives.units import fmt_bytes

    load = {**LOAD, **(load or {})}
    budget = _one(model, BASE, None, load)["peak_bytes"]
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for rep in range(repeats):
        for policy in policies:
            runs[policy].append(_one(model, policy, budget, load))
    return _table(runs, budget, repeats, model, load, fmt_bytes)


def _table(runs: dict, budget: int, repeats: int, model: str, load: dict, fmt_bytes) -> Table:
    rows, values = [], {}
    base = runs.get(BASE)
    for policy, xs in runs.items():
        reused, ttft = spread([x["reused_tokens"] for x in xs]), spread([x["ttft_ms_p50"] for x in xs])
        p99, held = spread([x["ttft_ms_p99"] for x in xs]), spread([x["peak_bytes"] for x in xs])
        hit = spread([x["token_hit_rate"] for x in xs])
        vs = ("", "")
        if base:
            b_reused = spread([x["reused_tokens"] for x in base])["median"]
            b_ttft = spread([x["ttft_ms_p50"] for x in base])["median"]
            vs = (f"{reused['median'] / b_reused:.2f}x" if b_reused else "n/a",
                  f"{ttft['median'] / b_ttft:.2f}x" if b_ttft else "n/a")
        rows.append((policy, fmt_bytes(budget), f"{reused['median']:.0f} ({reused['min']:.0f}-{reused['max']:.0f})",
                     f"{hit['median']:.1%}", f"{ttft['median']:.0f} ({ttft['min']:.0f}-{ttft['max']:.0f})",
                     f"{p99['median']:.0f}", fmt_bytes(int(held["max"])), *vs))
        values[policy] = {"reused_tokens": reused["median"], "ttft_ms_p50": ttft["median"],
                          "ttft_ms_p99": p99["median"], "peak_bytes": int(held["max"]),
                          "token_hit_rate": hit["median"]}
    sessions = f"{load['users']} agent sessions of {load['turns']} steps, {load['concurrency']} concurrent"
    notes = (f"Equal bytes: the store budget of every row is the peak bytes `segment_ends` held "
             f"unbounded on the same load ({budget} B); bytes held is each row's peak. Agentic load "
             f"without the per-request billing header (it would break every prefix a few dozen tokens "
             f"in). Requests ending in a tool result are not cut by mlx-lm's server, so `segment_ends` "
             f"keeps only n - 1 of each request and prompt + output.")
    return Table(f"checkpoint policies served: {model} under agentic load ({sessions}, "
                 f"{load['max_tokens']} tokens out) through kvlab serve, radix store",
                 f"kvlab bench --only served_checkpoints --repeats {repeats}", COLUMNS, tuple(rows), notes,
                 values={"runs": values, "budget_bytes": budget, "model": model, "load": load})


def _one(model: str, policy: str, budget, load: dict) -> dict:
    """One fresh ``kvlab serve`` (stopped by pid when done) under the agentic load."""
    from ..serving.peers import start_kvlab_serve

    params = {k: v for k, v in load.items() if k not in ("concurrency", "users")}
    with start_kvlab_serve(model, "radix", budget=budget, extra_args=("--checkpoints", policy)) as srv:
        r = served_load(srv, f"with --checkpoints {policy}", "agentic_loop", concurrency=load["concurrency"],
                        users=load["users"], seed=0, **params)
    s = r.summary
    stats = r.server_after.get("/kvlab/stats") or {}
    return {"reused_tokens": int(s["reused_tokens"] or 0), "token_hit_rate": s["token_hit_rate"] or 0.0,
            "ttft_ms_p50": s["ttft_ms_p50"], "ttft_ms_p99": s["ttft_ms_p99"],
            "peak_bytes": int(stats.get("peak_bytes") or stats.get("bytes") or 0)}


def table(s: Settings) -> Table:
    return bench_served_checkpoints(s.repeats)
