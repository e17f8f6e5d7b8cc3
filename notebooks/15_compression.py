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
# # 15 · KV-cache compression: which press, at what ratio, costs how much
#
# A press keeps, per layer and KV head, some of the rows of a prompt's KV cache (kvpress's
# semantics: `ratio` is the fraction removed). kvlab compresses once, after mlx-lm's whole chunked
# prefill, into a position-preserving cache whose every later logit equals the uncompressed cache's
# with the evicted positions masked (`tests/integration/test_presses_oracle.py` checks it for every
# press). This notebook measures what that costs and saves:
#
# 1. **quality against ratio per press**: teacher-forced KL(full || compressed) and top-1 agreement
#    over a continuation that copies a passage of the context back, and needle / variable-tracking
#    accuracy gated on the uncompressed model (the curve the field draws);
# 2. **bytes and decode time** saved;
# 3. **agreement with kvpress** on the same SmolLM2 weights (when the kvpress peer is installed);
# 4. **a compressed system prompt reused** by many requests (`kv.Engine(press=...)`), against
#    compressing it again for each;
# 5. **where each press looks**: the kept-token view, and a press of your own in five lines.
#
# Defaults run in about a minute on the tiny random-weight model (its accuracy is 0: every task is
# gated on the uncompressed model solving it, so none counts). Set `model = "smollm2"`, `tokens =
# 1024` and `tasks = 6` for the real measurement (a few minutes).

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import mlx.core as mx
import plotly.graph_objects as go
import polars as pl
from IPython.display import Markdown, display

# %% tags=["parameters"]
model = "tiny"                 # "smollm2": the embedded SmolLM2-135M-Instruct
presses = ["knorm", "streaming_llm", "snapkv", "expected_attention", "tova", "observed_attention",
           "adakv"]               # any of kv.presses.names(): "keydiff", "lagkv", "pyramid", "chunkkv", ...
ratios = [0.25, 0.5, 0.75]
tokens = 256                   # context length of the quality and speed runs
continuation = 24              # teacher-forced tokens after it
tasks = 1                      # needle and variable-tracking tasks of each kind (RULER-style)
decode_tokens = 4              # greedy tokens timed for the decode speed
reuse_requests = 4             # requests sharing one compressed system prompt
reuse_press = "knorm:0.5"      # a query-agnostic press (query-aware ones are not reused)
agreement = True               # compare with kvpress when its peer venv is installed
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
from kvlab.presses.compress import Prefilled
from kvlab.presses.quality import answers, decode_speed, divergence, document, gated
from kvlab.presses.tasks import suite
from kvlab.primitives.snapshots import prefill, restore

m = kv.load(model)
rows = []  # the results table: one row per (section, press, ratio, metric)


def record(section, press, ratio, metric, value):
    rows.append({"section": section, "press": press, "ratio": ratio, "metric": metric,
                 "value": None if value is None else float(value)})


grid = {(name, r): kv.press(name, r) for name in presses for r in ratios}
m

# %% [markdown]
# ## 1 · Quality against ratio
#
# One prefill of the context serves every press and ratio (`Prefilled`: the prefill records what
# query-aware presses read, each press then compresses its own copy).

# %%
context, cont = document(m, tokens, continuation=continuation)
pre = Prefilled(m, context, list(grid.values()))
full = prefill(m, cont, restore(pre.snapshot), all_logits=True)[0]
found = {kind: answers(m, suite(kind, tasks, words=int(tokens * 0.7)), list(grid.values()), max_tokens=6)
         for kind in ("needle", "vt")}
for kind, got in found.items():
    record("baseline", "none", 0.0, f"{kind}_accuracy", gated(got[None], got[None])[1])
for (name, r), p in grid.items():
    c = pre.compress(p)
    for metric, value in divergence(m, pre, p, cont, full_logits=full, compressed=c).items():
        record("quality", name, r, metric, value)
    for kind, got in found.items():
        record("quality", name, r, f"{kind}_accuracy", gated(got[None], got[p.key])[0])
    record("bytes", name, r, "bytes_full", c.bytes_full)
    record("bytes", name, r, "bytes_kept", c.bytes_kept)
    record("bytes", name, r, "compress_s", c.compress_s)
record("bytes", "none", 0.0, "prefill_s", pre.prefill_s)
quality = pl.DataFrame(rows).filter(pl.col("section") == "quality").pivot(on="metric", index=["press", "ratio"],
                                                                          values="value")
quality

