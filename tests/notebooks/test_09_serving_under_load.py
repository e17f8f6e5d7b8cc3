"""Notebook 09 (caches under concurrent traffic) is a clean, parameterised jupytext pair, and run
under papermill with its CI defaults its results table says what the seeds and the issue say."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import polars as pl
import pytest

from kvlab.experiments import runner

NB = Path(__file__).resolve().parents[2] / "notebooks" / "09_serving_under_load.ipynb"


def test_committed_notebook_is_clean_paired_and_parameterised():
    nb = nbformat.read(NB, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    assert code[0].source.startswith("import kvlab as kv"), "kvlab must load OpenBLAS before anything imports MLX"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and 'model = "tiny"' in tagged[0].source and '"smollm2"' in tagged[0].source
    declared = runner.notebook_parameters(NB)
    assert declared["results_path"].strip("'\"") == "results.parquet"
    paired = jupytext.read(NB.with_suffix(".py"))
    assert [c.source for c in paired.cells] == [c.source for c in nb.cells], "run `jupytext --sync` on the pair"


@pytest.mark.notebook
def test_09_serving_under_load(tmp_path):
    r = runner.run_notebook(NB, {}, tmp_path / "09", timeout=900)
    assert r.ok
    df = r.results
    sec = {s: df.filter(pl.col("section") == s) for s in df["section"].unique().to_list()}

    # seed 004: every request served, ids round-tripped, the cache on reuses the shared prefix
    s4 = sec["seed004"]
    assert s4.height == 8 and (s4["completed"] == 16).all() and (s4["failed"] == 0).all()
    assert (s4["prompt_token_mismatches"] == 0).all()
    assert (s4.filter(pl.col("cache") == "off")["token_hit_rate"] == 0).all()
    on1 = s4.filter((pl.col("cache") == "on") & (pl.col("concurrency") == 1)).row(0, named=True)
    assert on1["token_hit_rate"] >= 15 * 496 / (16 * 640)  # 15 of 16 reuse the prefix's full blocks
    assert (s4.filter(pl.col("cache") == "on")["token_hit_rate"] > 0.3).all()

    # seed 001: later turns of each user reuse its earlier turns
    turns = sec["seed001_turns"].sort("turn")
    assert turns.height == 3 and (turns["reuse"][1:] > 0.3).all()

    # the four stores: all served, all hold memory, all reuse the shared system prompt
    st = sec["stores"]
    assert sorted(set(st["store"])) == ["mlx-lru", "paged", "radix", "system"]
    assert (st["failed"] == 0).all() and (st["bytes_held"] > 0).all()
    assert (st.filter(pl.col("workload") == "shared_system_prompt")["token_hit_rate"] > 0.2).all()

    # correctness under concurrency: no flip beyond a near-tie
    c = sec["correctness"].row(0, named=True)
    assert c["compared"] == 6 and c["failures"] == 0 and c["identical"] + c["flips"] == 6

    # the peers: three vllm-mlx modes beside kvlab serve's stores and plain mlx_lm.server
    p = sec["peers"]
    assert sorted(p["server"]) == sorted([f"kvlab serve {s}" for s in ("radix", "paged", "system", "mlx-lru")]
                                         + ["mlx_lm.server", "vllm-mlx simple", "vllm-mlx batched", "vllm-mlx paged"])
    assert (p["completed"] == 12).all()
    assert p.filter(pl.col("server") == "vllm-mlx batched")["server_reported_saved"][0] > 0

    # reported against measured: vllm-mlx's memory-aware cache counts exact repeats it re-prefills
    a = {row["server"]: row for row in sec["audit"].iter_rows(named=True)}
    exact_repeat_tokens = 3 * 1024 + 3 * 1280
    assert a["vllm-mlx batched"]["reported"] >= exact_repeat_tokens
    assert a["vllm-mlx batched"]["reported"] - a["vllm-mlx batched"]["inferred"] > exact_repeat_tokens / 2
    for honest in ("vllm-mlx paged", "mlx_lm.server", "kvlab serve radix"):
        assert a[honest]["inferred"] > a[honest]["reported"] / 2, (honest, a[honest])

    # seed 000: mlx-lm's server serves the tiny qwen2_vl's text under load, but has no vision path for it
    v = sec["seed000"].row(0, named=True)
    assert v["completed"] == 8 and v["image_supported"] is False
    assert "Only 'text' content type" in v["image_answer"]
