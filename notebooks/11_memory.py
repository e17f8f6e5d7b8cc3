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
# # 11 · Memory: quantized KV, a disk tier, and what a hit is worth in seconds
#
# A prefix cache trades memory for prefill time. This notebook looks at both sides:
#
# 1. **Quantized KV caches**: mlx-lm's `QuantizedKVCache` (`kv_bits`, `kv_group_size`) keeps each
#    token's head vectors as packed 2-8-bit integers plus a scale and a bias per group. KL
#    divergence of the next-token distributions against the float cache, top-1 agreement and the
#    bytes a token takes (measured, and from the formula), and the error reuse adds on top;
# 2. **Tiers**: a RAM store in front of a `kv.DiskStore` (one safetensors file per entry). RAM
#    evictions are demoted to disk, disk hits promoted back; every hit says which tier served it.
#    A second Engine over a fresh store on the same folder shows the cache surviving a restart;
# 3. **Cost**: a prefill cost model fitted on this machine turns hit rates into seconds: its fit,
#    its residuals on held-out points, a capacity sweep in seconds, and when loading a prefix from
#    RAM or disk beats recomputing it.
#
# Defaults run in a few minutes: tiers and cost on the tiny random-weight model (set `model =
# "smollm2"` for the embedded SmolLM2-135M-Instruct; the RAM budget scales with it: about one
# prompt), quantization on SmolLM2 (`quant_model`): mlx's group sizes are 32, 64 and 128, and the
# tiny model's head dimension (16) is divisible by none of them.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import shutil
import tempfile
from pathlib import Path

import plotly.graph_objects as go
import polars as pl
from kvlab.quantization import SAMPLE_TEXTS
from IPython.display import Markdown, display

# %% tags=["parameters"]
model = "tiny"                 # "smollm2": the embedded SmolLM2-135M-Instruct
ram_prompts = 1.25             # RAM tier budget, in prompts' worth of KV: most reuse must come from disk
disk_path = ""                 # a folder to keep the files in; empty: a temporary one, removed at the end
prefix_len = 64                # the tier workload: vLLM's prefix_repetition
suffix_len = 32
num_prompts = 6
num_prefixes = 3
passes = 2
max_tokens = 2
fit_cached = [0, 256, 1024, 2048]   # the cost model's grid (cached tokens x new tokens)
fit_new = [16, 64, 256, 1024]
fit_holdout = 6                # random points between the grid's, never fitted on
fit_repeats = 3
sweep_capacities = [0, 1024, 2048, 4096, 8192, None]   # tokens (None: unbounded)
crossover_lengths = [256, 1024]
crossover_repeats = 3
quant_model = "smollm2"        # quantized KV needs head_dim divisible by 32; "tiny" (16) cannot
quant_bits = [2, 4, 8]         # the full table: [2, 3, 4, 6, 8]
quant_group_sizes = None       # None: every mlx group size dividing head_dim (SmolLM2: 32 and 64)
quant_texts = 1                # how many of kvlab's sample paragraphs (3 ship with kvlab)
quant_lengths = [64]           # tokens of context quantized before the evaluated positions
quant_eval_tokens = 32
reuse_prefix = 64              # cached prefix of the reuse-under-quantization experiment
reuse_bits = [4, 8]
reuse_group_size = 64
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %% [markdown]
# ## 1 · Quantized KV caches
#
# A prefix is prefilled in float, the cache is quantized (as mlx-lm's generate does), and the next
# tokens run teacher-forced through it. Reuse: a cached quantized prefix plus a new suffix against
# the cold run (cold, mlx-lm computes the suffix against float KV and quantizes afterwards; on a
# hit the suffix attends to the quantized prefix): the difference is what reuse adds on top of
# quantization itself.

# %%
qm = kv.load(quant_model)
qm

# %% [markdown]
# ### The sweep

