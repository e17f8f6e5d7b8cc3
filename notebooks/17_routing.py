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
# # 17 · Routing: which router in front of N servers, and what it costs to get it wrong
#
# Past one server, a prefix cache is only as good as the router in front: a conversation whose
# turns land on different instances reuses nothing. `kvlab.cluster` runs the field's rules behind
# one interface (`kvlab.cluster.decide`, shared by the simulator and the real `kvlab route`):
# load-only rules (`random`, `round_robin`, `least_loaded`, `power_of_two`, `session`), the
# cache-aware ones of SGLang, Ray, AIBrix, llm-d, Dynamo, Preble and Mooncake, and two ceilings
# (`shared`: one cache of N x capacity; `optimal`: belady on it). A cache-aware rule reads a view:
# `precise` (the instances' KV events), `approximate` (its own record of what it routed) or
# `stale:D`.
#
# 1. Every rule against N on the Mooncake trace and on a fleet of agents.
# 2. The precise-vs-approximate gap as cache pressure grows.
# 3. The locality/load trade-off.
# 4. Each rule's gap to the shared-cache ceiling.
# 5. One real cluster (two `kvlab serve` instances behind `kvlab route`) beside the simulator.
#
# Sections 1-4 are model-free and take seconds; section 5 serves `model` (the tiny random model by
# default; `"smollm2"` gives TTFTs that prefill dominates).

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import plotly.graph_objects as go
import polars as pl
from IPython.display import Markdown

pl.Config.set_tbl_rows(40)

# %% tags=["parameters"]
model = "tiny"                  # "smollm2": section 5 on the embedded SmolLM2-135M-Instruct
trace = "synthetic_trace.jsonl"  # a file name found by kv.traces.locate, or a path
head = 0                        # replay the first N requests of the trace (0: all 3,993)
instances = [2, 4, 8]           # cluster sizes
capacity_tokens = 2**21         # per instance on the Mooncake trace (512-token blocks)
fleet_sessions = 32             # agents in the agentic fleet (kv.workloads.agentic_loop, one seed each)
fleet_turns = 6                 # requests per agent
fleet_capacity = 2**14          # per instance on the fleet (16-token blocks)
pressure = [2**17, 2**18, 2**19, 2**20, 2**21]  # per-instance capacities for section 2 (4 instances)
real_groups = 3                 # section 5: prefix groups (kvlab.cluster.realrun.prefix_texts)
real_per_group = 6              # section 5: requests per group
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
from pathlib import Path

from kvlab.cluster import CACHE_AWARE, ROUTERS
from kvlab.cluster.fleet import fleet
from kvlab.cluster.realrun import beside, prefix_texts, run_through, settler

rows = []  # the results table: one row per (experiment, source, router, view, instances, capacity, knob, metric)
METRICS = ("token_hit_rate", "request_hit_rate", "ttft_p50_s", "ttft_p99_s", "load_imbalance",
           "shared_cache_token_hit_rate")
SCHEMA = {"experiment": pl.Utf8, "source": pl.Utf8, "router": pl.Utf8, "view": pl.Utf8, "instances": pl.Int64,
          "capacity_tokens": pl.Int64, "knob": pl.Float64, "metric": pl.Utf8, "value": pl.Float64}


def record(experiment, source, router, view, n, capacity, knob, result):
    for metric in METRICS:
        rows.append({"experiment": experiment, "source": source, "router": router, "view": view, "instances": n,
                     "capacity_tokens": capacity, "knob": None if knob is None else float(knob), "metric": metric,
                     "value": float(result[metric])})


path = Path(trace) if Path(trace).is_file() else kv.traces.locate(trace)
mooncake = kv.traces.read(path)
if head:
    mooncake = mooncake.head(head)
m = kv.load(model)
agents = fleet(m, "agentic_loop", sessions=fleet_sessions, turns=fleet_turns)
SOURCES = {path.name: (mooncake, capacity_tokens), "agent fleet": (agents, fleet_capacity)}
mooncake, agents

