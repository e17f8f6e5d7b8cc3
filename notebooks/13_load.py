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
# # 13 · Load: what a prefix cache is worth as concurrency grows
#
# `kv.generate_load` drives any OpenAI-compatible server with streamed, concurrent requests and reports
# the numbers vLLM's `bench serve` reports. `09_serving` looks at what the server's cache does per
# request; this notebook measures what that buys in latency and throughput.
#
# 1. **The load generator**: what it sends, what it measures, and each figure's definition.
# 2. **Seed 004**: prefix caching off vs on (paged) on vLLM's `prefix_repetition`, concurrency 1-8,
#    beside the ratios seed 004 published.
# 3. **The same load on every server**: kvlab serve with each store, plain `mlx_lm.server` and
#    vllm-mlx (the seeds' server) in its three modes.
#
# Defaults run on the tiny random-weight model in a few minutes; `model = "smollm2"` runs the
# embedded SmolLM2-135M-Instruct (slower: set the sizes in the comments).

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import plotly.graph_objects as go
import polars as pl
from IPython.display import Markdown

from kvlab.serving import peers

# %% tags=["parameters"]
model = "tiny"                 # "smollm2": the embedded SmolLM2-135M-Instruct
concurrency = [1, 2, 4, 8]     # seed 004 ran one level; kvlab sweeps four
prefix_len = 512               # seed 004: 512
suffix_len = 128               # seed 004: 128
num_prompts = 16               # seed 004: 50
output_len = 16                # seed 004: 100
repeats = 1                    # seed 004: 10
servers = ["kvlab serve radix", "kvlab serve paged", "kvlab serve system", "kvlab serve mlx-lru",
           "mlx_lm.server", "vllm-mlx simple", "vllm-mlx batched", "vllm-mlx paged"]  # []: none
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
m = kv.load(model)
SEED_004 = {"ttft_mean": 8667.88 / 6071.39, "throughput": 288.88 / 210.59}  # published: 1.43x, 1.37x
SERVER_CONCURRENCY, SERVER_REQUESTS = 4, 12  # section 3: every server under the same load

m

# %% [markdown]
# ## 1 · The load generator and its definitions
#
# `concurrency=N` keeps N sessions in flight (a session is one request here; a multi-turn chat's
# turns in order in `09_serving`); `rate=R` would start sessions as a seeded Poisson process
# instead. Every request is streamed, and a *token chunk* is a streamed chunk that carries
# generated text or a finish reason. Per request, in milliseconds
# (`kvlab.serving.metrics`, vLLM's `bench serve` definitions):
#
# | figure | definition |
# |---|---|
# | **TTFT** | first token chunk − send time |
# | **ITL** | each gap between consecutive token chunks (vLLM's ITL; AIPerf calls TPOT "ITL") |
# | **E2EL** | last token chunk − send time |
# | **TPOT** | (E2EL − TTFT) / (output tokens − 1), requests with more than one output token |
# | **output throughput** | output tokens of completed requests / wall time (first send to last completion) |
# | **token hit rate** | reused / prompt tokens (the server's `cached_tokens`; vLLM's definition) |
# | **request hit rate** | share of requests that reused anything (vllm-mlx's definition) |
#
# Percentiles are numpy's linear-interpolated ones; ITL statistics pool every gap of every request.

# %% [markdown]
# ## 2 · Seed 004: prefix caching off vs on under load
#
# vLLM's `prefix_repetition` (one shared prefix, random suffixes, token ids sent as text that
# re-encodes to the same ids: the `prompt_token_mismatches` column checks it against the server's
# own count). One server per setting; each concurrency level gets a fresh prefix, so each starts
# cold, and the first `c` requests of a level run before anything is cached.

# %%
seed004, frames = [], {}
for cache, store in (("off", "none"), ("on", "paged")):
    with kv.serve(m, store, block_size=16) as server:
        for rep in range(repeats):
            for c in concurrency:
                r = kv.generate_load(server.url, "prefix_repetition", tokenizer=m, concurrency=c,
                                 num_requests=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len,
                                 output_len=output_len, num_prefixes=1, seed=100 * rep + c, progress=False)
                seed004.append(r.row(section="seed004", server="kvlab serve", store=store, cache=cache,
                                   concurrency=c, repeat=rep))
                frames[cache, c] = r.frame
seed004 = pl.DataFrame(seed004)
seed004.select("cache", "concurrency", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "e2el_ms_p50",
               "output_throughput", "token_hit_rate", "request_hit_rate", "prompt_token_mismatches")

# %% [markdown]
# One request's figures, recomputed from its row by the definitions above (cache on, the highest
# concurrency, its last request with more than one output token):

