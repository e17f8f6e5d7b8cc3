# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python (kvlab)
#     language: python
#     name: kvlab
# ---

# %% [markdown]
# # 09 · Caches under real concurrent traffic
#
# Every system the seeds are about is a server handling concurrent requests. Here kvlab's stores
# run inside mlx-lm's own server (`kv.serve`, continuous batching), `kv.load_test` drives it (and
# any other OpenAI-compatible server) with streamed, concurrent sessions, and the numbers are the
# ones vLLM's `bench serve` reports: TTFT, TPOT, ITL, E2EL percentiles and throughput.
#
# 1. **Seed 004**: prefix caching off vs on (paged) on vLLM's `prefix_repetition`, concurrency 1-8.
# 2. **Seed 001**: several multi-turn users at once under continuous batching: reuse and TTFT per turn.
# 3. **The four stores under the same load**: hit rate, memory held, TTFT percentiles.
# 4. **Correctness under concurrency**: temperature-0 outputs equal the same request served alone
#    with caching off; a float32 batching flip is reported with its top-2 logit gap.
# 5. **The seeds' own server**: vllm-mlx in its three modes beside kvlab serve and plain
#    `mlx_lm.server`, and what each really saves (measured from time) against what it reports.
# 6. **Seed 000 under load**, as far as mlx-lm's server can serve the tiny qwen2_vl.
#
# Defaults run on the tiny random-weight model in a few minutes; `model = "smollm2"` runs the
# embedded SmolLM2-135M-Instruct (slower: set the sizes in the comments).

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import statistics

import openai
import plotly.graph_objects as go
import polars as pl

from kvlab.serving import metrics, peers, savings

# %% tags=["parameters"]
model = "tiny"                 # "smollm2": the embedded SmolLM2-135M-Instruct
concurrency = [1, 2, 4, 8]     # seed 004 ran one level; kvlab sweeps four
prefix_len = 512               # seed 004: 512
suffix_len = 128               # seed 004: 128
num_prompts = 16               # seed 004: 50
output_len = 16                # seed 004: 100
repeats = 1                    # seed 004: 10
users = 4                      # seed 001: users chatting at once
turns = 3
turn_tokens = 32               # tokens each reply generates
stores = ["radix", "paged", "system", "mlx-lru"]
store_workloads = ["shared_system_prompt", "multi_turn"]
store_requests = 12
store_concurrency = 4
budget = None                  # e.g. "64MiB": every store under the same byte budget
correctness_users = 6
correctness_tokens = 16
run_peers = True               # start vllm-mlx (from .venv-peers) and plain mlx_lm.server
vllm_modes = ["simple", "batched", "paged"]
peer_concurrency = 4
peer_requests = 12
calibration_lengths = [16, 256, 512, 1024, 1536]
audit_prefix = 1024
audit_extension = 256
audit_repeats = 3
results_path = "results.parquet"

# %%
m = kv.load(model)
SEED_004 = {"ttft_mean": 8667.88 / 6071.39, "throughput": 288.88 / 210.59}  # published: 1.43x, 1.37x


def row(result, **extra):
    """A load run's summary as one results row."""
    s = result.summary
    return {**extra, **{k: s[k] for k in (
        "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90",
        "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "e2el_ms_p50", "e2el_ms_p99",
        "reused_tokens", "token_hit_rate", "request_hit_rate", "prompt_token_mismatches")}}


# %% [markdown]
# ## 1 · Seed 004: prefix caching off vs on under load
#
# vLLM's `prefix_repetition` (one shared prefix, random suffixes, token ids sent as text that
# re-encodes to the same ids: the `prompt_token_mismatches` column checks it against the server's
# own count). One server per setting; each concurrency level gets a fresh prefix, so each starts
# cold, and the first `c` requests of a level run before anything is cached.

