"""notebooks/15_compression under papermill: every press at every ratio measured, bytes exactly
(1 - ratio) of the cache for a scorer press, the compressed system prompt reused whole and
bit-identical to compressing it again, and the findings computed from the results table.

Mutants caught (each run, each fails here): a finding naming the first press instead of the one
with the lowest KL at a ratio; the reuse runs without a store (nothing reused); bytes counted from
the preallocated buffer instead of the kept rows.
"""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding, outputs

NAME = "15_compression"
PRESSES = ["knorm", "streaming_llm", "snapkv", "expected_attention", "tova", "observed_attention", "adakv"]


@pytest.mark.notebook
@pytest.mark.model
def test_15_compression(tmp_path):
    df, nb = execute(NAME, tmp_path)
    assert df.columns == ["section", "press", "ratio", "metric", "value", "model"]
    q = df.filter((pl.col("section") == "quality") & pl.col("press").is_in(PRESSES)).pivot(
        on="metric", index=["press", "ratio"], values="value")
    assert q.height == len(PRESSES) * 3 and (q["kl"] >= 0).all() and q["top1"].is_between(0, 1).all()
    # the tiny random model solves no task: no accuracy counts (gated), the baseline says 0
    assert q["needle_accuracy"].null_count() == q.height
    assert df.filter(pl.col("section") == "baseline")["value"].to_list() == [0.0, 0.0]
    b = df.filter((pl.col("section") == "bytes") & (pl.col("press") == "knorm")).pivot(
        on="metric", index="ratio", values="value").sort("ratio")
    assert (b["bytes_kept"] == (1 - b["ratio"]) * b["bytes_full"]).all()
    reuse = df.filter(pl.col("section") == "reuse").pivot(on="metric", index=["press", "ratio"], values="value")
    reused = reuse.filter(pl.col("press") == "reused").sort("ratio")
    assert reused["reused_tokens"].to_list()[0] == 0 and min(reused["reused_tokens"].to_list()[1:]) > 200
    assert reused["verify_diff"].max() == 0.0
    assert (reuse.filter(pl.col("press") == "recomputed")["reused_tokens"] == 0).all()
    said = outputs(nb, "from kvlab.presses import kvpress_peer")
    assert "kvpress agreement not run here: it compares on the embedded SmolLM2" in said
    view = next(c for c in nb.cells if c.cell_type == "code" and "kv.viz.kept_view(" in c.source)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in view.outputs)

    text = finding(nb)
    for r in (0.25, 0.5, 0.75):
        part = q.filter(pl.col("ratio") == r).sort(["kl", "press"])
        top = part.row(0, named=True)
        assert f"at {r:.0%} removed **{top['press']}** (KL {top['kl']:.3f}, top-1 {top['top1']:.0%})" in text
    for name in PRESSES:
        rows = q.filter(pl.col("press") == name).sort("ratio")
        bad = [x for x, t in zip(rows["ratio"], rows["top1"]) if t < 0.9]
        assert (f"{name} from {bad[0]:.0%}" if bad else f"{name} holds top-1") in text
    assert f"{len(reused) - 1} of {len(reused)} requests restored the compressed system prompt whole" in text
