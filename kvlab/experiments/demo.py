"""`kvlab demo`: a short readable report on the embedded model.

1. a long shared system prompt: a conversation and a second user reuse it (tokens reused, time to
   first token cached and cold, measured side by side);
2. seed 002's billing header: where it breaks reuse, and the fix by normalisation;
3. two notebooks through papermill.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import polars as pl

from .. import device
from ..primitives import timing
from .runner import run_notebook

# (who, question): a conversation of two turns, then another user of the same assistant
REQUESTS = (("user A", "What is the capital of France?"), ("user A", "What river runs through it?"),
            ("user B", "Which tool reads a file?"))


def _matmul_gflops() -> float:
    import mlx.core as mx

    a, w = mx.random.normal((1024, 896)), mx.random.normal((896, 4864))
    mx.eval(a, w, a @ w)
    t = timing.timed()
    for _ in range(5):
        mx.eval(a @ w)
    return 2 * 1024 * 896 * 4864 / (t.done() / 5) / 1e9


def shared_prefix_report(model, system_tokens: int = 400, max_tokens: int = 24) -> list[dict]:
    """Run REQUESTS behind one long system prompt (a coding assistant's, with tool schemas) through
    a RadixStore keyed on prompt + output, and each request that hit again on an engine without a
    store (the cold baseline; a miss is its own baseline, and it warms the model up).

    Example:
        >>> rows = shared_prefix_report(kv.load("tiny"))
        >>> [r["reused_tokens"] for r in rows][0]
        0
    """
    import kvlab as kv

    system = kv.workloads.shared_system_prompt(num_users=1, system_tokens=system_tokens)[0].messages[0]
    cached = kv.Engine(model, kv.RadixStore(), keying="prompt+output", verify=True)
    cold = kv.Engine(model, None)
    shared = kv.tokenise(model, [system, {"role": "user", "content": "?"}]).spans[0].token_end
    conversations: dict[str, list[dict]] = {}
    rows = []
    for i, (who, question) in enumerate(REQUESTS, 1):
        messages = conversations.setdefault(who, [system])
        messages.append({"role": "user", "content": question})
        hit = cached.run(messages, max_tokens=max_tokens)
        base = cold.run(messages, max_tokens=1) if hit.reused_tokens else None
        rows.append({"request": i, "who": who, "system_prompt_tokens": shared,
                     "prompt_tokens": hit.prompt_tokens, "reused_tokens": hit.reused_tokens,
                     "prefilled_tokens": hit.prefilled_tokens,
                     "cold_prefilled_tokens": base.prefilled_tokens if base else None,
                     "cold_ttft_ms": base.ttft_s * 1e3 if base else None,
                     "cached_ttft_ms": hit.ttft_s * 1e3, "verify_max_abs_logit_diff": hit.verify_diff,
                     "answer": hit.text.replace("<|im_end|>", "").strip()})
        messages.append({"role": "assistant", "content": rows[-1]["answer"]})
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

    t = timing.timed()
    model = kv.load(model_name)
    print(f"kvlab demo — {model!r} (loaded in {t.done():.1f} s)")
    dev = device.current()
    blas = dev.blas + (" (slow: see README)" if dev.slow_blas else "")
    print(f"Device: {dev.backend} ({dev.name}); BLAS: {blas}; "
          f"float32 1024x896 @ 896x4864 matmul: {_matmul_gflops():.0f} GFLOP/s\n")

    rows = shared_prefix_report(model)
    print(f"1. A shared system prompt of {rows[0]['system_prompt_tokens']} tokens (a coding assistant with "
          "tool schemas): RadixStore vs no cache")
    print(f"{'req':>3} {'who':>6} {'prompt':>6} {'reused':>6} {'prefill':>7} {'TTFT cold':>10} "
          f"{'cached':>8} {'speed-up':>8} {'max|Δlogit|':>11}  answer")
    for r in rows:
        cold = "(miss)" if r["cold_ttft_ms"] is None else f"{r['cold_ttft_ms']:.0f} ms"
        speed = "" if r["cold_ttft_ms"] is None else f"{r['cold_ttft_ms'] / r['cached_ttft_ms']:.1f}x"
        print(f"{r['request']:>3} {r['who']:>6} {r['prompt_tokens']:>6} {r['reused_tokens']:>6} "
              f"{r['prefilled_tokens']:>7} {cold:>10} {r['cached_ttft_ms']:>5.0f} ms {speed:>8} "
              f"{r['verify_max_abs_logit_diff']:>11.1e}  {r['answer'][:40]!r}")
    hits = [r for r in rows if r["reused_tokens"]]
    if hits:
        cold_ms = statistics.median(r["cold_ttft_ms"] for r in hits)
        cached_ms = statistics.median(r["cached_ttft_ms"] for r in hits)
        print(f"    requests that hit: {sum(r['reused_tokens'] for r in hits)} of "
              f"{sum(r['prompt_tokens'] for r in hits)} prompt tokens reused; median time to first token "
              f"{cached_ms:.0f} ms cached vs {cold_ms:.0f} ms cold ({cold_ms / cached_ms:.1f}x faster)")

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
          "`kvlab execute notebooks/01_multi_turn.ipynb -p model smollm2`.")
    return 0


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
DEMO_RUNS = (
    ("00_quickstart.ipynb", {}, ("model", "second_prompt_tokens", "second_reused_tokens",
                                  "second_prefilled_tokens", "second_verify_diff", "ttft_cold_ms",
                                  "ttft_second_ms", "ttft_speedup")),
    ("02_agentic_billing_header.ipynb", {"turns": 2, "stores": ["radix"]},
     ("store", "mode", "step", "prompt_tokens", "reused_tokens", "first_divergence_raw")),
)
