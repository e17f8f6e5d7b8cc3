# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
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
# # 09 · Serving: kvlab's stores inside a real server
#
# Every system the seeds are about is a server handling concurrent requests. Here kvlab's stores
# run inside mlx-lm's own server (`kv.serve`: continuous batching, OpenAI routes) and this notebook
# looks at what the server's cache does with each request; `13_load` measures what that is worth
# in latency and throughput as the load grows.
#
# 1. **The four stores under the same traffic**: what each reused per request and why the rest
#    missed, memory held, both hit rates (named).
# 2. **Seed 001**: several multi-turn users at once under continuous batching: reuse per turn.
# 3. **Correctness under concurrency**: temperature-0 outputs equal the same request served alone
#    with caching off; a float32 batching flip is reported with its top-2 logit gap.
# 4. **What a server says it saved against what it saved**: vllm-mlx (the seeds' server), plain
#    `mlx_lm.server` and kvlab serve, each server's own counter read back against its TTFTs.
# 5. **Seed 000**: the tiny qwen2_vl on mlx-lm's server, as far as that server can serve it.
#
# Defaults run on the tiny random-weight model in a few minutes; `model = "smollm2"` runs the
# embedded SmolLM2-135M-Instruct.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import openai
import plotly.graph_objects as go
import polars as pl
from IPython.display import Markdown

from kvlab.policies import ALL_REASONS
from kvlab.serving import metrics, peers, savings

# %% tags=["parameters"]
model = "tiny"                 # "smollm2": the embedded SmolLM2-135M-Instruct
stores = ["radix", "paged", "system", "mlx-lru"]
budget = None                  # e.g. "64MiB": every store under the same byte budget
requests = 12                  # requests per workload and store
concurrency = 4                # requests in flight
max_tokens = 32                # tokens each reply generates
users = 4                      # seed 001: users chatting at once
turns = 3
audited = ["kvlab serve radix", "mlx_lm.server", "vllm-mlx batched", "vllm-mlx paged"]  # []: no peers
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
m = kv.load(model)
WORKLOADS = ["shared_system_prompt", "multi_turn"]

m

# %% [markdown]
# ## 1 · The four stores under the same traffic
#
# The same workloads, concurrency and budget for each store; `mlx-lru` is mlx-lm's own
# LRUPromptCache observed through kvlab's adapter, so plain mlx-lm is a row too. Memory held is
# the store's bytes after the run (and its peak). Two hit rates, named: **per token** (reused /
# prompt tokens, vLLM's) and **per request** (share of requests that reused anything, vllm-mlx's).

# %%
store_rows, store_frames, served = [], {}, []
for store in stores:
    with kv.serve(m, store, budget=budget) as server:
        for wl in WORKLOADS:
            r = kv.generate_load(server.url, wl, concurrency=concurrency, num_requests=requests,
                             max_tokens=max_tokens, progress=False)
            store_frames[(store, wl)] = r.frame
            store_rows.append(r.row(section="stores", server="kvlab serve", store=store, workload=wl,
                                  concurrency=concurrency))
        s = server.stats()
        for x in store_rows[-len(WORKLOADS):]:
            x.update(bytes_held=s["bytes"], peak_bytes=s["peak_bytes"], entries=s["entries"])
        served += [{"store": store, **res.row()} for res in server.results]
store_table = pl.DataFrame(store_rows)
store_table.select("store", "workload", "token_hit_rate", "request_hit_rate", "ttft_ms_p50", "bytes_held",
                   "peak_bytes", "entries")

# %% [markdown]
# ### Per request: what the server's cache reused, and why the rest missed
#
# `server.results` are the server's own `kv.Result`s: the tokens each request reused, how it
# matched, and (with kvlab's stores) every missed prompt token under one reason
# (`kvlab.policies.reasons`: `first_seen`, `evicted`, `diverged`, `partial_block`, ...; null where
# the store cannot say).

