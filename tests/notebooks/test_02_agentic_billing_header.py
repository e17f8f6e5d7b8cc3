"""02_agentic_billing_header under papermill: the billing header breaks reuse, normalising fixes it (seed 002)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding, outputs


@pytest.mark.notebook
def test_02_agentic_billing_header(tmp_path):
    df, nb = execute("02_agentic_billing_header", tmp_path)
    assert 20 < df["first_divergence_raw"][0] < 60  # the seed: "prefix divergence at token ~33"
    for store in ("radix", "mlx-lru"):
        later = df.filter((pl.col("store") == store) & (pl.col("step") > 1))
        raw = later.filter(pl.col("mode") == "raw").sort("step")
        norm = later.filter(pl.col("mode") == "normalised").sort("step")
        assert raw.height == norm.height == 2
        assert (norm["reused_tokens"] > raw["reused_tokens"]).all(), store
        # un-normalised reuse stops inside the system message, at the header's cch= field
        assert (raw["reused_tokens"] < raw["system_end"]).all()
        assert raw["diverge_role"].to_list() == ["system", "system"]
        assert (raw["reused_tokens"] <= raw["diverge_token"]).all()
        assert (norm["reuse_ratio"] > 0.8).all()
        raw_share = raw["reused_tokens"].sum() / raw["prompt_tokens"].sum()
        norm_share = norm["reused_tokens"].sum() / norm["prompt_tokens"].sum()
        assert (f"{store} reused {raw_share:.0%} of prompt tokens as sent and {norm_share:.0%} with the "
                "header stripped") in finding(nb)
    assert "cch" in outputs(nb, "d_raw = kv.diverge")
    assert f"first differ at token {df['first_divergence_raw'][0]} (in the system message" in finding(nb)
