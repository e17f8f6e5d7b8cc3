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
# # 11b · Quantized KV caches: accuracy against bytes, and what reuse adds
#
# mlx-lm can keep the KV cache quantized (`kv_bits`, `kv_group_size`, `quantized_kv_start`: its
# `QuantizedKVCache` stores each token's head vectors as packed 2-8-bit integers plus one scale and
# one bias per group of values). llama.cpp publishes KL-divergence tables per KV type; this notebook
# measures the same on an MLX model:
#
# 1. **The sweep**: a prefix is prefilled in float, the cache is quantized (as mlx-lm's generate
#    does), and the next tokens run teacher-forced through it. KL divergence of their next-token
#    distributions against the float cache, top-1 agreement, and the bytes a token takes (measured,
#    and from the formula `2 · heads · (head_dim·bits/32·4 + 2·head_dim/group·scale_bytes)` per layer).
# 2. **Reuse under quantization**: a cached quantized prefix plus a new suffix, against the cold
#    run. Cold, mlx-lm computes the suffix against float KV and quantizes afterwards; on a hit the
#    suffix attends to the quantized prefix. The difference is the error reuse adds on top of
#    quantization itself.
#
# The model must have a head dimension divisible by an mlx group size (32, 64, 128): the embedded
# SmolLM2 has 64; kvlab's tiny test model has 16, which no group size divides, so it is not used here.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import polars as pl
from kvlab.quantization import SAMPLE_TEXTS

# %% tags=["parameters"]
model = "smollm2"     # quantized KV needs head_dim divisible by 32; "tiny" (head_dim 16) cannot
bits = [2, 4, 8]      # the full table: [2, 3, 4, 6, 8]
group_sizes = None    # None: every mlx group size dividing head_dim (SmolLM2: 32 and 64)
texts = 1             # how many of kvlab's sample paragraphs (3 ship with kvlab)
lengths = [64]        # tokens of context quantized before the evaluated positions
eval_tokens = 32
reuse_prefix = 64     # cached prefix of the reuse experiment
reuse_bits = [4, 8]
reuse_group_size = 64
results_path = "results.parquet"

# %%
m = kv.load(model)
m

# %% [markdown]
# ## 1 · The sweep

# %%
sweep = kv.quantization_sweep(m, list(SAMPLE_TEXTS[:texts]), bits=tuple(bits), group_sizes=group_sizes,
                              lengths=tuple(lengths), eval_tokens=eval_tokens)
summary = (sweep.group_by("kv_format", "bits", "group_size")
           .agg(pl.col("kl_mean").mean(), pl.col("kl_max").max(), pl.col("top1_agree").mean(),
                pl.col("bytes_per_token").first(), pl.col("formula_bytes_per_token").first(),
                pl.col("bytes_ratio").first(), pl.col("peak_extra_bytes").max(), pl.col("seconds").mean())
           .sort("bits", "group_size", nulls_last=True))
summary

# %% [markdown]
# Stored bytes per token equal the formula exactly (the snapshot counts valid tokens only, never
# mlx-lm's preallocated buffer):

# %%
assert (sweep["bytes_per_token"] == sweep["formula_bytes_per_token"].cast(float)).all()
print(sweep.select("kv_format", "bytes_per_token", "formula_bytes_per_token", "bytes_ratio").unique().sort("bytes_ratio"))

# %% [markdown]
# KL divergence against bytes per token, one curve per group size (log scale: each bit halves
# the error roughly; a smaller group size spends bytes on scales to buy accuracy):

# %%
try:
    import plotly.graph_objects as go

    fig = go.Figure(layout={"title": f"KV quantization on {m.name}: KL vs bytes per token",
                            "xaxis_title": "bytes per token (all layers)",
                            "yaxis_title": "mean KL(float || quantized), nats", "yaxis_type": "log"})
    q = summary.filter(pl.col("bits").is_not_null())
    for g in sorted(q["group_size"].unique()):
        part = q.filter(pl.col("group_size") == g).sort("bits")
        fig.add_scatter(x=part["bytes_per_token"], y=part["kl_mean"], mode="lines+markers+text",
                        text=[f"{b}-bit" for b in part["bits"]], textposition="top center",
                        name=f"group size {g}")
except ImportError as e:
    fig = f"plotly is not available: {e}"
fig

# %% [markdown]
# ## 2 · Reuse under quantization
#
# `max_abs_vs_float`: the largest logit difference at the prompt's last position against the float
# cold run; `max_abs_vs_quantized_cold`: against the quantized cold run, i.e. what reuse adds.

# %%
reuse = pl.concat([kv.quantized_reuse_error(m, SAMPLE_TEXTS[1], reuse_prefix, bits=b, group_size=reuse_group_size)
                   .with_columns(pl.lit(b).alias("bits")) for b in reuse_bits])
reuse

# %%
added = reuse.filter(pl.col("case") == "quantized reuse").select("bits", "max_abs_vs_quantized_cold", "kl_vs_quantized_cold")
quant = reuse.filter(pl.col("case") == "quantized cold").select("bits", "max_abs_vs_float", "kl_vs_float")
for (b, a_abs, a_kl), (_, q_abs, q_kl) in zip(added.rows(), quant.rows()):
    print(f"{b}-bit: quantization itself max|Δlogit| {q_abs:.3f} (KL {q_kl:.2e}); "
          f"reuse adds max|Δlogit| {a_abs:.3f} (KL {a_kl:.2e})")

# %% [markdown]
# ## Results

# %%
results = pl.concat([sweep.with_columns(pl.lit("sweep").alias("section")),
                     reuse.with_columns(pl.lit("reuse").alias("section"))], how="diagonal_relaxed")
kv.runner.save_results(results, results_path)
