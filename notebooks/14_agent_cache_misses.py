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
# # 14 · Why did my agent's prompt cache miss? Each cause, diagnosed and recovered
#
# Coding agents talking to a local MLX server often watch their prefix-cache hit rate collapse.
# `kvlab.workloads.CAUSES` holds one seeded workload per cause users reported (a billing header or
# the time in the system prompt, a reordered tool list, dropped `<think>` blocks, `git status` in
# the system prompt, a moving reminder, micro-compaction, compaction, a rolling cache breakpoint,
# an idle gap), the Anthropic cache-diagnostics type it should be diagnosed as, and its fix: a
# normalisation rule the *server* applies, or a change in the *client*.
#
# Every workload goes through `kv.proxy` (which diagnoses each request against the one it extends,
# from the client side, and records what the upstream reported as reused) in front of
#
# - **kvlab serve** (`kv.serve(model, "radix")`): after the fix it runs with the cause's
#   normalisation rules (`normalise=rules`) when the fix is server-side, or gets the fixed traffic;
# - **mlx_lm.server** (plain mlx-lm, `peers.start_mlx_lm`): it cannot normalise, so only client-side
#   fixes can be tried there.
#
# Every run starts a fresh server, so no run reuses another run's cache.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import json

import polars as pl
from IPython.display import Markdown

from kvlab.primitives.chat_template import render
from kvlab.primitives.timing import now
from kvlab.serving import peers
from kvlab.workloads import CAUSES

# %% tags=["parameters"]
model = "tiny"          # "smollm2": the real SmolLM2-135M (its chat template renders no tools)
causes = list(CAUSES)   # which causes to run (kvlab.workloads.CAUSES)
turns = 4               # requests per conversation (compaction and micro_compaction need 4)
sizes = {"system_tokens": 60, "tools": 2, "result_tokens": 80, "think_tokens": 24, "max_tokens": 4}
mlx_lm_causes = list(CAUSES)  # causes also run on plain mlx_lm.server ([]: skip it; ~5 s a run)
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
m = kv.load(model)
probe = [{"role": "user", "content": "Hi"}]
probe_tool = [{"type": "function", "function": {"name": "Read", "description": "read a file",
                                                 "parameters": {"type": "object", "properties": {}}}}]
renders_tools = render(m.tokenizer, probe, tools=probe_tool) != render(m.tokenizer, probe)
PATHS = ("kvlab serve", "mlx_lm.server")


def workload_of(cause, phase):
    """What the client sends: the cause's traffic, or after a client-side fix the fixed traffic."""
    if phase == "after" and cause.fix.side == "client":
        return cause.fixed(turns=turns, **sizes)
    return cause.generate(turns=turns, **sizes)


def send(url, wl):
    """The workload through a fresh proxy in front of ``url``; the proxy's rows, one a request."""
    with kv.proxy(url, tokenizer=m) as px:
        kv.generate_load(px.url, wl, tokenizer=m, concurrency=1, progress=False, warmup=False)
        return px.requests_frame()


def run(cause, path, phase):
    wl = workload_of(cause, phase)
    if path == "kvlab serve":
        rules = cause.fix.rules if phase == "after" and cause.fix.side == "server" else False
        with kv.serve(m, "radix", normalise=rules) as server:
            frame = send(server.url, wl)
    else:
        with peers.start_mlx_lm(model) as server:
            frame = send(server.url, wl)
    out = []
    for request, r in zip(wl, frame.iter_rows(named=True)):
        diagnosis = json.loads(r["diagnosis"]) if r["diagnosis"] else None
        prompt = r["upstream_prompt_tokens"] or r["prompt_tokens"]
        step = request.name.startswith("step-")
        out.append({"cause": cause.name, "path": path, "phase": phase, "request": request.name,
                    "turn": int(request.name.split("-")[1]) if step else None,
                    "prompt_tokens": prompt, "reused_tokens": r["reused_tokens"],
                    "hit_rate": (r["reused_tokens"] or 0) / prompt if prompt else None,
                    "diagnosed_type": (diagnosis or {}).get("type") if r["extends"] is not None else None,
                    "expected_type": cause.expected, "diverged_at": r["diverged_at"],
                    "fix_side": cause.fix.side,
                    "detail": (diagnosis or {}).get("description")})
    return out


rows, seconds = [], {}
for name in causes:
    cause = CAUSES[name]
    t0 = now()
    for path in PATHS if name in mlx_lm_causes else ["kvlab serve"]:
        for phase in ("before", "after"):
            if path == "mlx_lm.server" and phase == "after" and cause.fix.side == "server":
                continue  # mlx_lm.server has no normalisation: a server-side fix cannot apply there
            rows.extend(run(cause, path, phase))
    seconds[name] = now() - t0
