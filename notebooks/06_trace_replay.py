# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python (kvlab)
#     language: python
#     name: kvlab
# ---

# %% [markdown]
# # 06 · Trace replay: hit rate against capacity
#
# Mooncake's public synthetic trace (512-token blocks, chained and remapped `hash_ids`) replayed
# through LRU, FIFO and LFU block caches of several capacities with `kv.sweep` (model-free), plus
# the unbounded cache. Both hit-rate definitions in use are reported, named: per token (vLLM's)
# and per request (vllm-mlx's). The trace ships with kvlab in `data/traces/` (see its README for
# source and licence); `kv.traces.locate` finds it, or `$KVLAB_TRACES` points elsewhere.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import numpy as np
import polars as pl
from IPython.display import Markdown

# %% tags=["parameters"]
trace = "synthetic_trace.jsonl"   # a file name found by kv.traces.locate, or a path
policies = ["lru", "fifo", "lfu"]
capacity_points = 10              # capacities from 8 blocks to every distinct block, log-spaced
head = 0                          # replay only the first N requests (0: all)
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
from pathlib import Path

path = Path(trace) if Path(trace).is_file() else kv.traces.locate(trace)
t = kv.traces.read(path)
if head:
    t = t.head(head)
t

# %%
unbounded = kv.simulate(t, policy="infinite")
unbounded

# %%
top = t.distinct_blocks * t.block_size
caps = np.geomspace(8 * t.block_size, top, capacity_points)
capacities = sorted({int(c) // t.block_size * t.block_size for c in caps})
sweeps = {p: kv.sweep(t, p, capacities) for p in policies}
sweeps["lru"]

# %%
try:
    fig = kv.viz.hit_rate_curves(sweeps, metric="both")
except ImportError as e:
    fig = f"kv.viz is not available: {e}"
fig

# %% [markdown]
# ## Results

# %%
s = unbounded.summary
results = pl.concat(
    [f.with_columns(pl.lit(p).alias("policy")) for p, f in sweeps.items()]
    + [pl.DataFrame({"capacity_tokens": [None], "token_hit_rate": [s["token_hit_rate"]],
                     "request_hit_rate": [s["request_hit_rate"]], "hit_tokens": [s["hit_tokens"]],
                     "prompt_tokens": [s["prompt_tokens"]], "policy": ["infinite"]},
                    schema_overrides={"capacity_tokens": pl.Int64})],
    how="diagonal_relaxed").with_columns(pl.lit(path.name).alias("trace"), pl.lit(len(t)).alias("requests"))
results = kv.runner.save_results(results, results_path, "06_trace_replay")

# %% [markdown]
# ## Findings

# %%
inf = results.filter(pl.col("policy") == "infinite").row(0, named=True)
cap = capacities[len(capacities) // 2]
at_cap = results.filter(pl.col("capacity_tokens") == cap).sort("token_hit_rate", descending=True)
finding = (f"Replaying {inf['requests']:,} requests of {path.name}, an unbounded cache reuses "
           f"{inf['token_hit_rate']:.1%} of prompt tokens ({inf['hit_tokens']:,} of {inf['prompt_tokens']:,}; "
           f"per token, vLLM's definition) and {inf['request_hit_rate']:.1%} of requests reuse something (per "
           f"request, vllm-mlx's). At {cap:,} tokens ({cap / top:.0%} of every distinct block) the token hit "
           f"ratios are " + ", ".join(f"{p} {r:.1%}" for p, r in at_cap.select("policy", "token_hit_rate").iter_rows()) + ".")
Markdown(finding)