# %%
seed004 = []
for cache, store in (("off", "none"), ("on", "paged")):
    with kv.serve(m, store, block_size=16) as server:
        for rep in range(repeats):
            for c in concurrency:
                r = kv.load_test(server.url, "prefix_repetition", tokenizer=m, concurrency=c,
                                 num_requests=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len,
                                 output_len=output_len, num_prefixes=1, seed=100 * rep + c, progress=False)
                seed004.append(row(r, section="seed004", server="kvlab serve", store=store, cache=cache,
                                   concurrency=c, repeat=rep))
seed004 = pl.DataFrame(seed004)
seed004.select("cache", "concurrency", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "e2el_ms_p50",
               "output_throughput", "token_hit_rate", "request_hit_rate", "prompt_token_mismatches")

# %%
med = seed004.group_by("cache", "concurrency").agg(pl.col(pl.Float64).median())
off = med.filter(pl.col("cache") == "off").sort("concurrency")
on = med.filter(pl.col("cache") == "on").sort("concurrency")
ratios = pl.DataFrame({
    "concurrency": on["concurrency"],
    "TTFT mean off/on": off["ttft_ms_mean"] / on["ttft_ms_mean"],
    "TTFT p50 off/on": off["ttft_ms_p50"] / on["ttft_ms_p50"],
    "TTFT p99 off/on": off["ttft_ms_p99"] / on["ttft_ms_p99"],
    "E2EL p50 off/on": off["e2el_ms_p50"] / on["e2el_ms_p50"],
    "throughput on/off": on["output_throughput"] / off["output_throughput"],
    "token hit rate (on)": on["token_hit_rate"]})
seed_row = pl.DataFrame({"concurrency": [None], "TTFT mean off/on": [SEED_004["ttft_mean"]],
                         "throughput on/off": [SEED_004["throughput"]]}, schema_overrides={"concurrency": pl.Int64})
pl.concat([ratios, seed_row], how="diagonal_relaxed").with_columns(
    pl.when(pl.col("concurrency").is_null()).then(pl.lit("seed 004 (Qwen3-0.6B, vllm-metal)"))
    .otherwise(pl.lit(f"kvlab ({m.name})")).alias("source"))

# %%
fig = go.Figure()
for cache, frame in (("off", off), ("on", on)):
    fig.add_scatter(x=frame["concurrency"], y=frame["ttft_ms_p50"], name=f"cache {cache}: TTFT p50", mode="lines+markers")
    fig.add_scatter(x=frame["concurrency"], y=frame["ttft_ms_p99"], name=f"cache {cache}: TTFT p99",
                    mode="lines+markers", line={"dash": "dot"})
fig.update_layout(title=f"prefix_repetition on kvlab serve ({m.name}): TTFT against concurrency",
                  xaxis_title="concurrency", yaxis_title="ms", xaxis_type="log")
fig

# %% [markdown]
# ## 2 · Seed 001: several multi-turn users at once
#
# Each user's turn sends the server's *own* previous replies back (not canned text), the way a
# chat client does. Reuse per turn is the share of the prompt the server found cached; the
# server's events show requests sharing batch steps (continuous batching).

# %%
with kv.serve(m, "radix") as server:
    chat = kv.load_test(server.url, "multi_turn", concurrency=users, users=users, turns=turns,
                        max_tokens=turn_tokens, progress=False)
    events = server.events
per_turn = (chat.frame.group_by("turn").agg(
    pl.len().alias("requests"), pl.col("prompt_tokens").median().alias("prompt_tokens"),
    (pl.col("reused_tokens").sum() / pl.col("prompt_tokens").sum()).alias("reuse"),
    pl.col("ttft_ms").median().alias("ttft_ms_p50")).sort("turn"))
per_turn

# %%
decoding = (events.filter(pl.col("event").is_in(["first_token", "finish"]))
            .group_by("request").agg(pl.col("step").min().alias("first"), pl.col("step").max().alias("last")))