# %%
qsweep = kv.quantization_sweep(qm, list(SAMPLE_TEXTS[:quant_texts]), bits=tuple(quant_bits),
                               group_sizes=quant_group_sizes, lengths=tuple(quant_lengths),
                               eval_tokens=quant_eval_tokens)
qsummary = (qsweep.group_by("kv_format", "bits", "group_size")
            .agg(pl.col("kl_mean").mean(), pl.col("kl_max").max(), pl.col("top1_agree").mean(),
                 pl.col("bytes_per_token").first(), pl.col("formula_bytes_per_token").first(),
                 pl.col("bytes_ratio").first(), pl.col("peak_extra_bytes").max(), pl.col("seconds").mean())
            .sort("bits", "group_size", nulls_last=True))
qsummary

# %% [markdown]
# Stored bytes per token equal the formula exactly (the snapshot counts valid tokens only, never
# mlx-lm's preallocated buffer):

# %%
print(qsweep.select("kv_format", "bytes_per_token", "formula_bytes_per_token", "bytes_ratio").unique().sort("bytes_ratio"))

# %% [markdown]
# KL divergence against bytes per token, one curve per group size (log scale); the caption under
# the figure measures how fast the error falls per bit on this run.

# %%
qfig = go.Figure(layout={"title": f"KV quantization on {qm.name}: KL vs bytes per token",
                         "xaxis_title": "bytes per token (all layers)",
                         "yaxis_title": "mean KL(float || quantized), nats", "yaxis_type": "log"})
q = qsummary.filter(pl.col("bits").is_not_null())
for g in sorted(q["group_size"].unique()):
    part = q.filter(pl.col("group_size") == g).sort("bits")
    qfig.add_scatter(x=part["bytes_per_token"], y=part["kl_mean"], mode="lines+markers+text",
                     text=[f"{b}-bit" for b in part["bits"]], textposition="top center",
                     name=f"group size {g}")


def per_bit(part):
    """KL's factor per added bit between consecutive bit widths: (KL_lo / KL_hi) ** (1 / bits)."""
    rows = part.sort("bits").select("bits", "kl_mean").rows()
    return [(lo, hi, (a / b) ** (1 / (hi - lo))) for (lo, a), (hi, b) in zip(rows, rows[1:]) if a > 0 and b > 0]


factors = {g: per_bit(q.filter(pl.col("group_size") == g)) for g in sorted(q["group_size"].unique())}
every = [f for fs in factors.values() for _, _, f in fs]
caption = (f"Each added bit divides the mean KL by {min(every):.1f}x to {max(every):.1f}x on this run "
           + "(" + "; ".join(f"group size {g}: " + ", ".join(f"{lo}->{hi} bits {f:.1f}x per bit" for lo, hi, f in fs)
                             for g, fs in factors.items()) + "). "
           if every else "Too few bit widths to measure the error's fall per bit. ")
if q["group_size"].n_unique() > 1 and q["bits"].n_unique() > 0:
    b0 = q["bits"].max()
    at = q.filter(pl.col("bits") == b0).sort("group_size")
    small, large = at.row(0, named=True), at.row(-1, named=True)
    caption += (f"At {b0} bits, group size {small['group_size']} costs {small['bytes_per_token'] - large['bytes_per_token']:,.0f} "
                f"more bytes per token than {large['group_size']} (scales and biases) for a mean KL of "
                f"{small['kl_mean']:.1e} against {large['kl_mean']:.1e}.")
display(qfig, Markdown(caption))

# %% [markdown]
# ### Reuse under quantization
#
# `max_abs_vs_float`: the largest logit difference at the prompt's last position against the float
# cold run; `max_abs_vs_quantized_cold`: against the quantized cold run, i.e. what reuse adds.

# %%
reuse = pl.concat([kv.quantized_reuse_error(qm, SAMPLE_TEXTS[1], reuse_prefix, bits=b, group_size=reuse_group_size)
                   .with_columns(pl.lit(b).alias("bits")) for b in reuse_bits])
reuse

