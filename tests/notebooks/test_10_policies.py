"""notebooks/10_policies under papermill: every policy beside the optimum on the Mooncake trace and a
workload, misses by reason, the three reproductions, and the shared-node radix tree's memory against
the other stores, read back from its results table."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import NOTEBOOKS, execute, finding

from kvlab.policies import MISS_REASONS, ONLINE, POLICIES
from kvlab.sim.reproductions import MOONCAKE_TABLE1

NAME = "10_policies"


def test_10_policies_fills_the_shared_node_radix_section():
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{NAME}.ipynb", as_version=4)
    assert any(c.cell_type == "markdown" and "shared-node radix tree" in c.source for c in nb.cells)
    assert not any("To be added" in c.source for c in nb.cells)


def wide(df: pl.DataFrame, experiment: str) -> pl.DataFrame:
    return (df.filter(pl.col("experiment") == experiment)
            .pivot(on="metric", index=["source", "policy", "capacity_tokens"], values="value"))


@pytest.mark.notebook
def test_10_policies(tmp_path):
    df, nb = execute(NAME, tmp_path, head=800, capacity_points=5, workload_prompts=60)
    assert df.columns == ["experiment", "source", "policy", "capacity_tokens", "metric", "value"]

    for experiment in ("trace_sweep", "workload_sweep"):
        f = wide(df, experiment)
        assert set(f["policy"]) == set(POLICIES)
        # no policy beats the optimum; the ceiling is one number per capacity
        assert (f["token_hit_rate"] <= f["belady_token_hit_rate"] + 1e-12).all(), experiment
        assert (f["gap_to_belady"] >= -1e-12).all()
        best = f.filter(pl.col("policy") == "belady")
        assert best["token_hit_rate"].to_list() == best["belady_token_hit_rate"].to_list()
        assert f.group_by("capacity_tokens").agg(pl.col("belady_token_hit_rate").n_unique())[
            "belady_token_hit_rate"].to_list() == [1] * best.height
    trace = wide(df, "trace_sweep")
    top = trace["capacity_tokens"].max()
    assert trace.filter(pl.col("capacity_tokens") == top)["gap_to_belady"].abs().max() < 1e-12  # all fit
    scarce = trace.filter((pl.col("capacity_tokens") < top) & (pl.col("policy") != "belady"))
    assert scarce["gap_to_belady"].min() > 0  # every online policy leaves room where capacity is scarce

    reasons = wide(df, "miss_reasons")
    assert set(reasons["policy"]) == {"lru", "arc"}
    missed = reasons.select(MISS_REASONS).sum_horizontal() + reasons["hit_tokens"]
    assert (missed == reasons["prompt_tokens"]).all()
    assert reasons["evicted"].max() > 0 and reasons["over_capacity"].max() > 0

    scan = wide(df, "scan_resistance")
    kept = dict(zip(scan["policy"], scan["hot_tokens_kept"]))
    assert set(kept) == set(ONLINE)
    assert kept["lru"] == 0 and kept["arc"] == 1024

    qa = wide(df, "multi_round_qa").sort("source")
    assert qa["reuse_ratio"].to_list() == pytest.approx([0, 1 / 2, 2 / 3, 3 / 4])
    assert qa["reuse_ratio"].to_list() == qa["expected"].to_list()

    t1 = wide(df, "mooncake_table1")
    for policy in ("lru", "lfu", "length_aware"):
        paper = t1.filter(pl.col("policy") == policy).sort("capacity_tokens", nulls_last=True)
        assert paper["paper_hit_rate"].to_list() == list(MOONCAKE_TABLE1[policy])
    for blocks in (1_000, 10_000):
        at = t1.filter(pl.col("capacity_tokens") == blocks * 512)
        r_ = dict(zip(at["policy"], at["token_hit_rate"]))
        assert r_["lru"] > r_["lfu"] > r_["length_aware"]

    mem = wide(df, "store_memory")
    unbounded = mem.filter(pl.col("capacity_tokens").is_null())
    ratio = {(r["source"], r["policy"]): r["bytes_vs_lower_bound"] for r in unbounded.iter_rows(named=True)}
    hit = {(r["source"], r["policy"]): r["token_hit_rate"] for r in unbounded.iter_rows(named=True)}
    for source in ("prefix_repetition", "seed 004"):
        assert ratio[source, "shared-radix"] <= 1.05  # the target: each distinct token stored ~once
        assert ratio[source, "paged"] <= 1.10
        assert hit[source, "shared-radix"] == hit[source, "radix"]  # unbounded: the same reuse
    # RadixStore stores every prompt whole: seed 004's 50 x 640 tokens over its distinct tokens,
    # 512 + 50 x 128 less the suffixes' first tokens that happen to coincide
    import kvlab as kv

    prompts = [r.ids for r in kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
                                                              num_prefixes=1, seed=0)]
    first = {p[512] for p in prompts}
    assert [len(p) for p in prompts] == [640] * 50 and all(p[:512] == prompts[0][:512] for p in prompts)
    assert ratio["seed 004", "radix"] == pytest.approx(50 * 640 / (512 + 50 * 128 - (50 - len(first))))
    assert ratio["prefix_repetition", "radix"] > 3
    budgets = mem.filter(pl.col("capacity_tokens").is_not_null())
    shared = budgets.filter(pl.col("policy") == "shared-radix").sort("capacity_tokens")
    radix = budgets.filter(pl.col("policy") == "radix").sort("capacity_tokens")
    assert shared["capacity_tokens"].to_list() == [1024, 2048, 4096, 8192]
    assert (radix["evictions"] > 0).all() and (shared["evictions"] > 0).all()
    # the shared tree keeps prefixes RadixStore dropped with their entries: it reuses more
    assert (shared["token_hit_rate"] >= radix["token_hit_rate"]).all()
    assert shared["requests_reusing_more"].sum() > 0
    text = finding(nb)
    # the policy to ship per capacity and its gap to the optimum, from the table (mutants: the
    # finding names the worst policy, measures the gap against the best online policy instead of
    # belady, or stops before the capacity where everything fits)
    assert text.startswith("**Which policy to ship** (token hit rate, against belady, the offline optimum).")
    online = trace.filter(pl.col("policy") != "belady")
    for cap in sorted(online["capacity_tokens"].unique()):
        at = online.filter(pl.col("capacity_tokens") == cap)
        best, ceiling = at["token_hit_rate"].max(), at["belady_token_hit_rate"].max()
        if cap == top:
            assert f"at {cap:,} tokens every policy reaches the optimum's {ceiling:.1%} (everything fits)" in text
            continue
        winners = sorted(at.filter(pl.col("token_hit_rate") >= best - 1e-12)["policy"])
        assert f"at {cap:,} tokens ship {winners[0]}" in text
        assert f"{best:.1%}, {(ceiling - best) * 100:.1f} points below the optimum's {ceiling:.1%}" in text
    assert ("On prefix_repetition (60 prompts, two passes): at 256 tokens ship length_aware and lfu: 6.3%, "
            "7.3 points below the optimum's 13.7%; at 1,024 tokens ship length_aware: 25.3%") in text
    # the optimum drawn distinct and named as the ceiling, the axis fitted to the data (mutants:
    # belady coloured like LRU; a 0-100% axis over data that tops at 14.8%)
    curves = [o.data["application/vnd.plotly.v1+json"] for c in nb.cells if c.cell_type == "code"
              and "hit_rate_curves(trace_sweeps" in c.source for o in c.outputs
              if "application/vnd.plotly.v1+json" in o.get("data", {})]
    ceiling = curves[0]["data"][-1]
    assert ceiling["name"] == "belady (optimum: the ceiling)"
    assert (ceiling["line"]["color"], ceiling["line"]["dash"]) == ("black", "dash")
    assert curves[0]["layout"]["yaxis"]["range"][1] < 0.5 and trace["token_hit_rate"].max() < 0.2
    # misses per request aggregated (mutant: one bar per request, 800 bars)
    bars = [o.data["application/vnd.plotly.v1+json"] for c in nb.cells if c.cell_type == "code"
            and c.source.startswith("one = kv.simulate(") for o in c.outputs if "data" in o and
            "application/vnd.plotly.v1+json" in o.data]
    assert 20 <= len(bars[0]["data"][0]["x"]) <= 30
    assert "In LMCache's scan, ARC kept 1024 of the 1024 hot tokens and LRU 0." in text
    assert f"the shared-node radix tree held {ratio['seed 004', 'shared-radix']:.2f}x the bytes" in text