# %% [markdown]
# ## 1 · Every rule against N
#
# Each instance has its own LRU cache of the given capacity and a prefill queue timed by
# `kv.cluster.ServiceModel()` (a stated default: 8,000 prefill tokens/s, 25 ms a decode token).
# The arrival rate grows with N (timestamps divided by `load = N / max(instances)`), so each
# instance sees the same traffic whatever N is. TTFT is modelled: queueing plus the prefill of the
# tokens an instance did not hold.

# %%
top = max(instances)
for source, (t, cap) in SOURCES.items():
    for n in instances:
        for router in [*ROUTERS, "shared", "optimal"]:
            r = kv.simulate(t, instances=n, router=router, capacity_tokens=cap, load=n / top)
            record("against_n", source, router, "precise", n, cap, None, r.summary)


def wide(experiment, table=None):
    table = pl.DataFrame(rows, schema=SCHEMA) if table is None else table
    return (table.filter(pl.col("experiment") == experiment)
            .pivot(on="metric", index=["source", "router", "view", "instances", "capacity_tokens", "knob"],
                   values="value"))


against = wide("against_n")
against.select("source", "instances", "router", "token_hit_rate", "ttft_p50_s", "ttft_p99_s",
               "load_imbalance").sort("source", "instances", "token_hit_rate", descending=[False, False, True])


# %%
def by_n(frame, y, title, routers):
    fig = go.Figure()
    for source in frame["source"].unique(maintain_order=True):
        for router in routers:
            f = frame.filter((pl.col("source") == source) & (pl.col("router") == router)).sort("instances")
            fig.add_trace(go.Scatter(x=f["instances"], y=f[y], mode="lines+markers", name=f"{router} ({source})",
                                     line={"dash": "dot" if source != path.name else "solid"}))
    fig.update_layout(title=title, xaxis_title="instances", yaxis_title=y, height=420)
    return fig


by_n(against, "token_hit_rate", "token hit rate against N (solid: Mooncake trace; dotted: agent fleet)",
     ["random", "least_loaded", "session", "sglang_cache_aware", "llmd_weighted", "preble_e2", "shared"])

# %%
by_n(against, "ttft_p99_s", "modelled TTFT p99 (s) against N",
     ["random", "least_loaded", "power_of_two", "sglang_cache_aware", "llmd_weighted", "preble_e2", "mooncake_ttft"])

# %% [markdown]
# ## 2 · Precise against approximate as cache pressure grows
#
# Four instances on the Mooncake trace, capacities from scarce to plenty. The approximate view is
# the router's own record, evicted as each original evicts (SGLang's LRU tree, llm-d's 31,250-entry
# LRU, Dynamo's 120 s TTL, AIBrix's 20 min, Ray's never, Preble's and Mooncake's at the instance's
# capacity); `stale:5` is the precise view five seconds late. Near capacity an approximate view
# believes in blocks the instance has already evicted.

# %%
t, _ = SOURCES[path.name]
for cap in pressure:
    for router in CACHE_AWARE:
        for view in ("precise", "approximate", "stale:5"):
            r = kv.simulate(t, instances=4, router=router, view=view, capacity_tokens=cap, load=4 / top)
            record("pressure", path.name, router, view, 4, cap, None, r.summary)
pressure_f = wide("pressure")
gap = (pressure_f.pivot(on="view", index=["router", "capacity_tokens"], values="token_hit_rate")
       .with_columns((pl.col("precise") - pl.col("approximate")).alias("precise - approximate"))
       .sort("router", "capacity_tokens"))
gap

# %%
fig = go.Figure()
for router in CACHE_AWARE:
    f = gap.filter(pl.col("router") == router)
    fig.add_trace(go.Scatter(x=f["capacity_tokens"], y=f["precise - approximate"], mode="lines+markers", name=router))
fig.update_layout(title="token hit rate, precise view minus approximate view (4 instances)", height=420,
                  xaxis={"title": "capacity per instance (tokens)", "type": "log"}, yaxis_title="points of hit rate")
fig

# %% [markdown]
# ## 3 · Locality against load
#
# Eight instances at the trace's own rate. llm-d's weight on the prefix score (0: load and KV
# usage only) and SGLang's absolute balance threshold (0: balance first) trade cache locality for
# even load; each point is one setting.