# %%
one = frames["on", max(concurrency)].filter(pl.col("output_tokens") > 1).row(-1, named=True)
tpot = (one["e2el_ms"] - one["ttft_ms"]) / (one["output_tokens"] - 1)
print(f"request {one['request']}: TTFT {one['ttft_ms']:.1f} ms, E2EL {one['e2el_ms']:.1f} ms, "
      f"{one['output_tokens']} output tokens: TPOT = ({one['e2el_ms']:.1f} - {one['ttft_ms']:.1f}) / "
      f"{one['output_tokens'] - 1} = {tpot:.2f} ms (the frame says {one['tpot_ms']:.2f}); "
      f"{len(one['itl_ms'])} ITL gaps, median {pl.Series(one['itl_ms']).median():.2f} ms; "
      f"reused {one['reused_tokens']} of {one['prompt_tokens']} prompt tokens")
frames["on", max(concurrency)].select("request", "start_s", "ttft_ms", "tpot_ms", "e2el_ms", "output_tokens",
                                      "prompt_tokens", "prompt_tokens_expected", "reused_tokens")

# %% [markdown]
# Cache off over cache on for the latencies (TTFT mean/p50/p99, E2EL p50: how many times faster),
# on over off for output throughput, beside seed 004's published ratios (its TTFT mean and output
# throughput, one concurrency level):

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
fig.update_layout(title=f"prefix_repetition on kvlab serve ({m.name}, {num_prompts} prompts a level): TTFT (first token "
                        f"chunk - send) against concurrency {', '.join(map(str, concurrency))}",
                  xaxis_title="concurrency (requests in flight)", yaxis_title="time to first token (ms)", xaxis_type="log",
                  yaxis_rangemode="tozero")
fig

# %%
fig = go.Figure([go.Scatter(x=frame["concurrency"], y=frame["output_throughput"], name=f"cache {cache}",
                            mode="lines+markers") for cache, frame in (("off", off), ("on", on))])
fig.update_layout(title=f"prefix_repetition on kvlab serve ({m.name}): output throughput (output tokens / wall time) "
                        f"against concurrency {', '.join(map(str, concurrency))}",
                  xaxis_title="concurrency (requests in flight)", yaxis_title="output throughput (tokens/s)",
                  xaxis_type="log", yaxis_rangemode="tozero")
fig

# %% [markdown]
# ## 3 · The same load on every server
#
# Each server is a child process on loopback (so none shares the client's process), on the same
# model folder, under the same `prefix_repetition` load. vllm-mlx runs from its own venv
# (`.venv-peers`) with a fresh `HOME` each time; its usage never reports cached tokens, so its hit
# rate is null here and its own `tokens_saved` counter is `server_reported_saved` (whether that
# counter is what it really saves: `09_serving`, section 4).

# %%
served_as = m.name if m.name in ("tiny", "smollm2") else str(m.path)
starts = {**{f"kvlab serve {s}": (lambda s=s: peers.start_kvlab_serve(served_as, s))
             for s in ("radix", "paged", "system", "mlx-lru")},
          "mlx_lm.server": lambda: peers.start_mlx_lm(m),
          **{f"vllm-mlx {mode}": (lambda mode=mode: peers.start_vllm_mlx(m, mode)) for mode in peers.MODES}}
server_rows = []
for name in servers:
    with starts[name]() as srv:
        r = kv.generate_load(srv.url, "prefix_repetition", tokenizer=m, concurrency=SERVER_CONCURRENCY,
                         num_requests=SERVER_REQUESTS, prefix_len=prefix_len, suffix_len=suffix_len,
                         output_len=output_len, num_prefixes=1, seed=77, progress=False)
    saved = r.server_delta().get("/v1/cache/stats:engine_cache.tokens_saved")
    server_rows.append(r.row(section="peers", server=name, concurrency=SERVER_CONCURRENCY,
                           server_reported_saved=saved))
peer_table = pl.DataFrame(server_rows) if server_rows else pl.DataFrame()
peer_table.select("server", "completed", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "e2el_ms_p50",
                  "output_throughput", "token_hit_rate", "server_reported_saved") if server_rows else "no servers"

# %%
if server_rows:
    fig = go.Figure(go.Bar(x=peer_table["server"], y=peer_table["ttft_ms_p50"], name="TTFT p50",
                           error_y={"type": "data", "array": (peer_table["ttft_ms_p99"] - peer_table["ttft_ms_p50"]).to_list(),
                                    "arrayminus": [0] * peer_table.height}))
    fig.update_layout(title=f"prefix_repetition at concurrency {SERVER_CONCURRENCY}, {SERVER_REQUESTS} requests, "
                            f"{peer_table.height} servers: TTFT (first token chunk - send) p50 (bar) to p99 (whisker)",
                      xaxis_title="server", yaxis_title="time to first token (ms)")
else:
    fig = "no servers"
fig

# %% [markdown]
# ## Results

# %%
results = pl.concat([seed004, peer_table], how="diagonal_relaxed").with_columns(pl.lit(m.name).alias("model"))
results = kv.runner.save_results(results, results_path, "13_load")

# %% [markdown]
# ## Findings

# %%
s4 = results.filter(pl.col("section") == "seed004").group_by("cache", "concurrency").agg(pl.col(pl.Float64).median())
levels = sorted(s4["concurrency"].unique())


def at(cache, c):
    return s4.filter((pl.col("cache") == cache) & (pl.col("concurrency") == c)).row(0, named=True)


