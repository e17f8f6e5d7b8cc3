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
# # 03 · System-prompt cache vs radix vs paged (seed 003)
#
# Seed 003 (vllm-mlx#175) cached the KV of the system prompt alone (one entry, ChatML boundary,
# token-prefix validation) so that requests sharing a long system prompt only prefill the user part.
# Here the same workload runs with no cache, that single-entry system store, a radix tree and a
# paged block cache, and a final request with a *different* system prompt shows invalidation.
#
# Seed size: `system_tokens=10_000, tools=13` (9,934 tokens in the seed; longer than the tiny
# model's context, so the replay shrinks it to fit and says so).

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import polars as pl
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
users = 4
system_tokens = 600       # seed 003: 10_000
tools = 4                 # seed 003: 13
question_tokens = 32
max_tokens = 8
block_size = 16
seed = 0
stores = ["none", "system", "radix", "paged"]
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
m = kv.load(model)
# the seed's 10K-token system prompt exceeds the context of the small models: shrink it to fit
wl, run_system_tokens = kv.workloads.fit_to_context(
    kv.workloads.shared_system_prompt, m, num_users=users, seed=seed, system_tokens=system_tokens,
    tools=tools, question_tokens=question_tokens, max_tokens=max_tokens)
if run_system_tokens != system_tokens:
    print(f"NOTE: {system_tokens} system tokens exceed {m.name}'s context of {m.context_length}; "
          f"running system_tokens={run_system_tokens}")
system, question = wl[0].messages
# the same question under an edited system prompt: the single entry must be invalidated
changed = [{"role": "system", "content": "Today's date: 2026-01-01.\n" + system["content"]}, dict(question)]
wl

# %% [markdown]
# ## The system boundary
# The single-entry store can only reuse the prefix if the cut after the system message is clean.

# %%
split = kv.split_at_boundary(kv.tokenise(m, list(wl[0].messages)), at="system")
split


# %%
rows = []
requests = [(r.name, r) for r in wl] + [("changed-system", changed)]
for store in stores:
    engine = kv.Engine(m, kv.stores.make_store(store, block_size=block_size), max_tokens=max_tokens)
    for i, (name, request) in enumerate(requests, 1):
        r = engine.run(request, max_tokens)
        rows.append({"store": store, "request": name, "index": i, "prompt_tokens": r.prompt_tokens,
                     "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens,
                     "reuse_ratio": r.reuse_ratio, "ttft_ms": r.ttft_s * 1e3, "match": r.match,
                     "store_bytes": r.store_bytes, "why": r.why,
                     "system_prefix_tokens": len(split.prefix_ids), "split_clean": split.clean,
                     "system_tokens_requested": system_tokens, "system_tokens_run": run_system_tokens})
replay = pl.DataFrame(rows)
replay.select("store", "request", "prompt_tokens", "reused_tokens", "match", "ttft_ms", "store_bytes")

# %%
summary = (replay.filter(pl.col("request").str.starts_with("user-") & (pl.col("index") > 1))
           .group_by("store", maintain_order=True)
           .agg(pl.col("reused_tokens").mean().alias("mean_reused"), pl.col("ttft_ms").median().alias("median_ttft_ms"),
                pl.col("store_bytes").max().alias("store_bytes")))
summary

# %%
try:
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=summary["store"].to_list(), y=summary["median_ttft_ms"].to_list()))
    fig.update_layout(title="median TTFT of users 2..N", yaxis_title="ms", height=300)
except ImportError:
    fig = "plotly is not installed"
fig

# %% [markdown]
# The system store reuses exactly the system prefix; radix also reuses the template tokens that follow it (`<|im_start|>user`), paged only whole blocks. The changed system prompt invalidates the single entry.

# %% [markdown]
# ## Results

# %%
results = replay.with_columns(pl.lit(m.name).alias("model"))
results = kv.runner.save_results(results, results_path, "03_system_prompt_cache")

# %% [markdown]
# ## Findings

# %%
later = results.filter(pl.col("request").str.starts_with("user-") & (pl.col("index") > 1))
per_store = later.group_by("store", maintain_order=True).agg(pl.col("reused_tokens").mean(), pl.col("ttft_ms").median())
changed = dict(results.filter(pl.col("request") == "changed-system").select("store", "reused_tokens").iter_rows())
finding = (f"{'User 2' if users == 2 else f'Users 2-{users}'} on {m.name} share a {results['system_prefix_tokens'][0]}-token system prefix: " + ", ".join(
    f"{s} reused {n:.0f} tokens a request on average (median TTFT {t:.1f} ms)" for s, n, t in per_store.iter_rows())
    + ". After the system prompt changed, the same question reused "
    + ", ".join(f"{n} tokens ({s})" for s, n in changed.items()) + ".")
Markdown(finding)