steps = range(int(events["step"].min() or 0), int(events["step"].max() or 0) + 1)
together = [sum(1 for a, b in zip(decoding["first"], decoding["last"]) if a <= s <= b) for s in steps]
print(f"{chat.frame.height} requests from {users} users; up to {max(together, default=0)} requests decoded "
      f"in one batch step; {sum(t > 1 for t in together)} steps had more than one")
go.Figure(go.Bar(x=per_turn["turn"] + 1, y=per_turn["reuse"], text=per_turn["ttft_ms_p50"].round(1),
                 name="reuse")).update_layout(title="seed 001: reuse per turn (bar text: TTFT p50 ms)",
                                              xaxis_title="turn", yaxis_title="reused / prompt tokens")

# %% [markdown]
# ## 3 · The four stores under the same load
#
# The same workloads, concurrency and budget for each store; `mlx-lru` is mlx-lm's own
# LRUPromptCache observed through kvlab's adapter, so plain mlx-lm is a row too. Memory held is
# the store's bytes after the run (and its peak).

# %%
store_rows, store_frames = [], {}
for store in stores:
    with kv.serve(m, store, budget=budget) as server:
        for wl in store_workloads:
            kw = {"max_tokens": turn_tokens}
            r = kv.load_test(server.url, wl, concurrency=store_concurrency, num_requests=store_requests,
                             progress=False, **kw)
            store_frames[(store, wl)] = r.frame
            store_rows.append(row(r, section="stores", server="kvlab serve", store=store, workload=wl,
                                  concurrency=store_concurrency))
        s = server.stats()
        for x in store_rows[-len(store_workloads):]:
            x.update(bytes_held=s["bytes"], peak_bytes=s["peak_bytes"], entries=s["entries"])
store_table = pl.DataFrame(store_rows)
store_table.select("store", "workload", "token_hit_rate", "request_hit_rate", "ttft_ms_p50", "ttft_ms_p90",
                   "ttft_ms_p99", "bytes_held", "peak_bytes", "entries")

# %%
for store in stores:
    fig = go.Figure()
    for wl in store_workloads:
        f = store_frames[(store, wl)]
        fig.add_scatter(x=f["start_s"], y=f["ttft_ms"], mode="markers", name=wl,
                        marker={"size": 6 + 14 * (f["reused_tokens"] / f["prompt_tokens"]).fill_null(0)},
                        text=[f"reused {a} of {b}" for a, b in zip(f["reused_tokens"], f["prompt_tokens"])])
    fig.update_layout(title=f"store {store}: TTFT of each request (marker size: share reused)",
                      xaxis_title="sent at (s)", yaxis_title="TTFT (ms)")
    fig.show()

# %% [markdown]
# ## 4 · Correctness under concurrency
#
# At temperature 0 each request's output tokens must equal the same request served alone with
# caching off. float32 batching can flip a near-tie between the top two tokens; such a flip is
# reported with the first differing step and the top-2 logit gap there (the alone run's), and
# any flip at a gap above 1e-3 is a failure.

# %%
kw = dict(users=correctness_users, max_tokens=correctness_tokens, record_tokens=True, progress=False)
with kv.serve(m, "radix") as server:
    concurrent = kv.load_test(server.url, "shared_system_prompt", concurrency=4, **kw)
with kv.serve(m, "none") as server:
    alone = kv.load_test(server.url, "shared_system_prompt", concurrency=1, **kw)
compared = metrics.compare_outputs(concurrent.frame, alone.frame)
flips = compared.filter(~pl.col("equal"))
failures = compared.filter(~pl.col("ok"))
print(f"{compared.height} requests compared: {compared['equal'].sum()} identical, {flips.height} flipped "
      f"(at top-2 gaps {flips['gap'].to_list()}), {failures.height} over the {metrics.GAP_TOL} tolerance")
assert failures.height == 0, f"outputs differ beyond a near-tie: {failures.to_dicts()}"
compared