# %%
added = reuse.filter(pl.col("case") == "quantized reuse").select("bits", "max_abs_vs_quantized_cold", "kl_vs_quantized_cold")
quant = reuse.filter(pl.col("case") == "quantized cold").select("bits", "max_abs_vs_float", "kl_vs_float")
lines = []
for (b, a_abs, a_kl), (_, q_abs, q_kl) in zip(added.rows(), quant.rows()):
    line = (f"- **{b}-bit**: quantization itself moves the last logits by up to {q_abs:.3f} (KL {q_kl:.2e} nats); "
            f"reuse adds up to {a_abs:.3f} (KL {a_kl:.2e} nats) on top")
    if a_abs > q_abs:
        line += (f", {a_abs / q_abs:.2f}x quantization's own error. Not a bug: the cold run computes the suffix "
                 "against float KV and quantizes afterwards, while a hit computes every suffix token against the "
                 "quantized prefix, a different perturbation that compounds through the layers, so reuse's error "
                 "is not bounded by the cold run's")
    lines.append(line + ".")
Markdown("\n".join(lines))

# %% [markdown]
# ## 2 · Tiers: RAM in front of disk
#
# The RAM tier (a `RadixStore`) holds about `ram_prompts` prompts; what it evicts is written to the
# disk tier before it is dropped (`demote`), and a lookup that the disk serves better loads the
# file (digest and model checked) and puts it back in RAM (`promote`). The Engine verifies every
# reused request against a cold prefill.

# %%
m = kv.load(model)
folder = Path(disk_path) if disk_path else Path(tempfile.mkdtemp(prefix="kvlab-11-"))
wl = kv.workloads.prefix_repetition(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
                                    num_prefixes=num_prefixes, seed=0)
prompt_bytes = kv.snapshot(kv.prefill(m, wl.requests[0].ids)[1]).nbytes
ram_budget = int(ram_prompts * prompt_bytes)
print(f"one prompt's KV: {prompt_bytes:,} B; RAM tier budget {ram_budget:,} B; disk folder {folder}")


def tiered():
    return kv.make_store("tiered", budget_bytes=ram_budget, disk_path=folder, model=m)


