"""notebooks/12_hybrid_checkpoints under papermill: every family x policy verified against cold, the
optimum at least every policy at the policy's bytes, and the finding computed from the results
table (not typed)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding

NAME = "12_hybrid_checkpoints"
FAMILIES = ["qwen3_5", "nemotron_h", "mamba2", "gemma3_text"]
POLICIES = ["none", "segment_ends", "message_ends", "last_message", "tail:11", "every:64", "log_spaced",
            "cost_aware", "optimal"]


@pytest.mark.notebook
@pytest.mark.model
def test_12_hybrid_checkpoints(tmp_path):
    df, nb = execute(NAME, tmp_path)
    assert df.columns == ["family", "workload", "policy", "metric", "value", "detail"]
    wide = (df.filter(pl.col("family").is_in(FAMILIES))
            .pivot(on="metric", index=["family", "workload", "policy", "detail"], values="value"))
    runs = sorted(set(zip(wide["family"], wide["workload"])))
    assert runs == sorted([(f, "branching") for f in FAMILIES] + [("qwen3_5", "agentic_loop")])
    for family, workload in runs:
        f = wide.filter((pl.col("family") == family) & (pl.col("workload") == workload))
        assert sorted(f["policy"]) == sorted(POLICIES)
    # restored == cold within the conformance tolerance, for every family and policy
    assert wide["max_logit_diff"].max() <= 1e-4
    assert (wide["optimal_reused_at_bytes"] >= wide["reused_tokens"]).all()
    assert (wide["gap_to_optimal"] == wide["optimal_reused_at_bytes"] - wide["reused_tokens"]).all()
    none = wide.filter(pl.col("policy") == "none")
    assert (none["reused_tokens"] == 0).all() and (none["bytes_held"] == 0).all()
    # the branching workload's shared prefixes do not depend on the family, only the bytes do
    branching = wide.filter((pl.col("workload") == "branching") & (pl.col("policy") == "optimal"))
    assert branching["reused_tokens"].to_list() == [868.0] * len(FAMILIES)
    assert branching["bytes_held"].n_unique() == len(FAMILIES)

    ca = wide.filter((pl.col("policy") == "cost_aware") & (pl.col("family") == "qwen3_5")).sort("workload")
    text = finding(nb)
    ratios = ", ".join(f"{r['workload']} {r['reused_tokens'] / r['optimal_reused_at_bytes']:.1%}"
                       for r in ca.iter_rows(named=True))
    assert f"cost_aware's reused tokens as a share of the optimum's at equal bytes on qwen3_5: {ratios}." in text
    tail = wide.filter(pl.col("policy") == "tail:11").sort("gap_to_optimal", descending=True).row(0, named=True)
    assert (f"**tail:11** reused" in text and f"{tail['gap_to_optimal']:.0f} tokens behind the optimum"
            in text and tail["detail"] in text)
    dense = df.filter(pl.col("policy") == "dense radix")["value"].item()
    assert dense > 0 and f"reused {dense:.0f} tokens of branching with no checkpoint at all" in text
