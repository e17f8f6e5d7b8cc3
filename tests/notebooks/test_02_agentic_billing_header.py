"""02_agentic_billing_header under papermill: the billing header breaks reuse, normalising fixes it,
and the finding says so and whether seed 002's divergence and reuse reproduce (seed 002)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding, outputs


@pytest.mark.notebook
def test_02_agentic_billing_header(tmp_path):
    df, nb = execute("02_agentic_billing_header", tmp_path)
    assert 20 < df["first_divergence_raw"][0] < 60  # the seed: "prefix divergence at token ~33"
    text = finding(nb)
    shares = {}
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
        shares[store] = (raw["reused_tokens"].sum() / raw["prompt_tokens"].sum(),
                         norm["reused_tokens"].sum() / norm["prompt_tokens"].sum())
    assert "cch" in outputs(nb, "d_raw = kv.diverge")

    # the verdict and its figures from the results table (mutants: the raw and stripped shares
    # swapped; "reproduces" typed for the reuse whatever the lowest request reused)
    (rr, rn), (lr, ln) = shares["radix"], shares["mlx-lru"]
    assert text.startswith(f"**Strip the billing header**: with `kv.normalise` radix reused {rn:.0%} of the prompt "
                           f"tokens of requests 2-3 against {rr:.0%} as sent, mlx-lru reused {ln:.0%} of the prompt "
                           f"tokens of requests 2-3 against {lr:.0%} as sent.")
    d = df["first_divergence_raw"][0]
    assert f"consecutive requests first differ at token {d}, in the system message (the header's `cch=`)" in text
    assert (f"Seed 002's divergence at token ~33 reproduces (here {d})" if abs(d - 33) <= 10
            else f"does not reproduce (here {d}") in text
    lowest = df.filter((pl.col("step") > 1) & (pl.col("mode") == "normalised"))["reuse_ratio"].min()
    seed_lowest = 28_457 / 29_485
    assert "its 96.5%-99.7% reuse per request once stripped" in text  # 28,457/29,485 ... 29,650/29,738
    if lowest >= seed_lowest:
        assert f"reproduces: every request here reuses at least {lowest:.1%}." in text
    else:
        assert f"does not: the lowest request here reuses {lowest:.1%}, because each step adds " in text
        steps = df.filter((pl.col("store") == "radix") & (pl.col("mode") == "normalised")).sort("step")
        assert f"new tokens to a prompt of {steps['prompt_tokens'].mean():,.0f} tokens, against 0.3%-3.5% of" in text
    radix = df.filter((pl.col("store") == "radix") & (pl.col("step") > 1))
    raw_ms, norm_ms = (radix.filter(pl.col("mode") == m_)["ttft_ms"].median() for m_ in ("raw", "normalised"))
    assert "Seed 002's prompt eval fell from ~27 s to ~1.8 s (15x) once stripped; here radix's median TTFT " in text
    assert (f"fell from {raw_ms:.1f} ms to {norm_ms:.1f} ms ({raw_ms / norm_ms:.1f}x)" if norm_ms < raw_ms
            else f"did not fall ({raw_ms:.1f} ms as sent, {norm_ms:.1f} ms stripped)") in text
    for store, (r, n) in shares.items():
        assert f"| {store} | {r:.0%} | {n:.0%} | " in text
    # the caption under the summary is computed (mutant: the old typed sentence)
    caption = next(o.data["text/markdown"] for c in nb.cells if c.cell_type == "code"
                   and c.source.startswith("raw_later = ") for o in c.outputs if "text/markdown" in o.get("data", {}))
    raw_later = df.filter((pl.col("step") > 1) & (pl.col("mode") == "raw"))
    assert caption.startswith(f"As sent, requests after the first reused at most {raw_later['reused_tokens'].max()} "
                              f"tokens: 4 of 4 stopped at or before the divergence (token {raw_later['diverge_token'].min()}"
                              f", in the system message")
