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
# Which store should serve requests that share a long system prompt, and does seed 003's
# single-entry cache behave as published? Seed 003 (vllm-mlx#175) cached the KV of the system prompt alone (one entry, ChatML boundary,
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
# seed 003's published run (Qwen3.5-122B, 9,934-token system prompt): request 1 (miss) and 2 (hit), seconds
SEED_REQUEST_S = (147.0, 90.4)

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

    # bar height and bar text are the same metric; the reuse is in the hover
    fig = go.Figure(go.Bar(x=summary["store"].to_list(), y=summary["median_ttft_ms"].to_list(),
                           text=[f"{t:.1f} ms" for t in summary["median_ttft_ms"]], customdata=summary["mean_reused"],
                           hovertemplate="%{x}: median TTFT %{y:.1f} ms, %{customdata:.0f} tokens reused a request"
                                         "<extra></extra>"))
    fig.update_layout(title=f"median time to first token of users 2-{users} on {m.name}", xaxis_title="store",
                      yaxis_title="median time to first token (ms)", height=320)
except ImportError:
    fig = "plotly is not installed"
fig

# %%
mean_reused = dict(summary.select("store", "mean_reused").iter_rows())
prefix = len(split.prefix_ids)
after = dict(replay.filter(pl.col("request") == "changed-system").select("store", "reused_tokens").iter_rows())


def against_prefix(n):
    """How a mean reuse compares with the system prefix, in words."""
    if abs(n - prefix) < 1e-9:
        return f"exactly the {prefix}-token system prefix"
    return f"{abs(n - prefix):.1f} tokens {'more' if n > prefix else 'fewer'} than the {prefix}-token system prefix"


Markdown("On later users, " + "; ".join(f"**{st}** reused {n:.1f} tokens a request on average"
                                      + ("" if n == 0 else f", {against_prefix(n)}") for st, n in mean_reused.items())
         + ". After the system prompt changed: " + ", ".join(f"{st} reused {n}" for st, n in after.items()) + " tokens.")

# %% [markdown]
# ## Results

# %%
results = replay.with_columns(pl.lit(m.name).alias("model"))
results = kv.runner.save_results(results, results_path, "03_system_prompt_cache")

# %% [markdown]
# ## Findings

# %%
later = results.filter(pl.col("request").str.starts_with("user-") & (pl.col("index") > 1))
per_store = (later.group_by("store", maintain_order=True)
             .agg(pl.col("reused_tokens").mean().alias("reused"), pl.col("ttft_ms").median().alias("ttft"),
                  pl.col("store_bytes").max().alias("bytes"))
             .join(results.filter(pl.col("request") == "changed-system").select("store", pl.col("reused_tokens").alias("after")),
                   on="store", how="left"))
row = {r["store"]: r for r in per_store.iter_rows(named=True)}
prefix = results["system_prefix_tokens"][0]
most = per_store.sort("reused", "store", descending=[True, False]).row(0, named=True)
fastest = per_store.sort("ttft", "store").row(0, named=True)
span = "user 2" if users == 2 else f"users 2-{users}"
exact = later.filter(pl.col("store") == "system")["reused_tokens"].to_list()
invalidated = row["system"]["after"] == 0 if "system" in row else None
seed_saved = 1 - SEED_REQUEST_S[1] / SEED_REQUEST_S[0]
finding = (f"**{most['store']} reuses the most**: on {span}, who share a {prefix}-token system prefix on {m.name}, "
           f"it reused {most['reused']:.1f} tokens a request on average against "
           + ", ".join(f"{s_} {r['reused']:.1f}" for s_, r in row.items() if s_ != most["store"])
           + ". " + (f"It is also the fastest (median TTFT {fastest['ttft']:.1f} ms)." if fastest["store"] == most["store"]
                     else f"The fastest was {fastest['store']} (median TTFT {fastest['ttft']:.1f} ms against "
                          f"{most['ttft']:.1f} ms; timings measured on this machine).")
           + (f" It holds {most['bytes']:,} bytes of KV against the system store's {row['system']['bytes']:,} "
              f"({most['bytes'] / row['system']['bytes']:.1f}x) for {most['reused'] - row['system']['reused']:.1f} more "
              f"tokens a request." if most["store"] != "system" and row.get("system", {}).get("bytes") else "")
           + (f"\n\nSeed 003's single-entry cache {'reproduces' if set(exact) == {prefix} and invalidated else 'does not reproduce'}: "
              f"it reused exactly the system prefix on {sum(e == prefix for e in exact)} of {len(exact)} later users"
              f" and {'nothing' if invalidated else row['system']['after']} after the system prompt changed"
              + (f"; it cut median TTFT from none's {row['none']['ttft']:.1f} ms to {row['system']['ttft']:.1f} ms "
                 f"({1 - row['system']['ttft'] / row['none']['ttft']:.0%} saved; the seed saved "
                 f"{SEED_REQUEST_S[0] - SEED_REQUEST_S[1]:.1f} s of a {SEED_REQUEST_S[0]:.1f} s request, {seed_saved:.0%} "
                 f"of the whole request with generation)" if "none" in row else "") + "."
              if "system" in row else "")
           + "\n\n| store | tokens reused a request | median TTFT | after the change | store bytes |\n|---|---|---|---|---|\n"
           + "".join(f"| {s_} | {r['reused']:.1f} | {r['ttft']:.1f} ms | {r['after']} | {r['bytes']:,} |\n"
                     for s_, r in row.items()))
Markdown(finding)
