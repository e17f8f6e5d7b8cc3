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
# # 02 · Agentic loop: the billing header that breaks reuse (seed 002)
#
# Seed 002 (vllm-mlx#90) added prompt caching for agent loops, where successive requests share
# 90-99% of their prompt. A per-request header line at the top of the system prompt,
# `x-anthropic-billing-header: ...; cch=<hash>;`, changes every request and cuts the shared prefix
# to a few dozen tokens. Here: where the prompts diverge, how much each request reuses with and
# without `kv.normalise` (which strips the header), in kvlab's RadixStore and in mlx-lm's own
# LRUPromptCache (the baseline seed 002 used).
#
# Seed size: `system_tokens=28_000, tools=13` (longer than the models' contexts: the divergence
# analysis runs at full size, the engine replay on a system prompt shrunk to fit, and says so).

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import polars as pl
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
turns = 3
system_tokens = 400       # seed 002: 28_000
tools = 4                 # seed 002: 13
result_tokens = 60
max_tokens = 8
seed = 0
stores = ["radix", "mlx-lru"]
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
m = kv.load(model)
sizes = dict(turns=turns, seed=seed, tools=tools, result_tokens=result_tokens, billing_header=True,
             max_tokens=max_tokens)
wl = kv.workloads.agentic_loop(system_tokens=system_tokens, **sizes)
raw = [kv.tokenise(m, list(r.messages)) for r in wl]
norm = [kv.tokenise(m, kv.normalise(list(r.messages))) for r in wl]
print(wl[0].messages[0]["content"].splitlines()[0])
wl

# %% [markdown]
# ## Where two consecutive requests diverge

# %%
d_raw = kv.diverge(raw[0], raw[1])
d_raw

# %%
d_norm = kv.diverge(norm[0], norm[1])
d_norm

# %%
kv.volatile_fields([list(r.messages) for r in wl], model=m)

# %%
try:
    fig = kv.viz.divergence(raw[0], raw[1])
except ImportError as e:
    fig = f"kv.viz is not available: {e}"
fig

# %% [markdown]
# ## Replay through the engine, raw and normalised

# %%
# seed sizes exceed the models' contexts: the same workload with the system prompt shrunk to fit
wl_engine, engine_system_tokens = kv.workloads.fit_to_context(kv.workloads.agentic_loop, m,
                                                              system_tokens=system_tokens, **sizes)
if engine_system_tokens != system_tokens:
    print(f"NOTE: {system_tokens} system tokens exceed {m.name}'s context of {m.context_length}; "
          f"the engine replays system_tokens={engine_system_tokens}")

rows = []
for store in stores:
    for mode in ("raw", "normalised"):
        engine = kv.Engine(m, kv.stores.make_store(store), max_tokens=max_tokens)
        prev = None
        for step, request in enumerate(wl_engine, 1):
            msgs = list(request.messages) if mode == "raw" else kv.normalise(list(request.messages))
            toks = kv.tokenise(m, msgs)
            r = engine.run(toks)
            d = kv.diverge(prev, toks) if prev is not None else None
            rows.append({"store": store, "mode": mode, "step": step, "prompt_tokens": r.prompt_tokens,
                         "reused_tokens": r.reused_tokens, "reuse_ratio": r.reuse_ratio,
                         "ttft_ms": r.ttft_s * 1e3, "match": r.match,
                         "system_end": toks.spans[0].token_end,
                         "diverge_token": None if d is None else d.token_index,
                         "diverge_role": None if d is None else d.role,
                         "system_tokens_requested": system_tokens,
                         "system_tokens_run": engine_system_tokens})
            prev = toks
replay = pl.DataFrame(rows)
replay.select("store", "mode", "step", "prompt_tokens", "reused_tokens", "reuse_ratio", "ttft_ms", "match", "diverge_token", "diverge_role")

# %%
summary = (replay.filter(pl.col("step") > 1).group_by("store", "mode", maintain_order=True)
           .agg(pl.col("reused_tokens").sum(), pl.col("prompt_tokens").sum(), pl.col("ttft_ms").median())
           .with_columns((pl.col("reused_tokens") / pl.col("prompt_tokens")).alias("token_hit_rate")))
summary

# %% [markdown]
# Without normalisation every request after the first reuses only the tokens before `cch=`, inside the system message; with the header stripped each request reuses the whole previous prompt.

# %% [markdown]
# ## Results

# %%
results = replay.with_columns(pl.lit(m.name).alias("model"),
                              pl.lit(d_raw.token_index).alias("first_divergence_raw"))
results = kv.runner.save_results(results, results_path, "02_agentic_billing_header")

# %% [markdown]
# ## Findings

# %%
later = results.filter(pl.col("step") > 1)


def share(store, mode):
    f = later.filter((pl.col("store") == store) & (pl.col("mode") == mode))
    return f["reused_tokens"].sum() / max(1, f["prompt_tokens"].sum())


finding = (f"On {m.name}, two consecutive requests of the agent loop first differ at token "
           f"{results['first_divergence_raw'][0]} (in the {d_raw.role} message, at the billing header's "
           f"`cch=`). Over {'request 2' if turns == 2 else f'requests 2-{turns}'}, " + "; ".join(
               f"{store} reused {share(store, 'raw'):.0%} of prompt tokens as sent and "
               f"{share(store, 'normalised'):.0%} with the header stripped" for store in stores) + ".")
Markdown(finding)