# %%
served = pl.DataFrame(served, infer_schema_length=None)  # a store that cannot say gives null reasons
reasons = [r for r in ALL_REASONS if r in served.columns]
per_request = served.select("store", "request_id", "prompt_tokens", "reused_tokens", "match", *reasons)
per_request.filter(pl.col("store") == stores[0])

# %%
missed = (per_request.group_by("store", maintain_order=True)
          .agg(pl.col("prompt_tokens").sum(), pl.col("reused_tokens").sum(), *[pl.col(r).sum() for r in reasons])
          .with_columns((pl.col("prompt_tokens") - pl.col("reused_tokens")).alias("missed_tokens")))
missed

# %%
for store in stores:
    fig = go.Figure()
    for wl in WORKLOADS:
        f = store_frames[(store, wl)]
        fig.add_scatter(x=f["start_s"], y=f["ttft_ms"], mode="markers", name=wl,
                        marker={"size": 6 + 14 * (f["reused_tokens"] / f["prompt_tokens"]).fill_null(0)},
                        text=[f"reused {a} of {b}" for a, b in zip(f["reused_tokens"], f["prompt_tokens"])])
    fig.update_layout(title=f"store {store}: TTFT (first token chunk - send) of each request "
                            "(marker size: share reused)", xaxis_title="sent at (s)", yaxis_title="TTFT (ms)")
    fig.show()

# %% [markdown]
# ## 2 · Seed 001: several multi-turn users at once
#
# Each user's turn sends the server's *own* previous replies back (not canned text), the way a
# chat client does. Reuse per turn is the share of the prompt the server found cached; the
# server's events show requests sharing batch steps (continuous batching).

# %%
with kv.serve(m, "radix") as server:
    chat = kv.generate_load(server.url, "multi_turn", concurrency=users, users=users, turns=turns,
                        max_tokens=max_tokens, progress=False)
    events = server.events