# %% [markdown]
# ## 5 · The seeds' own server: vllm-mlx beside kvlab serve and plain mlx_lm.server
#
# Every server here is a child process on loopback (so none shares the client's process), on the
# same model folder, under the same load. vllm-mlx runs from its own venv (`.venv-peers`) with a
# fresh `HOME` each time. Its usage never reports cached tokens, so its hit rate is its own
# counter; the audit below checks every server's counter against time: a cache-off run of
# unrelated prompts fits prefill time against prompt length, and each request of a run with exact
# repeats and a prefix extension is read back through that fit (`kvlab.serving.savings`).

# %%
def peer_servers():
    out = {f"kvlab serve {s}": (lambda s=s: peers.start_kvlab_serve(m.name if m.name in ("tiny", "smollm2") else str(m.path), s))
           for s in stores}
    out["mlx_lm.server"] = lambda: peers.start_mlx_lm(m)
    out.update({f"vllm-mlx {mode}": (lambda mode=mode: peers.start_vllm_mlx(m, mode)) for mode in vllm_modes})
    return out


cache_off = {"vllm-mlx batched": lambda: peers.start_vllm_mlx(m, "batched", prefix_cache=False),
             "vllm-mlx paged": lambda: peers.start_vllm_mlx(m, "paged", prefix_cache=False),
             "mlx_lm.server": lambda: peers.start_mlx_lm(m, prompt_cache_size=0),
             "kvlab serve radix": lambda: peers.start_kvlab_serve(m.name if m.name in ("tiny", "smollm2") else str(m.path), "none")}
peer_rows, audits = [], []
if run_peers:
    calib = savings.calibration_workload(m, calibration_lengths, repeats=2)
    repeated = savings.repeat_workload(m, audit_prefix, audit_extension, repeats=audit_repeats)
    fits = {}
    for name, start in cache_off.items():
        if name.startswith("vllm-mlx") and name.split()[-1] not in vllm_modes:
            continue
        with start() as srv:
            fits[name] = savings.fit_prefill(kv.load_test(srv.url, calib, tokenizer=m, concurrency=1,
                                                          progress=False).frame)
    for name, start in peer_servers().items():
        with start() as srv:
            if name in fits:  # the audit first, on a cold cache
                on = kv.load_test(srv.url, repeated, tokenizer=m, concurrency=1, progress=False)
                audit_frame = savings.infer_reuse(on.frame, fits[name])
                log = srv.cache_log().tail(on.frame.height)  # vllm-mlx batched logs each lookup
                if name.startswith("vllm-mlx") and log.height == on.frame.height:
                    audit_frame = audit_frame.with_columns(reused_tokens=log["cached"])
                audits.append({"section": "audit", "server": name, **savings.audit(on, fits[name]),
                               "fit": repr(fits[name])})
                store_frames[("audit", name)] = audit_frame
            r = kv.load_test(srv.url, "prefix_repetition", tokenizer=m, concurrency=peer_concurrency,
                             num_requests=peer_requests, prefix_len=prefix_len, suffix_len=suffix_len,
                             output_len=output_len, num_prefixes=1, seed=77, progress=False)
            saved = r.server_delta().get("/v1/cache/stats:engine_cache.tokens_saved")
            peer_rows.append(row(r, section="peers", server=name, concurrency=peer_concurrency,
                                 server_reported_saved=saved))
peer_table = pl.DataFrame(peer_rows) if peer_rows else pl.DataFrame()
peer_table.select("server", "completed", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "e2el_ms_p50",
                  "output_throughput", "token_hit_rate", "server_reported_saved") if peer_rows else "run_peers is off"

# %%
if peer_rows:
    fig = go.Figure(go.Bar(x=peer_table["server"], y=peer_table["ttft_ms_p50"], name="TTFT p50",
                           error_y={"type": "data", "array": (peer_table["ttft_ms_p99"] - peer_table["ttft_ms_p50"]).to_list(),
                                    "arrayminus": [0] * peer_table.height}))
    fig.update_layout(title=f"prefix_repetition at concurrency {peer_concurrency}: TTFT p50 (bar) to p99 (whisker)",
                      yaxis_title="ms")