# %%
qfig = go.Figure(layout={"title": f"KL(full || compressed) against ratio on {m.name} ({len(context)} tokens)",
                         "xaxis_title": "ratio removed", "yaxis_title": "KL, nats per token (log)",
                         "yaxis_type": "log"})
for name in presses:
    part = quality.filter(pl.col("press") == name).sort("ratio")
    qfig.add_scatter(x=part["ratio"], y=[max(k, 1e-9) for k in part["kl"]], mode="lines+markers", name=name)
qfig

# %% [markdown]
# ## 2 · Bytes and decode time

# %%
speed_cache = {"full": restore(pre.snapshot)} | {f"knorm {r:.0%}": pre.compress(kv.press("knorm", r)).cache
                                                 for r in ratios}
for name, cache in speed_cache.items():
    record("decode", name, 0.0, "tokens_per_s", decode_speed(m, cache, cont[0], decode_tokens))
pl.DataFrame(rows).filter(pl.col("section").is_in(["bytes", "decode"]) & (pl.col("press") != "none")
                          & pl.col("metric").is_in(["bytes_kept", "tokens_per_s"]))

# %% [markdown]
# ## 3 · Agreement with kvpress
#
# kvpress (PyTorch, CPU) on the same SmolLM2 weights, in its own virtualenv: the kept positions per
# layer and KV head for streaming_llm, knorm, snapkv, expected_attention and tova on the same
# prompts (`kvlab.presses.kvpress_peer`).

# %%
from kvlab.presses import kvpress_peer
from kvlab.venvs import installed

agreed = [n for n in ("streaming_llm", "knorm", "snapkv", "expected_attention", "tova") if n in presses]
ready = installed(kvpress_peer.kvpress_venv(), f"{kvpress_peer.KVPRESS} torch=={kvpress_peer.TORCH_VERSION}")
if agreement and ready and m.name == "smollm2" and agreed:
    peers = kvpress_peer.run([kvpress_peer.Case(context, n, r) for n in agreed for r in ratios], m)
    both = Prefilled(m, context, [kv.press(n, r) for n in agreed for r in ratios])
    for peer in peers:
        ours = both.compress(kv.press(peer.press, peer.ratio)).kept
        frame = kvpress_peer.agreement(ours, peer)
        why = kvpress_peer.explain(ours, peer)
        ties = why.filter(pl.col("verdict") == "near_tie").height if why.height else 0
        record("agreement", peer.press, peer.ratio, "exact_heads", frame["exact"].sum())
        record("agreement", peer.press, peer.ratio, "heads", frame.height)
        record("agreement", peer.press, peer.ratio, "near_tie_heads", ties)
        print(f"{peer.press} {peer.ratio:.0%}: {kvpress_peer.summary(frame)}; {ties} near-ties")
else:
    print("kvpress agreement not run here: " + (
        "it compares on the embedded SmolLM2 (model = \"smollm2\")" if m.name != "smollm2" else
        "kvpress's venv is not installed (kvlab peer kvpress --install)" if not ready else "agreement = False"))

# %% [markdown]
# ## 4 · A compressed system prompt reused by many requests
#
# One document as the system prompt, `reuse_requests` questions. With a store the compressed
# document is stored once (under a key that includes the press) and every later request restores it
# whole; without a store each request compresses it again. `verify=True` compares every reused
# request with compressing afresh: the difference must be 0.

# %%
doc = " ".join(suite("needle", 1, words=int(tokens * 0.7))[0].context.split())
questions = [f"Question {i}: what does the text say about the code?" for i in range(reuse_requests)]
reuse = {}
for label, store in (("reused", kv.RadixStore()), ("recomputed", None)):
    e = kv.Engine(m, store, press=kv.presses.parse(reuse_press), verify=store is not None)
    out = [e.run([{"role": "system", "content": doc}, {"role": "user", "content": q}], max_tokens=2)
           for q in questions]
    reuse[label] = out
    for i, r in enumerate(out):
        record("reuse", label, float(i), "ttft_s", r.ttft_s)
        record("reuse", label, float(i), "reused_tokens", r.reused_tokens)
        record("reuse", label, float(i), "verify_diff", r.verify_diff)
pl.DataFrame([{"run": k, "request": i, "reused": r.reused_tokens, "ttft ms": r.ttft_s * 1e3,
               "verify_diff": r.verify_diff} for k, v in reuse.items() for i, r in enumerate(v)])

# %% [markdown]
# ## 5 · Where each press looks, and a press of your own
#
# Each token shaded by the share of layers x KV heads that kept it; the heatmap shows, for the
# token range of the slider, how much each head kept (`kv.viz.kept_view`, usable in any notebook).

