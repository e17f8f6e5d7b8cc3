"""04_paged_prefix_repetition under papermill: the seed's hit counts and the engine agreeing with kv.simulate (seed 004)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding


@pytest.mark.notebook
def test_04_paged_prefix_repetition(tmp_path):
    df, nb = execute("04_paged_prefix_repetition", tmp_path, repeats=2)
    seed = df.filter(pl.col("source") == "simulate_seed").sort("pass")
    assert seed.select("hit_tokens", "prompt_tokens").rows() == [(25088, 32000), (31200, 32000)]
    off = df.filter((pl.col("source") == "engine") & (pl.col("cache") == "off"))
    on = df.filter((pl.col("source") == "engine") & (pl.col("cache") == "on")).sort("pass")
    sim = df.filter(pl.col("source") == "simulate_run").sort("pass")
    assert off["hit_tokens"].to_list() == [0, 0]
    assert on["hit_tokens"].to_list() == sim["hit_tokens"].to_list()  # the engine agrees with kv.simulate
    # 8 prompts of 128 + 32: cold hits 7 x 128, warm 8 x 9 blocks of 16
    assert on.select("hit_tokens", "prompt_tokens").rows() == [(896, 1280), (1152, 1280)]
    assert (on["throughput_tok_s"] > 0).all() and (off["ttft_p99_ms"] >= off["ttft_p50_ms"]).all()
    text = finding(nb)
    assert ("kv.simulate hits 25,088/32,000 prompt tokens in pass 1 and 31,200/32,000 prompt tokens in pass 2"
            in text)
    assert "hit 70% of prompt tokens cold and 90% warm, equal to kv.simulate on 2 of 2 passes" in text
