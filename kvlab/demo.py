"""`kvlab demo`: a short readable report on the embedded model.

1. a three-turn conversation, run cold and with prefix reuse (tokens reused, prefill time each way);
2. seed 002's billing header: where it breaks reuse, and the fix by normalisation.
"""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl

from . import _blas
from .runner import run_notebook


def _matmul_gflops() -> float:
    import mlx.core as mx

    a, w = mx.random.normal((1024, 896)), mx.random.normal((896, 4864))
    mx.eval(a, w, a @ w)
    t = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ w)
    return 2 * 1024 * 896 * 4864 / ((time.perf_counter() - t) / 5) / 1e9


def conversation_report(model, turns: int = 3, max_tokens: int = 24) -> list[dict]:
    """Run a growing chat through a RadixStore (keying prompt+output), then the same prompts cold."""
    import kvlab as kv

    cached = kv.Engine(model, kv.RadixStore(), keying="prompt+output", verify=True)
    cold = kv.Engine(model, None)
    questions = ["What is the capital of France?", "What river runs through it?",
                 "Name one famous museum there."]
    messages = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, "
                 "trained by Hugging Face"}]
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": questions[turn % len(questions)]})
        hit = cached.run(messages, max_tokens=max_tokens)
        base = cold.run(messages, max_tokens=1)
        rows.append({"turn": turn + 1, "prompt_tokens": hit.prompt_tokens,
                     "reused_tokens": hit.reused_tokens, "match": hit.match,
                     "cold_prefill_ms": base.prefill_s * 1e3, "cached_prefill_ms": hit.prefill_s * 1e3,
                     "verify_max_abs_logit_diff": hit.verify_diff, "answer": hit.text.strip()})
        messages.append({"role": "assistant", "content": hit.text.replace("<|im_end|>", "").strip()})
    return rows


def billing_header_report(model) -> dict:
    """Two agentic requests differing only in the header's cch=: divergence, then normalised reuse."""
    import kvlab as kv

    wl = kv.workloads.agentic_loop(turns=2, billing_header=True, system_tokens=400)
    a, b = (kv.tokenise(model, list(r.messages)) for r in wl.requests)
    div = kv.diverge(a, b)
    fields = kv.volatile_fields([list(r.messages) for r in wl.requests], model=model)
    reuse = {}
    for label, requests in (("as sent", [list(r.messages) for r in wl.requests]),
                            ("normalised", [kv.normalise(list(r.messages)) for r in wl.requests])):
        engine = kv.Engine(model, kv.RadixStore())
        results = [engine.run(msgs, max_tokens=1) for msgs in requests]
        reuse[label] = (results[-1].reused_tokens, results[-1].prompt_tokens)
    return {"divergence": div, "fields": fields, "reuse": reuse}


def main(model_name: str = "smollm2") -> int:
    import kvlab as kv

    t = time.perf_counter()
    model = kv.load(model_name)
    print(f"kvlab demo — {model!r} (loaded in {time.perf_counter() - t:.1f} s)")
    blas = "OpenBLAS" if _blas.fast_blas_active() else "reference BLAS (slow: see README)"
    print(f"BLAS: {blas}; float32 1024x896 @ 896x4864 matmul: {_matmul_gflops():.0f} GFLOP/s\n")

    print("1. Three-turn conversation: cold prefill vs RadixStore reuse (keying prompt+output)")
    rows = conversation_report(model)
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'match':>8} {'cold ms':>9} {'cached ms':>10} "
          f"{'speed-up':>9} {'max|Δlogit|':>12}")
    for r in rows:
        speed = r["cold_prefill_ms"] / max(r["cached_prefill_ms"], 1e-9)
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['reused_tokens']:>7} {r['match']:>8} "
              f"{r['cold_prefill_ms']:>9.1f} {r['cached_prefill_ms']:>10.1f} {speed:>8.1f}x "
              f"{r['verify_max_abs_logit_diff']:>12.2e}")
        print(f"     answer: {r['answer'][:90]!r}")

    print("\n2. Seed 002: a per-request billing header in the system prompt")
    rep = billing_header_report(model)
    div = rep["divergence"]
    print(f"   first differing token: {div.token_index} (message {div.message_index}, {div.role}); "
          f"{div.token_a!r} vs {div.token_b!r}")
    for f in rep["fields"]:
        print(f"   volatile field: {f!r}")
    for label, (reused, total) in rep["reuse"].items():
        print(f"   second request reuse, {label:>10}: {reused}/{total} tokens")
    print("\n3. Notebooks through papermill (executed notebook, HTML report and results table each)")
    for notebook, params, columns in DEMO_RUNS:
        run = run_notebook(NOTEBOOKS / notebook, {"model": model_name, **params})
        print(f"   {notebook}: ok in {run.seconds:.0f} s; report: {run.html}")
        frame = run.results
        with pl.Config(tbl_rows=12, tbl_cols=len(columns), tbl_width_chars=140, tbl_hide_dataframe_shape=True):
            print(frame.select([c for c in columns if c in frame.columns]))
    print("\nNext: `make test`, open the notebooks in JupyterLab (kernel 'kvlab'), or "
          "`kvlab run notebooks/01_multi_turn.ipynb -p model smollm2`.")
    return 0


NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
DEMO_RUNS = (
    ("00_quickstart.ipynb", {}, ("model", "prompt_tokens", "system_prefix_tokens", "split_clean",
                                  "second_reused_tokens", "second_verify_diff", "ttft_first_ms",
                                  "ttft_second_ms")),
    ("02_agentic_billing_header.ipynb", {"turns": 2, "stores": ["radix"]},
     ("store", "mode", "step", "prompt_tokens", "reused_tokens", "first_divergence_raw")),
)