# %%
t, cap = SOURCES[path.name]
for w in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0):
    r = kv.simulate(t, instances=top, router="llmd_weighted", capacity_tokens=cap, router_params={"w_prefix": w})
    record("tradeoff", path.name, "llmd_weighted", "precise", top, cap, w, r.summary)
for b in (0, 2, 8, 32, 64, 256):
    r = kv.simulate(t, instances=top, router="sglang_cache_aware", view="approximate", capacity_tokens=cap,
                    router_params={"balance_abs_threshold": b})
    record("tradeoff", path.name, "sglang_cache_aware", "approximate", top, cap, b, r.summary)
trade = wide("tradeoff").sort("router", "knob")
fig = go.Figure()
for router in ("llmd_weighted", "sglang_cache_aware"):
    f = trade.filter(pl.col("router") == router)
    fig.add_trace(go.Scatter(x=f["load_imbalance"], y=f["token_hit_rate"], mode="lines+markers+text", name=router,
                             text=[f"{k:g}" for k in f["knob"]], textposition="top center"))
fig.update_layout(title="locality against load: token hit rate against load imbalance (max / mean tokens served)",
                  xaxis_title="load imbalance", yaxis_title="token hit rate", height=420)
trade.select("router", "knob", "token_hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s"), fig

# %% [markdown]
# ## 4 · Each rule's gap to the shared-cache ceiling
#
# `shared` is one cache of N x capacity behind the least-loaded instance: what routing could at
# best recover with the same eviction. `optimal` is belady on that cache (the offline optimum, an
# upper bound on any rule).

# %%
ceil = against.filter(pl.col("router") == "shared").select("source", "instances",
                                                           pl.col("token_hit_rate").alias("shared"))
gaps = (against.filter(~pl.col("router").is_in(["shared", "optimal"])).join(ceil, on=["source", "instances"])
        .with_columns((pl.col("shared") - pl.col("token_hit_rate")).alias("gap to shared"))
        .pivot(on="instances", index=["source", "router"], values="gap to shared").sort("source", str(top)))
gaps

# %% [markdown]
# ## 5 · A real cluster beside the simulator
#
# Two `kvlab serve` instances (paged store, publishing KV events) behind `kvlab route` running
# llm-d's rule on the precise view, here in this process. Prefix groups whose requests extend one
# another, interleaved, one request at a time: send, wait for the instance's store and the
# router's view, send the next. The simulator replays the same token ids with a ServiceModel
# calibrated on the even-numbered requests; the odd ones check it (each instance's first request,
# which pays for its warm-up, is left out of both).

# %%
texts = prefix_texts(m.tokenizer, real_groups, real_per_group)
servers = [kv.serve(m, "paged", kv_events="tcp://127.0.0.1:0", api_key="") for _ in range(2)]
try:
    with kv.cluster.route([s.url for s in servers], "llmd_weighted", "precise", tokenizer=m,
                          capacity_tokens=65536) as router:
        real = run_through(router.url, texts, model=m.name, settle=settler())
finally:
    for s in servers:
        s.stop()
real_frame, real_summary = beside(real, [m.tokenizer.encode(x) for x in texts], "llmd_weighted", "precise",
                                  instances=2, capacity_tokens=65536)
for metric in ("decisions_equal", "reused_equal", "ttft_median_s", "modelled_ttft_median_s",
               "ttft_median_abs_rel_error", "requests"):
    rows.append({"experiment": "real_cluster", "source": model, "router": "llmd_weighted", "view": "precise",
                 "instances": 2, "capacity_tokens": 65536, "knob": None, "metric": metric,
                 "value": float(real_summary[metric])})
real_summary["service"], real_frame.select("request", "instance", "sim_instance", "prompt_tokens", "reused_tokens",
                                           "sim_reused_tokens", "ttft_s", "modelled_ttft_s", "role")

# %% [markdown]
# ## Results

# %%
results = pl.DataFrame(rows, schema=SCHEMA)
results = kv.runner.save_results(results, results_path, "17_routing")

# %% [markdown]
# ## Findings

# %%
a = wide("against_n", results)


def best(frame, routers, metric, low=True):
    f = frame.filter(pl.col("router").is_in(routers)).sort(metric, "router", descending=[not low, False])
    return f.row(0, named=True)


