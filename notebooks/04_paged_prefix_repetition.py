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
# # 04 · Paged prefix cache on vLLM's prefix_repetition workload (seed 004)
#
# Seed 004 (vllm-metal#283) turned prefix caching on for the paged path and benchmarked it with
# `vllm bench serve --dataset-name prefix_repetition`: 1 prefix of 512 tokens, 50 prompts with
# 128-token suffixes, 100 output tokens, block size 16, 10 repeats a side; hits 25088/32000 cold
# and 31200/32000 warm. Here:
#
# 1. `kv.simulate` reproduces those hit counts at the seed's sizes (no model needed);
# 2. the engine with a `PagedStore` runs the workload cache off and cache on, `repeats` times each,
#    and reports TTFT and throughput as median and spread, with cold (pass 1) and warm hit rates;
# 3. the engine's hits are checked against `kv.simulate` at the same sizes.
#
# Seed sizes for the engine: `prefix_len=512, suffix_len=128, num_prompts=50, output_len=100, repeats=10`.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import statistics
import time

import numpy as np
import polars as pl
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
prefix_len = 128          # seed 004: 512
suffix_len = 32           # seed 004: 128
num_prompts = 8           # seed 004: 50
output_len = 8            # seed 004: 100
repeats = 3               # seed 004: 10
block_size = 16
seed = 0
sim_prefix_len = 512      # kv.simulate always runs at the seed's sizes (it is model-free)
sim_suffix_len = 128
sim_num_prompts = 50
sim_passes = 2
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %% [markdown]
# ## 1 · The seed's hit counts, simulated

# %%
seed_wl = kv.workloads.prefix_repetition(prefix_len=sim_prefix_len, suffix_len=sim_suffix_len,
                                         num_prompts=sim_num_prompts, num_prefixes=1, output_len=100, seed=seed)
sim_seed = kv.simulate(seed_wl, block_size=block_size, passes=sim_passes).by_pass()
sim_seed

# %% [markdown]
# Cold: the first prompt misses, the other 49 hit the 512-token prefix (49 × 512 = 25088). Warm: each prompt hits its 39 full blocks below the last token (50 × 39 × 16 = 31200); the last token is always recomputed.

# %% [markdown]
# ## 2 · Cache off vs cache on in the engine

# %%
m = kv.load(model)
wl = kv.workloads.prefix_repetition(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
                                    num_prefixes=1, output_len=output_len, seed=seed)

def one_pass(engine):
    start = time.perf_counter()
    results = [engine.run(r, output_len) for r in wl]
    wall = time.perf_counter() - start
    ttft = np.array([r.ttft_s for r in results]) * 1e3
    out = sum(len(r.output_ids) for r in results)
    return {"hit_tokens": sum(r.reused_tokens for r in results),
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "requests_hit": sum(r.reused_tokens > 0 for r in results),
            "ttft_mean_ms": float(ttft.mean()), "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "output_tokens": out,
            "throughput_tok_s": out / wall, "wall_s": wall}

rows = []
for rep in range(1, repeats + 1):
    rows.append({"source": "engine", "cache": "off", "pass": rep, **one_pass(kv.Engine(m, None))})
cached = kv.Engine(m, kv.PagedStore(block_size=block_size))  # one server: its cache persists across passes
for rep in range(1, repeats + 1):
    rows.append({"source": "engine", "cache": "on", "pass": rep, **one_pass(cached)})
engine_runs = pl.DataFrame(rows).with_columns(
    (pl.col("hit_tokens") / pl.col("prompt_tokens")).alias("token_hit_rate"),
    (pl.col("requests_hit") / num_prompts).alias("request_hit_rate"))
engine_runs


# %%
def med_sd(values):
    values = list(values)
    return f"{statistics.median(values):.2f} ± {statistics.pstdev(values):.2f}"

metrics = ["throughput_tok_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms"]
off, on = (engine_runs.filter(pl.col("cache") == c) for c in ("off", "on"))
pl.DataFrame({"metric": metrics,
              "cache off (median ± sd)": [med_sd(off[x]) for x in metrics],
              "cache on (median ± sd)": [med_sd(on[x]) for x in metrics],
              "ratio": [statistics.median(on[x]) / statistics.median(off[x]) if x.startswith("throughput")
                        else statistics.median(off[x]) / statistics.median(on[x]) for x in metrics]})

# %%
cold = on.filter(pl.col("pass") == 1).row(0, named=True)
warm = on.filter(pl.col("pass") > 1)
print(f"cold (pass 1): {cold['token_hit_rate']:.1%} ({cold['hit_tokens']} / {cold['prompt_tokens']})")
for w in warm.iter_rows(named=True):
    print(f"warm (pass {w['pass']}): {w['token_hit_rate']:.1%} ({w['hit_tokens']} / {w['prompt_tokens']})")

# %% [markdown]
# ## 3 · The engine agrees with the simulator

# %%
sim_run = kv.simulate(wl, block_size=block_size, passes=repeats).by_pass()
check = on.select("pass", pl.col("hit_tokens").alias("engine_hits")).join(
    sim_run.select("pass", pl.col("hit_tokens").alias("simulated_hits")), on="pass")
check


# %% [markdown]
# ## Results

# %%
def sim_rows(frame, source):
    return frame.select(pl.lit(source).alias("source"), pl.lit("on").alias("cache"), "pass", "hit_tokens",
                        "prompt_tokens", pl.col("requests_hit").cast(pl.Int64), "token_hit_rate", "request_hit_rate")

results = pl.concat([engine_runs.with_columns(pl.col("requests_hit").cast(pl.Int64)),
                     sim_rows(sim_run, "simulate_run"), sim_rows(sim_seed, "simulate_seed")],
                    how="diagonal_relaxed").with_columns(pl.lit(m.name).alias("model"))
results = kv.runner.save_results(results, results_path, "04_paged_prefix_repetition")

# %% [markdown]
# ## Findings

# %%
seed_hits = results.filter(pl.col("source") == "simulate_seed").sort("pass")
engine_on = results.filter((pl.col("source") == "engine") & (pl.col("cache") == "on")).sort("pass")
engine_off = results.filter((pl.col("source") == "engine") & (pl.col("cache") == "off"))
simulated = results.filter(pl.col("source") == "simulate_run").sort("pass")
agree = sum(a == b for a, b in zip(engine_on["hit_tokens"], simulated["hit_tokens"]))
finding = ("At seed 004's sizes kv.simulate hits " + " and ".join(
    f"{h:,}/{p:,} prompt tokens in pass {i}" for i, h, p in seed_hits.select("pass", "hit_tokens", "prompt_tokens").iter_rows())
    + " (the seed: 25,088/32,000 cold, 31,200/32,000 warm). "
    f"On {m.name} the engine's paged cache hit {engine_on['token_hit_rate'][0]:.0%} of prompt tokens cold and "
    f"{engine_on['token_hit_rate'][-1]:.0%} warm, equal to kv.simulate on {agree} of {engine_on.height} passes; "
    f"median TTFT p50 {engine_off['ttft_p50_ms'].median():.1f} ms off against {engine_on['ttft_p50_ms'].median():.1f} ms on, "
    f"throughput {engine_on['throughput_tok_s'].median() / engine_off['throughput_tok_s'].median():.2f}x.")
Markdown(finding)