else:
    fig = "run_peers is off"
fig

# %% [markdown]
# ### Reported against measured savings
#
# `reported` is the server's own count of prompt tokens it saved (vllm-mlx's `tokens_saved`, or
# the usage's `cached_tokens` summed); `inferred` is what the TTFTs say it saved (the fit's
# resolution is shown per request). vllm-mlx's memory-aware cache (batched mode) counts an exact
# repeat as fully saved, then drops the cached state and prefills the whole prompt again (its
# scheduler does so for "exact" and "supersequence" matches to avoid duplicating the last token),
# so its counter runs far ahead of the time it saves. The per-request table shows where.

# %%
audit_table = pl.DataFrame(audits) if audits else pl.DataFrame()
if audits:
    audit_table = audit_table.with_columns((pl.col("reported") - pl.col("inferred")).alias("overcount"))
audit_table

# %%
if ("audit", "vllm-mlx batched") in store_frames:
    detail = store_frames[("audit", "vllm-mlx batched")].select(
        "name", "prompt_tokens", "ttft_ms", pl.col("reused_tokens").alias("reported (its log)"),
        "prefilled_est", "reused_inferred")
else:
    detail = "vllm-mlx batched was not run"
detail

# %% [markdown]
# ## 6 · Seed 000 under load: the tiny qwen2_vl on mlx-lm's server
#
# Text-only requests run concurrently; one image request shows whether mlx-lm's server has a
# vision path for this model.

# %%
vlm = kv.load_vlm("tiny")
with peers.start_mlx_lm(vlm.path) as srv:
    vlm_text = kv.load_test(srv.url, "shared_system_prompt", concurrency=4, num_requests=8, max_tokens=8,
                            system_tokens=120, progress=False)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="kvlab", max_retries=0)
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQ"
             "DwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    try:
        client.chat.completions.create(model="default_model", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": pixel}}, {"type": "text", "text": "What is this?"}]}])
        image_answer = None
    except openai.APIStatusError as e:
        image_answer = f"HTTP {e.status_code}: {e.response.text}"
print(f"text-only under load: {vlm_text.summary['completed']}/{vlm_text.frame.height} ok; "
      f"image request: {image_answer or 'served'}")

# %% [markdown]
# mlx-lm 0.32's server has a vision path only for models whose processor it registers
# (`mlx_lm.processors.PROCESSORS` holds `muse_spark` alone), so it loads qwen2_vl as its language
# model and refuses image parts (the answer above). Concurrent text and image requests, and the
# server's keying of an image by a hash of its URL rather than its bytes, therefore cannot be
# exercised through mlx-lm's server on this model; `05_multimodal` shows the wrong-KV replay and
# content keying on kvlab's own engine instead.

# %% [markdown]
# ## Results

# %%
results = pl.concat(
    [seed004, store_table, peer_table, audit_table.drop("fit") if audits else pl.DataFrame(),
     pl.DataFrame([row(chat, section="seed001", server="kvlab serve", store="radix", concurrency=users)]),
     pl.DataFrame([{"section": "seed001_turns", "turn": t, "reuse": r, "ttft_ms_p50": x}
                   for t, r, x in per_turn.select("turn", "reuse", "ttft_ms_p50").iter_rows()]),
     pl.DataFrame([{"section": "correctness", "compared": compared.height, "identical": int(compared["equal"].sum()),
                    "flips": flips.height, "failures": failures.height}]),
     pl.DataFrame([{"section": "seed000", "server": "mlx_lm.server", "completed": vlm_text.summary["completed"],
                    "image_supported": image_answer is None, "image_answer": image_answer}])],
    how="diagonal_relaxed").with_columns(pl.lit(m.name).alias("model"))
kv.runner.save_results(results, results_path)
