"""06_trace_replay under papermill: the vendored Mooncake trace's hit rates against capacity, the
policy that wins, its distance to the optimum, and the published unbounded ratio."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding


@pytest.mark.notebook
def test_06_trace_replay(tmp_path):
    # the trace ships in data/traces/: no skip, a missing trace is a failure
    df, nb = execute("06_trace_replay", tmp_path, capacity_points=6)
    infinite = df.filter(pl.col("policy") == "infinite").row(0, named=True)
    # Mooncake FAST'25 publishes 66% for this trace; kvlab's exact replay, pinned (65.04%, 1,761 requests)
    assert (infinite["hit_tokens"], infinite["prompt_tokens"]) == (39_802_880, 61_194_628)
    assert round(infinite["request_hit_rate"] * 3993) == 1761
    assert infinite["requests"] == 3993 and infinite["capacity_tokens"] is None
    assert infinite["partial_block_tokens"] == 838_020  # trailing partial blocks, never cached
    for policy in ("lru", "fifo", "lfu", "belady"):
        f = df.filter(pl.col("policy") == policy).sort("capacity_tokens")
        assert f.height == 6
        assert f["token_hit_rate"][-1] == pytest.approx(infinite["token_hit_rate"])  # all blocks fit
        assert f["token_hit_rate"][0] < 0.05
    lru = df.filter(pl.col("policy") == "lru").sort("capacity_tokens")["token_hit_rate"]
    assert lru.is_sorted()  # LRU has the stack property: more capacity never hurts
    wide = df.filter(pl.col("capacity_tokens").is_not_null()).pivot(
        on="policy", index="capacity_tokens", values="token_hit_rate").sort("capacity_tokens")
    for p in ("lru", "fifo", "lfu"):
        assert (wide[p] <= wide["belady"] + 1e-12).all()  # no policy beats the optimum

    # the conclusion, recomputed from the results table (mutants: the finding names the policy
    # with the fewest wins; measures the lead against the worst policy instead of the runner-up;
    # types the reproduction verdict instead of comparing 65.0% with 66%)
    text = finding(nb)
    fits = wide["capacity_tokens"].max()
    scarce = wide.filter(pl.col("capacity_tokens") < fits)
    best = scarce.select(pl.max_horizontal("lru", "fifo", "lfu"))["lru"]
    wins = {p: int((scarce[p] >= best - 1e-12).sum()) for p in ("lru", "fifo", "lfu")}
    winner = sorted(wins, key=lambda p: (-wins[p], p))[0]
    assert winner == "lru" and wins["lru"] == scarce.height == 5  # LRU: best or tied at every scarce capacity
    assert text.startswith(f"**LRU wins** on synthetic_trace.jsonl (3,993 requests): the highest token hit rate "
                           f"at 5 of the 5 capacities below {fits:,} tokens")
    leads = [(row["lru"] - max(row["fifo"], row["lfu"]), row) for row in scarce.iter_rows(named=True)]
    lead, row = max(leads, key=lambda x: x[0])
    assert (f"its largest lead is {lead * 100:.1f} points over fifo at {row['capacity_tokens']:,} tokens "
            f"({row['lru']:.1%} against {row['fifo']:.1%}), where the optimum (belady, the ceiling) reaches "
            f"{row['belady']:.1%}, {(row['belady'] - row['lru']) * 100:.1f} points above lru.") in text
    assert ("With every block resident all 3 policies reach the unbounded cache's 65.0% of prompt tokens "
            "(39,802,880 of 61,194,628; per token, vLLM's definition); 44.1% of requests reuse something") in text
    assert ("Mooncake's published 66% for this trace does not reproduce exactly: kvlab replays 65.0%, 1.0 points "
            "lower.") in text
    assert "counting those 838,020 tokens as hits gives 66.4%, which rounds to the published figure" in text
    assert (39_802_880 + 838_020) / 61_194_628 == pytest.approx(0.6641, abs=1e-4)

    # the figure: the optimum black and dashed, named as the ceiling; titles in words (mutant: the
    # default title made of column names)
    fig = next(o.data["application/vnd.plotly.v1+json"] for c in nb.cells if c.cell_type == "code"
               and "hit_rate_curves(" in c.source for o in c.outputs
               if "application/vnd.plotly.v1+json" in o.get("data", {}))
    ceiling = [tr for tr in fig["data"] if tr["name"].startswith("belady")]
    assert [tr["name"] for tr in ceiling] == ["belady (optimum: the ceiling) · token",
                                              "belady (optimum: the ceiling) · request"]
    assert ceiling[0]["line"]["color"] == "black" and ceiling[0]["line"]["dash"] == "dash"
    layout = fig["layout"]
    assert layout["title"]["text"].startswith("hit rate against cache capacity (synthetic_trace.jsonl, 3,993 requests")
    assert "_" not in layout["xaxis"]["title"]["text"] + layout["yaxis"]["title"]["text"]