def run(store, passes):
    engine = kv.Engine(m, store, verify=True, max_tokens=max_tokens)
    for p in range(1, passes + 1):
        engine.run_all(wl.requests)
    hits = engine.events.filter(pl.col("event") == "tier_hit").select(
        pl.col("request").alias("request_id"), pl.col("detail").alias("tier"))
    per_request = (engine.results_frame()
                   .select("request_id", "prompt_tokens", "reused_tokens", "match", "verify_diff")
                   .join(hits, on="request_id", how="left")
                   .with_columns(((pl.col("request_id") - 1) // len(wl.requests) + 1).alias("pass"),
                                 pl.col("tier").fill_null("miss")))
    return engine, per_request


store = tiered()
engine, first = run(store, passes)
store.close()  # flush what is still only in RAM, so a restart finds it
print(store, store.stats(), sep="\n")
first

# %%
by_tier = kv.stores.hits_by_tier(engine.events)
by_tier

# %%
per_pass = first.group_by("pass", "tier").agg(pl.len().alias("requests"), pl.col("reused_tokens").sum())
fig = go.Figure([go.Bar(name=tier, x=[f"pass {p}" for p in sorted(first["pass"].unique())],
                        y=[per_pass.filter((pl.col("pass") == p) & (pl.col("tier") == tier))["requests"].sum()
                           for p in sorted(first["pass"].unique())])
                 for tier in ("ram", "disk", "miss")])
fig.update_layout(barmode="stack", title="Which tier served each request", yaxis_title="requests")
fig

# %% [markdown]
# ### Restart
#
# A second Engine over a **fresh** TieredStore on the same folder: its RAM tier starts empty, its
# disk tier rebuilds its index from the files. In another process this is a server restart
# (`tests/integration/test_tiers.py` runs it as two processes).

# %%
store2 = tiered()
print(store2.disk)
engine2, restart = run(store2, 1)
store2.close()
kv.stores.hits_by_tier(engine2.events)

# %% [markdown]
# ## 3 · Cost: prefill seconds on this machine
#
# `kv.cost.fit` times prefill at every (cached, new) grid point and at `fit_holdout` random points
# between them, fits `t = a + b·new + c·new·cached + d·new²` on the grid (least squares on relative
# error, non-negative coefficients; `c` is attention to cached keys, `d` the new tokens attending
# to each other) and reports the error on the held-out points.

# %%
cost = kv.cost.fit(m, cached=fit_cached, new=fit_new, holdout=fit_holdout, repeats=fit_repeats)
cost

# %%
res = cost.residuals()
fig = go.Figure()
for split, symbol in (("fit", "circle"), ("holdout", "diamond")):
    p = res.filter(pl.col("split") == split)
    fig.add_trace(go.Scatter(x=p["seconds"], y=p["relative_error"] * 100, mode="markers", name=split,
                             marker={"symbol": symbol, "size": 9},
                             text=[f"cached {c}, new {n}" for c, n in zip(p["cached"], p["new"])]))
fig.add_hline(y=0, line_dash="dot")
fig.update_layout(title=f"Residuals (held-out MAPE {cost.mape_holdout:.1%})", xaxis_type="log",
                  xaxis_title="measured prefill seconds", yaxis_title="(predicted - measured) / measured, %")
fig

# %% [markdown]
# ### A capacity sweep in seconds
#
# `kv.simulate` replays a workload through an LRU block cache of each capacity; with the cost model
# every request gets an estimated prefill time with and without its hit, so the sweep reads in
# seconds of TTFT saved, not only ratios.

# %%
sweep_wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50, num_prefixes=5, seed=0)
sweep = kv.cost.sweep_seconds(sweep_wl, cost, sweep_capacities, block_size=16, passes=2)
sweep

# %%
labels = ["unbounded" if c is None else f"{c:,}" for c in sweep["capacity_tokens"].to_list()]
# bar height and bar text are the same metric; the hit rate is in the hover
fig = go.Figure([go.Bar(x=labels, y=sweep["est_ttft_saved_s"], name="TTFT saved",
                        text=[f"{s:.2f} s" for s in sweep["est_ttft_saved_s"]],
                        customdata=sweep["token_hit_rate"],
                        hovertemplate="%{x} tokens: %{y:.2f} s saved, token hit rate %{customdata:.0%}<extra></extra>")])
fig.update_layout(title=f"Estimated TTFT saved over {len(sweep_wl.requests) * 2} requests (model {m.name})",
                  xaxis_title="cache capacity, tokens", yaxis_title="seconds saved")
fig

# %% [markdown]
# ### Crossover: restore from RAM, load from disk, or recompute?
#
# Measured here, per prefix length: `kv.restore` of a snapshot held in RAM, a `DiskStore` load
# (read, digest and model check, restore) and a prefill of the same tokens.

# %%
crossover = kv.cost.crossover(m, crossover_lengths, repeats=crossover_repeats)
crossover.select("prefix_tokens", pl.col("bytes").alias("KV bytes"),
                 *[(pl.col(c) * 1e3).round(3).alias(f"{c} (ms)") for c in ("ram_restore", "disk_load", "recompute")],
                 pl.col("disk_load_MBps").round(1).alias("disk load (MB/s)"), "fastest")

# %% [markdown]
# ## Results

# %%
def tier_rows(frame, phase):
    return (frame.group_by("pass", "tier").agg(pl.len().alias("requests"), pl.col("reused_tokens").sum(),
                                              pl.col("verify_diff").max().alias("max_verify_diff"))
            .with_columns(pl.lit("tiers").alias("section"), pl.lit(phase).alias("phase")))


