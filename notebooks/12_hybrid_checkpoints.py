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
# # 12 · Hybrid checkpoints: where each server's scheme loses, against the optimum at the same bytes
#
# A recurrent state (Qwen3.5's GatedDeltaNet, Nemotron-H's and Mamba2's SSM) or a sliding window
# cannot be cut back: a later request can restore it only exactly where a snapshot was taken. So
# *where* a server checkpoints decides what it reuses, and every MLX server does it differently
# (`kvlab.checkpoints`): mlx-lm's segment ends, mlx-engine's last 11 tokens, oMLX's and vLLM's
# block-aligned snapshots, mlx-openai-server's last message, log-spaced, kvlab's cost-aware
# policy, and **optimal**, the offline optimum that sees every later request and checkpoints
# exactly what they reuse under the same byte budget.
#
# Each cell below runs one workload per policy through `kv.Engine(verify=True)` on a tiny
# random-weight model of each family (`kv.experiments.checkpoint_study`): the store keeps only the
# policy's checkpoints, every restored request is compared with a cold prefill.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import polars as pl
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"                 # the dense reference ("smollm2": the real SmolLM2-135M)
families = ["qwen3_5", "nemotron_h", "mamba2", "gemma3_text"]  # tiny:<model_type>, one per family
workload = "branching"         # run on every family: multi_turn, agentic_loop or branching
agentic_family = "qwen3_5"     # also runs agentic_loop (issue 18's cost_aware target); "" to skip
policies = ["none", "segment_ends", "message_ends", "last_message", "tail:11", "every:64",
            "log_spaced", "cost_aware"]
budget = None                  # bytes every policy may hold (None: each holds what it takes)
fit_cost = False               # fit kv.cost on each model (seconds on this machine) instead of nominal
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
from kvlab.checkpoints import plan_optimal
from kvlab.primitives.tolerance import tolerance
from kvlab.experiments.checkpoint_study import run_study, workload_of

rows = []  # the results table: one row per (family, workload, policy, metric)


def record(family, wl, policy, metric, value, detail=None):
    rows.append({"family": family, "workload": wl, "policy": policy, "metric": metric,
                 "value": float(value), "detail": detail})


def figure(make):
    try:
        return make()
    except ImportError as e:  # plotly comes with the notebook extras
        return f"plotly is not available: {e}"