# %%
shown = {name: pre.compress(kv.press(name, 0.5)) for name in presses[:3]}
kv.viz.kept_view(shown, m)

# %% [markdown]
# A press is one small function of a layer's keys and values (after RoPE, `[kv_heads, rows, dim]`)
# and the window's queries; kvlab keeps the top rows of each head, with every guarantee above.

# %%
def value_norm(keys, values, queries):
    return mx.linalg.norm(values, axis=-1)  # keep the rows whose values are largest


mine = kv.presses.from_function(value_norm, 0.5)
for metric, value in divergence(m, Prefilled(m, context, [mine]), mine, cont, full_logits=full).items():
    record("quality", "value_norm (yours)", 0.5, metric, value)
mine

# %% [markdown]
# ## Results

# %%
schema = {"section": pl.Utf8, "press": pl.Utf8, "ratio": pl.Float64, "metric": pl.Utf8, "value": pl.Float64}
results = pl.DataFrame(rows, schema=schema).with_columns(pl.lit(m.name).alias("model"))
results = kv.runner.save_results(results, results_path, "15_compression")

# %% [markdown]
# ## Findings

# %%
q = (results.filter((pl.col("section") == "quality") & ~pl.col("press").str.contains("yours"))
     .pivot(on="metric", index=["press", "ratio"], values="value"))
base = {r["metric"]: r["value"] for r in results.filter(pl.col("section") == "baseline").iter_rows(named=True)}
solved = any(v for v in base.values())


def best(ratio):
    part = q.filter(pl.col("ratio") == ratio)
    def key(r):
        return (-(r["needle_accuracy"] or 0) - (r["vt_accuracy"] or 0), r["kl"]) if solved else r["kl"]
    return min(part.iter_rows(named=True), key=key)


def fails(name):
    part = q.filter(pl.col("press") == name).sort("ratio")
    bad = [r["ratio"] for r in part.iter_rows(named=True) if r["top1"] < 0.9]
    return f"{name} from {bad[0]:.0%}" if bad else f"{name} holds top-1 >= 90% up to {part['ratio'].max():.0%}"


picks = "; ".join(f"at {r:.0%} removed **{best(r)['press']}** (KL {best(r)['kl']:.3f}, top-1 {best(r)['top1']:.0%})"
                  for r in sorted(q["ratio"].unique()))
dec = {r["press"]: r["value"] for r in results.filter(pl.col("section") == "decode").iter_rows(named=True)}
byt = results.filter((pl.col("section") == "bytes") & (pl.col("press") == "knorm"))
kept = {r["ratio"]: r["value"] for r in byt.filter(pl.col("metric") == "bytes_kept").iter_rows(named=True)}
full_b = byt.filter(pl.col("metric") == "bytes_full")["value"][0]
reused = results.filter((pl.col("section") == "reuse") & (pl.col("press") == "reused"))
vd = reused.filter(pl.col("metric") == "verify_diff")["value"].drop_nulls()
finding = (f"**The press to use on {m.name}** ({tokens}-token context, by "
           + ("gated accuracy, then KL" if solved else "KL: the uncompressed model solves none of the tasks, so no "
              "accuracy counts") + f"): {picks}.\n\n"
           f"**Where each press fails** (top-1 agreement below 90%): " + "; ".join(fails(n) for n in presses) + ".\n\n"
           f"**Bytes and decode**: knorm keeps " + ", ".join(f"{kept[r] / full_b:.0%} at {r:.0%}" for r in sorted(kept))
           + f" of the {full_b / 2**20:.2f} MiB cache; greedy decode "
           + ", ".join(f"{k} {v:.1f} tokens/s" for k, v in dec.items()) + ".\n\n"
           f"**Reuse**: {int((reused.filter(pl.col('metric') == 'reused_tokens')['value'] > 0).sum())} of "
           f"{reuse_requests} requests restored the compressed system prompt whole, each bit-identical to "
           f"compressing it again (max verify diff {max(vd) if len(vd) else 0.0:.1e}).")
ag = results.filter(pl.col("section") == "agreement").group_by("metric").agg(pl.col("value").sum())
if ag.height:
    a = dict(ag.iter_rows())
    finding += (f"\n\n**kvpress agreement**: {a['exact_heads']:.0f} of {a['heads']:.0f} (press, ratio, layer, "
                f"KV head) cells keep exactly kvpress's positions, {a['near_tie_heads']:.0f} differ by near-ties.")
Markdown(finding)