fit_row = pl.DataFrame([{"section": "cost_fit", **cost.coefficients(), "mape_fit": cost.mape_fit,
                         "mape_holdout": cost.mape_holdout,
                         "points_fit": cost.points.filter(pl.col("split") == "fit").height,
                         "points_holdout": cost.points.filter(pl.col("split") == "holdout").height}])
results = pl.concat([
    tier_rows(first, "first"), tier_rows(restart, "restart"),
    pl.DataFrame([{"section": "tier_stats", "phase": "first", **store.stats()},
                  {"section": "tier_stats", "phase": "restart", **store2.stats()}]),
    fit_row,
    cost.residuals().with_columns(pl.lit("cost_points").alias("section")),
    sweep.with_columns(pl.lit("sweep").alias("section")),
    crossover.with_columns(pl.lit("crossover").alias("section")),
], how="diagonal_relaxed").with_columns(pl.lit(m.name).alias("model"))
results = pl.concat([results, qsweep.with_columns(pl.lit("quant_sweep").alias("section"), pl.lit(qm.name).alias("model")),
                     reuse.with_columns(pl.lit("quant_reuse").alias("section"), pl.lit(qm.name).alias("model"))],
                    how="diagonal_relaxed")
if not disk_path:
    shutil.rmtree(folder, ignore_errors=True)
results = kv.runner.save_results(results, results_path, "11_memory")

# %% [markdown]
# ## Findings

# %%
qrows = (results.filter(pl.col("section") == "quant_sweep").group_by("kv_format", "bits", "group_size")
         .agg(pl.col("kl_mean").mean(), pl.col("bytes_ratio").first(), pl.col("bytes_per_token").first(),
              (pl.col("bytes_per_token") == pl.col("formula_bytes_per_token")).all().alias("as_formula"))
         .filter(pl.col("bits").is_not_null()).sort("bits", "group_size"))
restarted = results.filter((pl.col("section") == "tiers") & (pl.col("phase") == "restart"))
from_disk = restarted.filter(pl.col("tier") == "disk")
fitted = results.filter(pl.col("section") == "cost_fit").row(0, named=True)
cross = results.filter(pl.col("section") == "crossover").sort("prefix_tokens")
wins = cross.filter(pl.col("disk_load") < pl.col("recompute"))["prefix_tokens"].to_list()
disk_sentence = ("; ".join(f"at {r['prefix_tokens']:,} tokens ({r['bytes'] / 2**20:.2f} MiB of KV) restoring from RAM "
                           f"took {r['ram_restore'] * 1e3:.2f} ms, loading from disk {r['disk_load'] * 1e3:.2f} ms and "
                           f"recomputing {r['recompute'] * 1e3:,.2f} ms" for r in cross.iter_rows(named=True))
                 + ". " + (f"The disk beats recompute at {', '.join(f'{w:,}' for w in wins)} tokens (measured on this machine)."
                           if wins else f"The disk never beats recompute up to {cross['prefix_tokens'].max():,} tokens "
                                        f"on {m.name} (a small model recomputes fast; measured on this machine)."))
float_bytes = results.filter((pl.col("section") == "quant_sweep") & (pl.col("kv_format") == "float32"))["bytes_per_token"][0]
finding = (f"**Bytes against error** on {qm.name} (float32: {float_bytes:,.0f} B per token): " + "; ".join(
    f"{b}-bit, group {g}: {n:,.0f} B per token ({r:.0%} of float32), mean KL {kl:.1e} nats"
    for _, b, g, kl, r, n, _ in qrows.iter_rows())
           + f". Stored bytes equal the formula for {qrows['as_formula'].sum()} of {qrows.height} formats.\n\n"
           f"**Tiers**: after a restart the disk tier served {from_disk['requests'].sum()} of {restarted['requests'].sum()} "
           f"requests ({from_disk['reused_tokens'].sum()} tokens).\n\n"
           f"**Disk or recompute** on {m.name} (the prefill cost model's held-out error is {fitted['mape_holdout']:.1%}): "
           + disk_sentence)
Markdown(finding)
