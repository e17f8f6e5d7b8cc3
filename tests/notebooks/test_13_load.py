"""13_load under papermill with its defaults: prefix caching off vs on under concurrent load
(seed 004) on kvlab serve, and the same load on every server: kvlab serve's stores, plain
mlx_lm.server and vllm-mlx's three modes."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding

pytestmark = [pytest.mark.notebook, pytest.mark.serving, pytest.mark.peers]


def test_13_load(tmp_path):
    df, nb = execute("13_load", tmp_path)
    sec = {s: df.filter(pl.col("section") == s) for s in df["section"].unique().to_list()}
    assert set(sec) == {"seed004", "peers"}

    # seed 004: every request served, ids round-tripped, the cache on reuses the shared prefix
    s4 = sec["seed004"]
    assert s4.height == 8 and (s4["completed"] == 16).all() and (s4["failed"] == 0).all()
    assert (s4["prompt_token_mismatches"] == 0).all()
    assert (s4.filter(pl.col("cache") == "off")["token_hit_rate"] == 0).all()
    on1 = s4.filter((pl.col("cache") == "on") & (pl.col("concurrency") == 1)).row(0, named=True)
    assert on1["token_hit_rate"] >= 15 * 496 / (16 * 640)  # 15 of 16 reuse the prefix's full blocks
    assert (s4.filter(pl.col("cache") == "on")["token_hit_rate"] > 0.3).all()

    # the peers: three vllm-mlx modes beside kvlab serve's stores and plain mlx_lm.server
    p = sec["peers"]
    assert sorted(p["server"]) == sorted([f"kvlab serve {s}" for s in ("radix", "paged", "system", "mlx-lru")]
                                         + ["mlx_lm.server", "vllm-mlx simple", "vllm-mlx batched", "vllm-mlx paged"])
    assert (p["completed"] == 12).all()
    assert p.filter(pl.col("server") == "vllm-mlx batched")["server_reported_saved"][0] > 0

    # the finding states the table's figures, each latency and throughput with its definition
    text = finding(nb)
    for c in (1, 8):
        on = s4.filter((pl.col("cache") == "on") & (pl.col("concurrency") == c)).row(0, named=True)
        off = s4.filter((pl.col("cache") == "off") & (pl.col("concurrency") == c)).row(0, named=True)
        assert (f"At concurrency {c}, prefix caching (paged) reused {on['token_hit_rate']:.0%} of prompt tokens, "
                f"cut TTFT p50 (first token chunk - send) from {off['ttft_ms_p50']:.0f} ms to "
                f"{on['ttft_ms_p50']:.0f} ms and the TTFT mean {off['ttft_ms_mean'] / on['ttft_ms_mean']:.2f}x") in text
        assert (f"output throughput (output tokens / wall time) was "
                f"{on['output_throughput'] / off['output_throughput']:.2f}x the cache-off figure") in text
    fastest = p.sort("ttft_ms_p50").row(0, named=True)
    assert f"{fastest['server']} had the lowest TTFT p50 of 8 servers" in text