per_turn = (chat.frame.with_columns(pl.col("turn") + 1).group_by("turn").agg(  # turns 1-based, as users count
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
# bar height and bar text are the same metric (reuse); the TTFT is in the hover
go.Figure(go.Bar(x=per_turn["turn"].to_list(), y=per_turn["reuse"].to_list(), text=[f"{r:.0%}" for r in per_turn["reuse"]],
                 customdata=per_turn["ttft_ms_p50"], name="reuse",
                 hovertemplate="turn %{x}: %{y:.0%} of the prompt reused, TTFT p50 %{customdata:.1f} ms<extra></extra>")
          ).update_layout(title=f"seed 001: reuse per turn, {users} users at once",
                          xaxis=dict(title="turn (1-based)", tickmode="array", tickvals=per_turn["turn"].to_list()),
                          yaxis=dict(title="share of the prompt reused", tickformat=".0%"))

# %% [markdown]
# ## 3 · Correctness under concurrency
#
# At temperature 0 each request's output tokens must equal the same request served alone with
# caching off. float32 batching can flip a near-tie between the top two tokens; such a flip is
# reported with the first differing step and the top-2 logit gap there (the alone run's); a flip
# at a gap above `metrics.GAP_TOL` counts as a failure.

# %%
kw = dict(users=6, max_tokens=16, record_tokens=True, progress=False)
with kv.serve(m, "radix") as server:
    concurrent = kv.generate_load(server.url, "shared_system_prompt", concurrency=concurrency, **kw)
with kv.serve(m, "none") as server:
    alone = kv.generate_load(server.url, "shared_system_prompt", concurrency=1, **kw)
compared = metrics.compare_outputs(concurrent.frame, alone.frame)
flips = compared.filter(~pl.col("equal"))
failures = compared.filter(~pl.col("ok"))
print(f"{compared.height} requests compared: {compared['equal'].sum()} identical, {flips.height} flipped "
      f"(at top-2 gaps {flips['gap'].to_list()}), {failures.height} over the {metrics.GAP_TOL} tolerance")
compared

# %% [markdown]
# ## 4 · What each server says it saved, against what its TTFTs say
#
# Every server here is a child process on loopback, on the same model folder. vllm-mlx runs from
# its own venv (`.venv-peers`) with a fresh `HOME` each time; its usage never reports cached tokens,
# so its count is its own `tokens_saved` counter (or its cache log). A cache-off run of unrelated
# prompts fits prefill time against prompt length; then a cold server gets exact repeats and a
# prefix extension, and each request's TTFT is read back through that fit (`kvlab.serving.savings`).
#
# `reported` is the server's count of prompt tokens it saved; `inferred` what its TTFTs say it
# saved; `prefilled_again` how many of the exact repeats took at least half the TTFT of the first,
# cold request of the same run (a reused repeat takes a few tokens' time; load that changes between
# runs cannot move this count). vllm-mlx's memory-aware cache (batched mode) counts an exact repeat as fully saved, then
# drops the cached state and prefills the whole prompt again (its scheduler does so for "exact"
# and "supersequence" matches to avoid duplicating the last token), so its counter runs far ahead
# of the time it saves.

# %%
CALIBRATION_LENGTHS = [16, 256, 512, 1024, 1536]   # prompt lengths of the cache-off fit
AUDIT = {"prefix": 1024, "extension": 256, "repeats": 3}
served_as = m.name if m.name in ("tiny", "smollm2") else str(m.path)
starts = {  # name: (cache off, cache on)
    "kvlab serve radix": (lambda: peers.start_kvlab_serve(served_as, "none"),
                          lambda: peers.start_kvlab_serve(served_as, "radix")),
    "mlx_lm.server": (lambda: peers.start_mlx_lm(m, prompt_cache_size=0), lambda: peers.start_mlx_lm(m)),
    **{f"vllm-mlx {mode}": (lambda mode=mode: peers.start_vllm_mlx(m, mode, prefix_cache=False),
                            lambda mode=mode: peers.start_vllm_mlx(m, mode)) for mode in ("batched", "paged")},
}
audits, audit_frames = [], {}
if audited:
    calib = savings.calibration_workload(m, CALIBRATION_LENGTHS, repeats=2)
    repeated = savings.repeat_workload(m, AUDIT["prefix"], AUDIT["extension"], repeats=AUDIT["repeats"])
for name in audited:
    off_start, on_start = starts[name]
    with off_start() as srv:
        fit = savings.fit_prefill(kv.generate_load(srv.url, calib, tokenizer=m, concurrency=1, progress=False).frame)
    with on_start() as srv:
        on = kv.generate_load(srv.url, repeated, tokenizer=m, concurrency=1, progress=False)
        frame = savings.infer_reuse(on.frame, fit)
        log = srv.cache_log().tail(on.frame.height)  # vllm-mlx batched logs each lookup
        if name.startswith("vllm-mlx") and log.height == on.frame.height:
            frame = frame.with_columns(reused_tokens=log["cached"])
    audits.append({"section": "audit", "server": name, **savings.audit(on, fit),
                   "repeats": 2 * AUDIT["repeats"], "prefilled_again": savings.repeats_prefilled_again(on.frame),
                   "concurrency": 1, "ttft_ms_p50": on.frame["ttft_ms"].median(),
                   "fit": repr(fit)})
    audit_frames[name] = frame
audit_table = pl.DataFrame(audits) if audits else pl.DataFrame()
if audits:
    audit_table = audit_table.with_columns((pl.col("reported") - pl.col("inferred")).alias("overcount"))
audit_table

# %% [markdown]
# Per request, where vllm-mlx batched's counter and its TTFTs part ways:

# %%
if "vllm-mlx batched" in audit_frames:
    detail = audit_frames["vllm-mlx batched"].select(
        "name", "prompt_tokens", "ttft_ms", pl.col("reused_tokens").alias("reported (its log)"),
        "prefilled_est", "reused_inferred")
else:
    detail = "vllm-mlx batched was not audited"
detail

# %% [markdown]
# ## 5 · Seed 000: the tiny qwen2_vl on mlx-lm's server
#
# Text-only requests run concurrently; one image request shows whether mlx-lm's server has a
# vision path for this model.

# %%
vlm = kv.load_vlm("tiny")
with peers.start_mlx_lm(vlm.path) as srv:
    vlm_text = kv.generate_load(srv.url, "shared_system_prompt", concurrency=4, num_requests=8, max_tokens=8,
                            system_tokens=672, progress=False)
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
    [store_table, audit_table.drop("fit") if audits else pl.DataFrame(),
     pl.DataFrame([chat.row(section="seed001", server="kvlab serve", store="radix", concurrency=users)]),
     pl.DataFrame([{"section": "seed001_turns", "turn": t, "reuse": r, "ttft_ms_p50": x}
                   for t, r, x in per_turn.select("turn", "reuse", "ttft_ms_p50").iter_rows()]),
     pl.DataFrame([{"section": "correctness", "compared": compared.height, "identical": int(compared["equal"].sum()),
                    "flips": flips.height, "failures": failures.height}]),
     pl.DataFrame([{"section": "seed000", "server": "mlx_lm.server", "completed": vlm_text.summary["completed"],
                    "image_supported": image_answer is None, "image_answer": image_answer}])],
    how="diagonal_relaxed").with_columns(pl.lit(m.name).alias("model"))
results = kv.runner.save_results(results, results_path, "09_serving")

# %% [markdown]
# ## Findings

# %%
shared = results.filter((pl.col("section") == "stores") & (pl.col("workload") == "shared_system_prompt"))
best = shared.sort("token_hit_rate", descending=True).row(0, named=True)
least = shared.sort("bytes_held").row(0, named=True)
turn = results.filter(pl.col("section") == "seed001_turns").sort("turn").row(-1, named=True)
fastest = shared.sort("ttft_ms_p50").row(0, named=True)
c = results.filter(pl.col("section") == "correctness").row(0, named=True)
finding = (
    f"**At {concurrency} requests in flight** (kvlab serve, one store at a time): under {concurrency} concurrent requests on {m.name}, the {best['store']} store reused the most of the "
    f"shared system prompt workload ({best['token_hit_rate']:.0%} of prompt tokens, "
    f"{best['request_hit_rate']:.0%} of requests) holding {best['bytes_held'] / 2**20:.1f} MiB; "
    f"{least['store']} held the least ({least['bytes_held'] / 2**20:.1f} MiB for "
    f"{least['token_hit_rate']:.0%}); {fastest['store']} answered first (median TTFT {fastest['ttft_ms_p50']:.1f} ms). "
    f"With {users} users chatting at once, turn {turn['turn']} reused "
    f"{turn['reuse']:.0%} of its prompt. Concurrency changed {c['flips']} of {c['compared']} outputs, "
    f"{c['failures']} beyond a near-tie.")


def said(a):
    reported = "no count" if a["reported"] is None else f"{a['reported']:,}"
    return f"{a['server']} {reported} against {a['inferred']:,} ({a['prefilled_again']} of {a['repeats']} exact repeats prefilled again)"


audit = results.filter(pl.col("section") == "audit")
if audit.height:
    ranked = audit.sort("ttft_ms_p50")
    finding += ("\n\n**One request at a time** (the same exact repeats and prefix extension on each server): "
                + ", then ".join(f"{a['server']} (median TTFT {a['ttft_ms_p50']:.1f} ms)" for a in ranked.iter_rows(named=True))
                + f"; {ranked['server'][0]} wins. The peers ran one request at a time only; "
                  f"`13_load` sweeps concurrency for them.\n\n")
    finding += ("Saved prompt tokens as each server reported them, against what its TTFTs say: "
                + ", ".join(said(a) for a in audit.iter_rows(named=True)) + ".")
Markdown(finding)