scale = []
for source in a["source"].unique(maintain_order=True):
    said = []
    for n in instances:
        at = a.filter((pl.col("source") == source) & (pl.col("instances") == n))
        pick = best(at, list(ROUTERS), "ttft_p50_s")
        said.append(f"at {n} run {pick['router']} (TTFT p50 {pick['ttft_p50_s']:.3g} s, hit {pick['token_hit_rate']:.1%})")
    scale.append(f"on {source}: " + "; ".join(said))

orderings = []
for source in a["source"].unique(maintain_order=True):
    rand_worse = load_far = 0
    for n in instances:
        at = a.filter((pl.col("source") == source) & (pl.col("instances") == n))
        rnd = best(at, ["random"], "ttft_p50_s")
        load = best(at, ["least_loaded", "power_of_two"], "ttft_p50_s")
        aware = best(at, list(CACHE_AWARE), "ttft_p50_s")
        rand_worse += rnd["ttft_p50_s"] > load["ttft_p50_s"]
        load_far += aware["ttft_p50_s"] * 2 <= load["ttft_p50_s"]
    orderings.append(f"on {source}, random's TTFT p50 is worse than the best load-only rule's at {rand_worse} of "
                     f"{len(instances)} sizes and the best cache-aware rule's is at most half the best load-only "
                     f"rule's at {load_far} of {len(instances)}")

pressure_r = wide("pressure", results)
gap_r = (pressure_r.pivot(on="view", index=["router", "capacity_tokens"], values="token_hit_rate")
         .with_columns((pl.col("precise") - pl.col("approximate")).alias("precise - approximate")))
scarce = gap_r.filter(pl.col("capacity_tokens") == min(pressure))
wins = scarce.filter(pl.col("precise - approximate") > 0)
widest = scarce.sort("precise - approximate", descending=True).row(0, named=True)
plenty = gap_r.filter(pl.col("capacity_tokens") == max(pressure))
p99 = (pressure_r.filter(pl.col("capacity_tokens") == min(pressure))
       .pivot(on="view", index="router", values="ttft_p99_s")
       .with_columns((pl.col("approximate") / pl.col("precise")).alias("ratio")).sort("ratio", "router"))
mirrored = sorted(gap_r.group_by("router").agg(pl.col("precise - approximate").abs().max().alias("g"))
                  .filter(pl.col("g") == 0)["router"])
lopsided = a.filter(pl.col("instances") == top).sort("load_imbalance", "router", descending=[True, False]).row(0, named=True)
rs = wide("real_cluster", results).row(0, named=True)
finding = (
    f"**Which router here** (lowest modelled TTFT p50): {'. '.join(scale)}.\n\n"
    f"**The published orderings**: {'; '.join(orderings)}. Precise beats approximate at the scarcest capacity "
    f"({min(pressure):,} tokens per instance) for {wins.height} of {scarce.height} cache-aware rules, by up to "
    f"{widest['precise - approximate'] * 100:.1f} points ({widest['router']}); with {max(pressure):,} tokens the "
    f"largest gap is {plenty['precise - approximate'].max() * 100:.1f} points. At the scarcest capacity the "
    f"approximate view's TTFT p99 is {p99['ratio'].min():.2f}x to {p99['ratio'].max():.2f}x the precise view's, "
    f"nowhere near llm-d's 57x; {', '.join(mirrored) or 'no rule'} lost nothing, their approximate view "
    f"mirroring the instances' own LRU. The most lopsided rule at {top} instances is {lopsided['router']} on "
    f"{lopsided['source']} (the busiest instance served {lopsided['load_imbalance']:.2f}x the mean).\n\n"
    f"**The real cluster** ({model}, {rs['requests']:.0f} requests, llmd_weighted/precise): routing decisions "
    f"{'equal' if rs['decisions_equal'] else 'NOT equal'} to the simulator's, reused tokens "
    f"{'equal' if rs['reused_equal'] else 'NOT equal'}; after calibration the modelled TTFT is "
    f"{rs['ttft_median_abs_rel_error']:.0%} from the measured (median over the held-out requests; "
    f"tolerance 25%: {'met' if rs['ttft_median_abs_rel_error'] <= 0.25 else 'not met'}).")
Markdown(finding)