studies, frontiers, dtypes = {}, {}, {}
runs = [(f, workload) for f in families] + ([(agentic_family, "agentic_loop")] if agentic_family else [])
for family, wl in runs:
    m = kv.load(f"tiny:{family}")
    dtypes[family] = m.dtype
    cost = kv.cost.fit(m) if fit_cost else None
    study = run_study(m, wl, policies=policies, budget=budget, cost=cost)
    studies[family, wl] = study
    for r in study.frame.iter_rows(named=True):
        for metric in ("reused_tokens", "reachable_tokens", "bytes_held", "checkpoints", "max_logit_diff",
                       "prefill_s_saved", "ttft_s", "optimal_reused_at_bytes", "gap_to_optimal"):
            record(family, wl, r["policy"], metric, r[metric], r["where_lost"])
    # the optimum's frontier: its reused tokens at every budget up to what the greediest policy held
    seqs = [kv.Engine(m).tokens_of(q)[0].ids for q in workload_of(wl)]
    top = int(study.frame["bytes_held"].max())
    frontiers[family, wl] = [(b, sum(plan_optimal(seqs, study.state_bytes, b).planned_reuse))
                             for b in range(0, top + 1, max(top // 40, 1))]
studies[families[0], workload]

# %% [markdown]
# ## 1 · Reused tokens against bytes held
#
# One point per policy; the line is the optimum at every budget. A point on the line reuses all a
# policy could at its bytes; a point below it wasted bytes on checkpoints nobody restored, or
# missed the ones they needed.

# %%
frame = pl.concat([s.frame.with_columns(pl.lit(f).alias("family"), pl.lit(w).alias("workload"))
                   for (f, w), s in studies.items()])


def reuse_figure():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from kvlab.viz.curves import OPTIMUM_STYLE

    keys = list(studies)
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=[f"{f} · {w}" for f, w in keys])
    colours = dict(zip(policies, [f"hsl({int(360 * i / len(policies))},60%,45%)" for i in range(len(policies))]))
    colours["optimal"] = OPTIMUM_STYLE["color"]
    for col, key in enumerate(keys, start=1):
        xs, ys = zip(*frontiers[key])
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=OPTIMUM_STYLE, name="optimum at every budget (the ceiling)",
                                 legendgroup="optimum", showlegend=col == 1), row=1, col=col)
        for r in studies[key].frame.iter_rows(named=True):
            fig.add_trace(go.Scatter(x=[r["bytes_held"]], y=[r["reused_tokens"]], mode="markers",
                                     marker=dict(size=10, color=colours.get(r["policy"], "#333"),
                                                 symbol="diamond" if r["policy"] == "optimal" else "circle"),
                                     name=r["policy"], legendgroup=r["policy"], showlegend=col == 1,
                                     hovertext=r["where_lost"]), row=1, col=col)
        fig.update_xaxes(title_text="checkpoint bytes held (bytes, log scale)", type="log", row=1, col=col)
    fig.update_yaxes(title_text="prompt tokens reused (tokens)", rangemode="tozero", row=1, col=1)
    fig.update_layout(height=420, width=320 * len(keys),
                      title=f"prompt tokens reused against checkpoint bytes held: {len(policies)} policies on "
                            f"{len(keys)} runs, the optimum at every budget dashed black (the ceiling)")
    return fig


figure(reuse_figure)

# %% [markdown]
# ## 2 · Prefill seconds saved and TTFT
#
# `prefill_s_saved` comes from the cost model (`kv.cost`: nominal coefficients unless
# `fit_cost`); `ttft_s` is measured here, summed over the workload's requests (time to first
# token: lookup, restore and prefill, on this CPU).

# %%
(frame.select("family", "workload", "policy", "prefill_s_saved", "ttft_s")
 .pivot(on="policy", index=["family", "workload"], values="prefill_s_saved"))

# %%
none_ttft = frame.filter(pl.col("policy") == "none").select("family", "workload", pl.col("ttft_s").alias("cold"))
(frame.join(none_ttft, on=["family", "workload"])
 .with_columns((pl.col("cold") - pl.col("ttft_s")).alias("ttft_saved_s"))
 .pivot(on="policy", index=["family", "workload"], values="ttft_saved_s"))

# %% [markdown]
# ## 3 · The gap to the optimum at the same bytes
#
# `gap_to_optimal`: tokens the optimum would reuse with this policy's bytes that the policy did
# not. `where_lost`: the request that lost the most against what was reachable, and its miss reason.

# %%
frame.select("family", "workload", "policy", "reused_tokens", "bytes_held", "optimal_reused_at_bytes",
             "gap_to_optimal", "max_logit_diff", "where_lost")

# %% [markdown]
# ## 4 · The dense reference
#
# A model whose cache is full attention only can be cut back anywhere: a plain RadixStore reuses
# every shared prefix with no checkpoint at all. That is what the policies above try to recover.

# %%
dense = kv.load(model)
engine = kv.Engine(dense, kv.RadixStore(), verify=True)
engine.run_all(list(workload_of(workload)))
dense_reused = engine.stats()["reused_tokens"]
record(model, workload, "dense radix", "reused_tokens", dense_reused)
engine

# %% [markdown]
# ## Results

# %%
results = pl.DataFrame(rows, schema={"family": pl.Utf8, "workload": pl.Utf8, "policy": pl.Utf8,
                                     "metric": pl.Utf8, "value": pl.Float64, "detail": pl.Utf8})
results = kv.runner.save_results(results, results_path, "12_hybrid_checkpoints")

# %% [markdown]
# ## Findings