print(", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))

# %% [markdown]
# ## Results
#
# One row per request: `prompt_tokens` as the upstream counted them, `reused_tokens` as it
# reported them (`usage.prompt_tokens_details.cached_tokens`), `hit_rate` their ratio (per token),
# `diagnosed_type` the proxy's structural diagnosis of the request against the earlier one it
# extends (Anthropic's `cache_miss_reason.type`; null: no structural change) and `diverged_at`
# the first token where the two rendered prompts differ. The idle gap's fix adds keep-alive
# requests (`turn` null); they are in the table but not in the hit rates below.

# %%
results = pl.DataFrame(rows, schema={
    "cause": pl.Utf8, "path": pl.Utf8, "phase": pl.Utf8, "request": pl.Utf8, "turn": pl.Int64,
    "prompt_tokens": pl.Int64, "reused_tokens": pl.Int64, "hit_rate": pl.Float64,
    "diagnosed_type": pl.Utf8, "expected_type": pl.Utf8, "diverged_at": pl.Int64, "fix_side": pl.Utf8,
    "detail": pl.Utf8})
results = kv.runner.save_results(results, results_path, "14_agent_cache_misses")
results.filter(pl.col("cause") == causes[0]).drop("cause", "expected_type", "fix_side")

# %% [markdown]
# ## 1 · Hit rate per turn, before and after each fix
#
# Turn 1 is cold everywhere. A cause that strikes every turn keeps later turns near 0%; its fix
# should bring them up to what an unchanged, growing prompt reuses.

# %%
COLOURS = {("kvlab serve", "before"): "#f4a582", ("kvlab serve", "after"): "#b2182b",
           ("mlx_lm.server", "before"): "#92c5de", ("mlx_lm.server", "after"): "#2166ac"}


def hit_rate_figure():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cols = 5
    nrows = -(-len(causes) // cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=causes, shared_yaxes=True,
                        vertical_spacing=0.18)
    steps = results.filter(pl.col("turn").is_not_null())
    for i, name in enumerate(causes):
        row, col = i // cols + 1, i % cols + 1
        for (path, phase), colour in COLOURS.items():
            part = steps.filter((pl.col("cause") == name) & (pl.col("path") == path)
                                & (pl.col("phase") == phase)).sort("turn")
            if part.is_empty():
                continue
            fig.add_trace(go.Bar(x=part["turn"], y=part["hit_rate"] * 100, marker_color=colour,
                                 name=f"{path}, {phase} the fix", legendgroup=f"{path}{phase}",
                                 showlegend=i == 0), row=row, col=col)
        fig.update_xaxes(title_text="turn", dtick=1, row=row, col=col)
    top = steps["hit_rate"].max() * 100  # fit the axis to the data (a percentage, so at most 100)
    for r in range(1, nrows + 1):
        fig.update_yaxes(title_text="prompt tokens reused (%)", range=[0, min(100, top * 1.08 + 2)], row=r, col=1)
    fig.update_layout(barmode="group", height=330 * nrows, width=1200,
                      title=f"Per-turn hit rate (reused / prompt tokens, as each server reported) on {model}, before "
                            f"and after each fix: {len(causes)} causes, {turns} turns each")
    return fig


try:
    figure = hit_rate_figure()
except ImportError as e:  # plotly comes with the notebook extras
    figure = f"plotly is not available: {e}"
figure

# %% [markdown]
# ## 2 · Per cause: hit rate before -> after on each path, and the diagnosis
#
# Hit rates here are per token over the turns after the first (turn 1 is cold on every run);
# `prefilled` is what the server computed on those turns (prompt minus reused tokens): a fix that
# makes prompts longer (keeping history, sending reasoning back) can raise the hit rate and the
# prefill together, so both are shown.
# `diagnosed` is the proxy's type at the first request whose structure changed (the same client
# traffic reaches both servers, so both paths' proxies diagnose it alike).

# %%
warm = results.filter(pl.col("turn") > 1)
rates = (warm.group_by("cause", "path", "phase")
         .agg((pl.col("reused_tokens").sum() / pl.col("prompt_tokens").sum()).alias("rate"),
              pl.col("reused_tokens").sum().alias("reused"),
              (pl.col("prompt_tokens") - pl.col("reused_tokens")).sum().alias("prefilled")))


def rate(name, path, phase, what="rate"):
    r = rates.filter((pl.col("cause") == name) & (pl.col("path") == path) & (pl.col("phase") == phase))
    return r[what].item() if r.height else None


def diagnosed(name):
    typed = (results.filter((pl.col("cause") == name) & (pl.col("phase") == "before")
                            & (pl.col("path") == "kvlab serve") & pl.col("diagnosed_type").is_not_null())
             .sort("turn"))
    return typed["diagnosed_type"][0] if typed.height else None


def pct(x):
    return "n/a" if x is None else f"{x:.1%}"


summary = pl.DataFrame([{
    "cause": name, "fix": f"{CAUSES[name].fix.side}: {CAUSES[name].fix.summary}",
    "kvlab before": rate(name, "kvlab serve", "before"), "kvlab after": rate(name, "kvlab serve", "after"),
    "kvlab prefilled before": rate(name, "kvlab serve", "before", "prefilled"),
    "kvlab prefilled after": rate(name, "kvlab serve", "after", "prefilled"),
    "mlx_lm before": rate(name, "mlx_lm.server", "before"), "mlx_lm after": rate(name, "mlx_lm.server", "after"),
    "expected": CAUSES[name].expected or "no structural change",
    "diagnosed": diagnosed(name) or "no structural change",
} for name in causes], schema_overrides={"mlx_lm before": pl.Float64, "mlx_lm after": pl.Float64})
summary = summary.with_columns((pl.col("expected") == pl.col("diagnosed")).alias("match"),
                               (pl.col("kvlab after") - pl.col("kvlab before")).alias("kvlab recovered"))
summary.with_columns(pl.col("^(kvlab|mlx_lm) (before|after|recovered)$").map_elements(pct, return_dtype=pl.Utf8))

# %% [markdown]
# ## Findings

# %%
n = len(causes)
raised = summary.filter(pl.col("kvlab recovered") > 0).sort("kvlab recovered", descending=True)
best = "; ".join(f"{r['cause']} {r['kvlab before']:.1%} -> {r['kvlab after']:.1%}" for r in raised.head(3).iter_rows(named=True))
missed = [r for r in summary.iter_rows(named=True) if not r["match"]]
diagnosis = (f"named the expected type for all {n}" if not missed else
             f"named the expected type for {n - len(missed)} of {n} and missed " + ", ".join(
                 f"{r['cause']} (expected {r['expected']}, diagnosed {r['diagnosed']})" for r in missed))
verdict = (f"**The fix raised the warm hit rate on kvlab serve for {raised.height} of {n} causes**, most for {best or 'none'}; "
           f"the proxy's diagnosis {diagnosis}.")
flat = [r["cause"] for r in summary.iter_rows(named=True)
        if r["cause"] != "idle_gap" and r["kvlab recovered"] <= 0]
flat_text = (f" The fix raised no hit rate for {', '.join(flat)} on {model}." if flat else "")
if "tools_reordered" in flat and not renders_tools:
    flat_text += (f" {model}'s chat template does not render tools, so their order cannot reach its prompt: the "
                  "request is still diagnosed tools_changed (the providers compare structure), but nothing "
                  "is lost to it here.")
costlier = [r for r in summary.iter_rows(named=True)
            if r["kvlab prefilled after"] > r["kvlab prefilled before"]]
WHY_COSTLIER = {"compaction": " (on a prefix cache the system prompt and tools stay cached through a "
                               "compaction, so it costs only the summary, while keeping the history makes "
                               "every later prompt longer)"}
flat_text += "".join(
    f" {r['cause']}: the fix reuses {rate(r['cause'], 'kvlab serve', 'after', 'reused')} tokens instead of "
    f"{rate(r['cause'], 'kvlab serve', 'before', 'reused')} but prefills {r['kvlab prefilled after']} instead of "
    f"{r['kvlab prefilled before']}{WHY_COSTLIER.get(r['cause'], ' (its prompts are longer)')}."
    for r in costlier)
if mlx_lm_causes:
    client = [r for r in summary.iter_rows(named=True)
              if r["mlx_lm after"] is not None and r["cause"] != "idle_gap"]
    server = [r for r in summary.iter_rows(named=True)
              if r["mlx_lm after"] is None and r["mlx_lm before"] is not None]
    mlx_text = ((" On mlx_lm.server, before -> after a client-side fix: "
                 + "; ".join(f"{r['cause']} {r['mlx_lm before']:.1%} -> {r['mlx_lm after']:.1%}"
                             for r in client) + ".") if client else "")
    mlx_text += (" mlx_lm.server has no normalisation, so "
                 f"{', '.join(r['cause'] for r in server)} (stuck at "
                 f"{', '.join(pct(r['mlx_lm before']) for r in server)}) can only be helped by the "
                 "client removing the volatile text, or by a server that normalises (kvlab serve "
                 "with their rules)." if server else "")
else:
    mlx_text = " mlx_lm.server was not run (mlx_lm_causes = [])."
idle = summary.filter(pl.col("cause") == "idle_gap")
idle_text = ("" if idle.is_empty() else
             f" idle_gap: the prompt is unchanged, the diagnosis says {idle['diagnosed'].item()}; expiry is "
             "a server-side time-to-live that these local servers do not have, so its hit rate is "
             f"{pct(idle['kvlab before'].item())} before and {pct(idle['kvlab after'].item())} after the "
             "keep-alive fix on kvlab serve.")
finding = (f"{verdict} On {model}, {results.height} requests in conversations of {turns} turns (hit rates per token "
           f"over turns 2 to {turns}).{flat_text}{mlx_text}{idle_text}")
Markdown(finding)
