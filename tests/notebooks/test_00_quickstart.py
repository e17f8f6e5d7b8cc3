"""00_quickstart under papermill: the split, snapshot/restore and one cached request, the magics."""

from __future__ import annotations

import pytest
from notebook_helpers import LOGIT_TOL, execute, finding, outputs


@pytest.mark.notebook
def test_00_quickstart(tmp_path):
    df, nb = execute("00_quickstart", tmp_path)
    r = df.row(0, named=True)
    assert r["model"] == "tiny" and r["split_clean"]
    assert 0 < r["system_prefix_tokens"] < r["prompt_tokens"]
    assert r["restore_max_logit_diff"] < LOGIT_TOL
    assert r["first_reused_tokens"] == 0
    assert r["system_prefix_tokens"] <= r["second_reused_tokens"] < r["second_prompt_tokens"]
    assert r["second_verify_diff"] < LOGIT_TOL
    # the saving is visible: a shared prefix of several hundred tokens, a short suffix to prefill
    assert r["system_prefix_tokens"] >= 300 and r["second_reused_tokens"] >= 300
    assert r["cold_prefilled_tokens"] == r["second_prompt_tokens"]
    assert r["second_prefilled_tokens"] == r["second_prompt_tokens"] - r["second_reused_tokens"]
    assert r["second_prefilled_tokens"] * 10 < r["cold_prefilled_tokens"]
    assert r["ttft_speedup"] == pytest.approx(r["ttft_cold_ms"] / r["ttft_second_ms"])  # measured, not typed
    # the magics print readable text in papermill
    assert "kvlab: loaded Model('tiny'" in outputs(nb, "%kvlab load m")
    assert "kvlab run multi_turn on Engine(tiny" in outputs(nb, "%kvlab run multi_turn")
    assert "kvlab chat: 2 messages, 1 requests" in outputs(nb, "%%kvlab chat")
    stats = outputs(nb, "%kvlab stats")
    assert "token_hit_rate" in stats and "request_hit_rate" in stats
    # the finding states the table's figures
    text = finding(nb)
    assert f"reused {r['second_reused_tokens']} of its {r['second_prompt_tokens']} prompt tokens" in text
    assert f"prefilled {r['second_prefilled_tokens']} instead of {r['cold_prefilled_tokens']}" in text
    assert f"({r['ttft_speedup']:.1f}x)." in text
    # a readable summary, not the clipped 1x16 results frame (mutant: the table displayed raw)
    assert f"| second request: reused / prompt tokens | {r['second_reused_tokens']:,} / {r['second_prompt_tokens']:,} |" in text
    assert f"| snapshot of the prefix | {r['snapshot_bytes'] / 2**10:,.1f} KiB |" in text
    saved = outputs(nb, "results = pl.DataFrame(")
    assert saved.startswith("results: 1 rows x 16 columns -> ") and saved.rstrip().endswith("results.parquet")