def listing(xs):
    return " and ".join([", ".join(map(str, xs[:-1])), str(xs[-1])] if len(xs) > 1 else map(str, xs)) or "none"


# per level: cache off over on for TTFT (how many times faster on is), on over off for throughput
ttft = {c: at("off", c)["ttft_ms_p50"] / at("on", c)["ttft_ms_p50"] for c in levels}
thru = {c: at("on", c)["output_throughput"] / at("off", c)["output_throughput"] for c in levels}
mean = {c: at("off", c)["ttft_ms_mean"] / at("on", c)["ttft_ms_mean"] for c in levels}
ttft_wins, thru_wins = [c for c in levels if ttft[c] > 1], [c for c in levels if thru[c] > 1]


def verdict(metric, wins, ratio):
    span = f"{min(ratio.values()):.2f}x to {max(ratio.values()):.2f}x" if len(ratio) > 1 else f"{ratio[levels[0]]:.2f}x"
    if len(wins) == len(levels):
        return f"wins {metric} at every concurrency ({span})"
    if not wins:
        return f"loses {metric} at every concurrency ({span})"
    lost = [c for c in levels if c not in wins]
    return (f"wins {metric} at concurrency {listing(wins)} and loses it at {listing(lost)} "
            f"({', '.join(f'{ratio[c]:.2f}x' for c in lost)})")


hi = levels[-1]
seed_direction = (mean[hi] > 1) == (SEED_004["ttft_mean"] > 1) and (thru[hi] > 1) == (SEED_004["throughput"] > 1)
hit = at("on", hi)["token_hit_rate"]
why = (f"each request here generates {output_len} output tokens against seed 004's 100, so the prefill the cache "
       "saves is a larger share of each request" if thru[hi] > SEED_004["throughput"] else
       f"here {hit:.0%} of prompt tokens were reused, {'fewer' if hit < 25088 / 32000 else 'no fewer'} than seed 004's "
       f"{25088 / 32000:.0%} on its cold run (25,088 of 32,000)")
finding = (f"**Prefix caching (paged) {verdict('TTFT p50', ttft_wins, ttft)}, and "
           f"{verdict('output throughput', thru_wins, thru)}** on kvlab serve ({m.name}, {num_prompts} prompts a level). "
           f"Seed 004's claim {'reproduces in direction' if seed_direction else 'does not reproduce'}: at concurrency "
           f"{hi}, the highest here, the TTFT mean ratio was {mean[hi]:.2f}x and throughput {thru[hi]:.2f}x against the "
           f"published {SEED_004['ttft_mean']:.2f}x and {SEED_004['throughput']:.2f}x (Qwen3-0.6B, vllm-metal, one load "
           f"level), {mean[hi] / SEED_004['ttft_mean']:.2f}x and {thru[hi] / SEED_004['throughput']:.2f}x the published "
           f"ratios; {why}.\n\n| concurrency | TTFT p50, off → on (ms) | output throughput, off → on (tokens/s) | "
           "token hit rate (on) |\n|---|---|---|---|\n" + "".join(
               f"| {c} | {at('off', c)['ttft_ms_p50']:.0f} → {at('on', c)['ttft_ms_p50']:.0f}: "
               f"{'on' if ttft[c] > 1 else 'off'} wins, {max(ttft[c], 1 / ttft[c]):.2f}x | "
               f"{at('off', c)['output_throughput']:.1f} → {at('on', c)['output_throughput']:.1f}: "
               f"{'on' if thru[c] > 1 else 'off'} wins, {max(thru[c], 1 / thru[c]):.2f}x | {at('on', c)['token_hit_rate']:.0%} |\n"
               for c in levels))
p = results.filter((pl.col("section") == "peers") & pl.col("ttft_ms_p50").is_not_null())
if p.height > 1:
    by_ttft, by_thru = p.sort("ttft_ms_p50"), p.sort("output_throughput", descending=True)
    t0, t1, tn = by_ttft.row(0, named=True), by_ttft.row(1, named=True), by_ttft.row(-1, named=True)
    u0, u1 = by_thru.row(0, named=True), by_thru.row(1, named=True)
    finding += (f"\n\n**Across {p.height} servers at concurrency {SERVER_CONCURRENCY}** (the same load): {t0['server']} had "
                f"the lowest TTFT p50, {t0['ttft_ms_p50']:.0f} ms, {t1['ttft_ms_p50'] / t0['ttft_ms_p50']:.2f}x faster than "
                f"the next, {t1['server']} ({t1['ttft_ms_p50']:.0f} ms), and {tn['ttft_ms_p50'] / t0['ttft_ms_p50']:.1f}x "
                f"faster than the slowest, {tn['server']} ({tn['ttft_ms_p50']:.0f} ms); {u0['server']} had the highest "
                f"output throughput, {u0['output_throughput']:.1f} tokens/s, "
                f"{u0['output_throughput'] / u1['output_throughput']:.2f}x the next, {u1['server']} "
                f"({u1['output_throughput']:.1f} tokens/s).")
Markdown(finding)
