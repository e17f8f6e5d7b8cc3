"""Published observations about prefix-cache policies, rebuilt on kvlab's simulator. Each
returns a polars frame; tests/unit/test_reproductions.py asserts them and notebook
10_policies shows them.

Example:
    >>> scan_resistance(["lru", "arc"])["hot_tokens_kept"].to_list()
    [0, 1024]
"""

from __future__ import annotations

import numpy as np
import polars as pl

from ..policies import ONLINE
from ..request import Request, Workload

# arXiv 2407.00079v3 (Mooncake), section 4.2, Table 1: cache hit rate by block capacity (512-token
# blocks) on the paper's 23,608-request trace, one global cache pool.
MOONCAKE_TABLE1 = {
    "capacity_blocks": (1_000, 10_000, 30_000, 50_000, 100_000, None),
    "lru": (0.30, 0.40, 0.48, 0.50, 0.51, 0.51),
    "lfu": (0.30, 0.35, 0.43, 0.49, 0.51, 0.51),
    "length_aware": (0.30, 0.35, 0.42, 0.48, 0.50, 0.51),
}
MOONCAKE_SOURCE = "https://arxiv.org/abs/2407.00079 (v3, section 4.2, Table 1)"


def scan_resistance(policies=ONLINE, *, hot_tokens: int = 1024, block_size: int = 16, hot_uses: int = 3,
                    scan_requests: int = 40, capacity_tokens: int = 2048, seed: int = 0) -> pl.DataFrame:
    """LMCache's scan-resistance case: a hot prompt prefix of ``hot_tokens`` used ``hot_uses``
    times, then a cold scan of ``scan_requests`` one-off prompts (together far larger than the
    cache), then the hot prefix again. ``hot_tokens_kept``: how much of it the last request reuses.
    Each hot request is the hot prefix plus one block of its own, so the whole prefix is hittable.

    Example:
        >>> scan_resistance(["lru"])["hot_tokens_kept"].item()
        0
    """
    from .simulator import simulate

    rng = np.random.default_rng(seed)
    fresh = iter(range(1_000_000, 100_000_000))
    hot = tuple(int(x) for x in rng.integers(0, 50_000, hot_tokens))

    def tail(n):
        return tuple(next(fresh) for _ in range(n))

    reqs = [hot + tail(block_size) for _ in range(hot_uses)]
    reqs += [tail(hot_tokens + block_size) for _ in range(scan_requests)]
    reqs.append(hot + tail(block_size))
    wl = Workload("scan_resistance", tuple(Request(ids=ids, max_tokens=1, name=f"r{i}") for i, ids in enumerate(reqs)))
    rows = []
    for policy in policies:
        r = simulate(wl, policy, capacity_tokens, block_size)
        rows.append({"policy": policy, "hot_tokens": hot_tokens, "capacity_tokens": capacity_tokens,
                     "scan_tokens": scan_requests * (hot_tokens + block_size),
                     "hot_tokens_kept": min(hot_tokens, int(r.requests["hit_tokens"][-1]))})
    return pl.DataFrame(rows)


def multi_round_qa(rounds: int = 4, round_tokens: int = 512, block_size: int = 16, seed: int = 0) -> pl.DataFrame:
    """Mooncake's multi-round QA observation: round r's prompt is every earlier round plus a new
    one of the same length, so with an unbounded cache it reuses r / (r + 1) of its prompt.

    Example:
        >>> multi_round_qa()["reuse_ratio"].round(2).to_list()
        [0.0, 0.5, 0.67, 0.75]
    """
    from .simulator import simulate

    rng = np.random.default_rng(seed)
    pieces = [tuple(int(x) for x in rng.integers(0, 50_000, round_tokens)) for _ in range(rounds)]
    reqs = tuple(Request(ids=sum(pieces[: r + 1], ()), max_tokens=1, name=f"round-{r}") for r in range(rounds))
    f = simulate(Workload("multi_round_qa", reqs), "infinite", None, block_size).requests
    return pl.DataFrame({"round": list(range(rounds)), "prompt_tokens": f["prompt_tokens"],
                         "reused_tokens": f["hit_tokens"],
                         "reuse_ratio": f["hit_tokens"] / f["prompt_tokens"],
                         "expected": [r / (r + 1) for r in range(rounds)]})


def mooncake_table1(trace=None, policies=("lru", "lfu", "length_aware")) -> pl.DataFrame:
    """Mooncake Table 1's grid (1k-100k blocks of 512 tokens, and unbounded) replayed on a trace
    (default: the public synthetic one kvlab ships), the paper's numbers beside kvlab's. The
    paper's trace is its 23,608-request sample, not this one, so compare shapes, not values.

    Example:
        >>> mooncake_table1().columns
        ['policy', 'capacity_blocks', 'token_hit_rate', 'block_hit_rate', 'paper_hit_rate', 'belady_token_hit_rate']
    """
    from ..experiments import traces
    from .simulator import sweep

    t = trace if isinstance(trace, traces.Trace) else traces.read(trace)
    caps = list(MOONCAKE_TABLE1["capacity_blocks"])
    rows = []
    for policy in policies:
        f = sweep(t, policy, [None if c is None else c * t.block_size for c in caps])
        paper = MOONCAKE_TABLE1.get(policy, (None,) * len(caps))
        for c, row, p in zip(caps, f.iter_rows(named=True), paper):
            rows.append({"policy": policy, "capacity_blocks": c, "token_hit_rate": row["token_hit_rate"],
                         "block_hit_rate": row["hit_tokens"] / t.block_size / t.blocks,
                         "paper_hit_rate": p, "belady_token_hit_rate": row["belady_token_hit_rate"]})
    return pl.DataFrame(rows, schema={"policy": pl.Utf8, "capacity_blocks": pl.Int64,
                                      "token_hit_rate": pl.Float64, "block_hit_rate": pl.Float64,
                                      "paper_hit_rate": pl.Float64, "belady_token_hit_rate": pl.Float64})