# %%
wide = (results.filter(pl.col("family").is_in(families))
        .pivot(on="metric", index=["family", "workload", "policy", "detail"], values="value"))
optimal = wide.filter(pl.col("policy") == "optimal").select("family", "workload", pl.col("bytes_held").alias("optimal_bytes"))
# per policy over every run: the share of the reachable tokens it reused, its bytes against the optimum's
# (which reuses everything reachable), and where it lost most against the optimum at its bytes
score = (wide.filter(~pl.col("policy").is_in(["none", "optimal"])).join(optimal, on=["family", "workload"])
         .sort(["gap_to_optimal", "family", "workload"], descending=[True, False, False], maintain_order=True)
         .group_by("policy", maintain_order=True)
         .agg((pl.col("reused_tokens").sum() / pl.col("reachable_tokens").sum()).alias("share"),
              (pl.col("bytes_held").sum() / pl.col("optimal_bytes").sum()).alias("bytes_vs_optimal"),
              pl.col("gap_to_optimal").first().alias("gap"), pl.col("family").first(), pl.col("workload").first(),
              (pl.col("gap_to_optimal") == pl.col("gap_to_optimal").max()).sum().alias("runs_at_worst"),
              pl.col("detail").first())
         .sort(["share", "bytes_vs_optimal"], descending=[True, False]))
win = score.row(0, named=True)
level = score.slice(1).filter(pl.col("share") == win["share"])  # as much reuse, more bytes (sorted)
opt = wide.filter(pl.col("policy") == "optimal")
names = level["policy"].to_list()
tied = (f", level with {' and '.join([', '.join(names[:-1]), names[-1]] if len(names) > 1 else names)} on reuse, with "
        f"the fewest bytes of those" if names else "")
verdict = (f"**Ship {win['policy']}**: over {opt.height} runs it reused {win['share']:.1%} of the reachable tokens{tied}, "
           f"holding {win['bytes_vs_optimal']:.2f}x the bytes the optimum holds to reuse {opt['reused_tokens'].sum() / opt['reachable_tokens'].sum():.1%}"
           + (f" ({names[0]}, next: {level['bytes_vs_optimal'][0]:.2f}x)." if names else "."))
worst_diff, tol = wide["max_logit_diff"].max(), max(tolerance(d) for d in dtypes.values())
rows_md = "".join(
    f"| {r['policy']} | {r['share']:.1%} | {r['bytes_vs_optimal']:.2f}x | "
    + (f"{r['family']} {r['workload']}" + (f" and {r['runs_at_worst'] - 1} more runs" if r["runs_at_worst"] > 1 else "")
       + f": {r['gap']:.0f} tokens behind the optimum at its bytes ({r['detail']})"
       if r["gap"] > 0 else "level with the optimum on every run") + " |\n" for r in score.iter_rows(named=True))
target = (wide.filter((pl.col("policy") == "cost_aware") & (pl.col("family") == (agentic_family or families[0])))
          .sort("workload"))
ratios = ", ".join(f"{r['workload']} {r['reused_tokens'] / r['optimal_reused_at_bytes']:.1%}"
                   for r in target.iter_rows(named=True) if r["optimal_reused_at_bytes"])
dense_vs = opt.filter(pl.col("workload") == workload)["reused_tokens"].max()
more = "more than" if dense_reused > dense_vs else "fewer than" if dense_reused < dense_vs else "as many as"
finding = (verdict + f" Every restored request matched a cold prefill within {worst_diff:.1e} (tolerance {tol:g}). "
           f"cost_aware's reused tokens as a share of the optimum's at equal bytes on {agentic_family or families[0]}: "
           f"{ratios}. The dense reference ({model}) reused {dense_reused} tokens of {workload} with no checkpoint at all, "
           f"{more} the optimum's {dense_vs:.0f} with checkpoints.\n\n"
           "| policy | reused of reachable | bytes vs the optimum's | where it loses most |\n|---|---|---|---|\n" + rows_md)
Markdown(finding)
