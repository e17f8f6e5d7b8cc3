"""Per-request latencies and the run summary, with the definitions vLLM's ``bench serve`` uses.

One streamed request gives a send time and the arrival time of every *content chunk* (a streamed
chunk whose choice carries generated text, a reasoning delta or a tool-call delta; the closing
chunk that only carries ``finish_reason`` and the usage-only chunk are not tokens). From those
(:data:`DEFINITIONS` says the same in one line each; printouts, reprs and tables show it):

- **TTFT**: first content chunk minus send time.
- **ITL**: the gaps between consecutive content chunks (one list a request; a server that bundles
  several tokens in one chunk gives one gap for them, as in vLLM). Statistics pool every gap of
  every request: AIPerf calls this "inter chunk latency".
- **E2EL**: last content chunk minus send time.
- **TPOT**: ``(E2EL - TTFT) / (output_tokens - 1)`` per request, only for requests with more than
  one output token; the others are left out of the TPOT statistics. AIPerf calls this "inter
  token latency".
- **Output tokens**: the server's ``usage.completion_tokens``; else the reply re-tokenized (when a
  tokenizer is given); else the number of content chunks (column ``output_tokens_source``).
- **Throughput**: completed requests, output tokens and all tokens, each divided by the run's
  wall time (first send to last completion). Failed requests count in neither latencies nor
  throughput.
- Percentiles are numpy's linear-interpolated ``np.percentile``.

One difference from vLLM: vLLM counts any chunk with choices as a token, so a server that opens
the stream with a role-only chunk before prefill (vllm-mlx does) would get a TTFT that excludes
prefill, and one that closes with an empty ``finish_reason`` chunk (mlx-lm's server does) gets one
gap too many. kvlab counts a chunk only when it carries content.

Example:
    >>> m = request_metrics(0.0, [0.5, 0.6, 0.8], output_tokens=3)
    >>> m["ttft_ms"], m["itl_ms"], m["tpot_ms"]
    (500.0, [100.0, 200.0], 150.0)
"""

from __future__ import annotations

import numpy as np
import polars as pl

from ..result import hit_rates

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
GAP_TOL = 1e-3  # a batching flip at a top-2 logit gap above this is a real divergence

# what each figure means, in one line: the CLI, LoadResult's reprs and tables print these
DEFINITIONS = {
    "ttft_ms": "TTFT: send -> first content chunk (text, reasoning or tool-call delta), ms",
    "tpot_ms": "TPOT: per request (E2EL - TTFT) / (output_tokens - 1), ms "
               "(AIPerf: inter_token_latency; vLLM: TPOT)",
    "itl_ms": "ITL: every gap between consecutive content chunks, pooled over requests, ms "
              "(AIPerf: inter_chunk_latency; vLLM: ITL)",
    "e2el_ms": "E2EL: send -> last content chunk, ms (AIPerf: request_latency)",
    "output_throughput": "Output throughput: output tokens / run wall time, tokens/s; tokens = usage "
                         "completion_tokens (else the reply re-tokenized, else content chunks: "
                         "output_tokens_source)",
    "request_throughput": "Request throughput: completed requests / run wall time, requests/s",
}

SCHEMA = {
    "request": pl.Int64, "session": pl.Int64, "turn": pl.Int64, "name": pl.String,
    "endpoint": pl.String, "scheduled_s": pl.Float64, "start_s": pl.Float64, "ok": pl.Boolean,
    "error": pl.String, "ttft_ms": pl.Float64, "tpot_ms": pl.Float64, "e2el_ms": pl.Float64,
    "itl_ms": pl.List(pl.Float64), "output_tokens": pl.Int64, "prompt_tokens": pl.Int64,
    "prompt_tokens_expected": pl.Int64, "reused_tokens": pl.Int64, "reused_source": pl.String,
    "output_tokens_source": pl.String, "finish_reason": pl.String, "reply_chars": pl.Int64,
    "output_ids": pl.List(pl.Int64), "top2_gap": pl.List(pl.Float64), "reply": pl.String,
}


def legend(keys) -> list[str]:
    """The definition lines of the figures among ``keys`` (summary keys such as ``ttft_ms_p50``
    or frame columns), each once, in :data:`DEFINITIONS` order.

    Example:
        >>> legend(["ttft_ms_p50", "itl_ms_p50", "completed"])[0]
        'TTFT: send -> first content chunk (text, reasoning or tool-call delta), ms'
    """
    keys = [str(k) for k in keys]
    return [line for name, line in DEFINITIONS.items()
            if any(k == name or k.startswith(name + "_") for k in keys)]


def request_metrics(t_send: float, token_times, output_tokens: int | None) -> dict:
    """TTFT, ITL, E2EL and TPOT (milliseconds) of one request from its send time and the arrival
    times of its token chunks (seconds, any common clock).

    Example:
        >>> request_metrics(1.0, [1.25], 1)["tpot_ms"] is None
        True
    """
    times = [float(t) for t in token_times]
    if not times:
        return {"ttft_ms": None, "itl_ms": [], "e2el_ms": None, "tpot_ms": None}
    ttft = (times[0] - t_send) * 1e3
    e2el = (times[-1] - t_send) * 1e3
    itl = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    n = output_tokens if output_tokens is not None else len(times)
    tpot = (e2el - ttft) / (n - 1) if n and n > 1 else None
    return {"ttft_ms": ttft, "itl_ms": itl, "e2el_ms": e2el, "tpot_ms": tpot}


def frame_of(rows: list[dict]) -> pl.DataFrame:
    """Request rows (dicts with the :data:`SCHEMA` keys, missing ones null) as a polars frame."""
    cols = {k: [r.get(k) for r in rows] for k in SCHEMA}
    cols["itl_ms"] = [r.get("itl_ms") or [] for r in rows]
    return pl.DataFrame(cols, schema=SCHEMA)


def _stats(xs, name: str) -> dict:
    xs = np.asarray([x for x in xs if x is not None], dtype=float)
    out = {f"{name}_mean": float(xs.mean()) if xs.size else None,
           f"{name}_std": float(xs.std()) if xs.size else None}
    for p in PERCENTILES:
        out[f"{name}_p{p}"] = float(np.percentile(xs, p)) if xs.size else None
    return out


def summarise(frame: pl.DataFrame, duration_s: float) -> dict:
    """The run summary: counts, throughputs and mean/std/p50/p90/p99 of each latency, plus the
    two hit rates (per token: reused / prompt tokens; per request: share of requests that reused
    anything), over the requests whose server reported reuse.

    Example:
        >>> s = summarise(result.frame, result.duration_s)
        >>> s["ttft_ms_p50"] <= s["ttft_ms_p99"]
        True
    """
    ok = frame.filter(pl.col("ok"))
    out_tokens = int(ok["output_tokens"].fill_null(0).sum())
    in_tokens = int(ok["prompt_tokens"].fill_null(0).sum())
    dur = max(float(duration_s), 1e-9)
    s = {"completed": ok.height, "failed": frame.height - ok.height, "duration_s": float(duration_s),
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": ok.height / dur, "output_throughput": out_tokens / dur,
         "total_token_throughput": (in_tokens + out_tokens) / dur,
         "output_tokens_source": "+".join(sorted(set(ok["output_tokens_source"].drop_nulls()))) or None}
    for name in LATENCIES:
        xs = ok[name].explode().to_list() if name == "itl_ms" else ok[name].to_list()
        s.update(_stats(xs, name))
    known = ok.filter(pl.col("reused_tokens").is_not_null())
    s["reuse_known"] = known.height
    s["reused_tokens"] = int(known["reused_tokens"].sum()) if known.height else None
    rates = hit_rates(zip(known["prompt_tokens"].fill_null(0).to_list(), known["reused_tokens"].to_list()))
    s["token_hit_rate"] = rates["token_hit_rate"] if known.height else None
    s["request_hit_rate"] = rates["request_hit_rate"] if known.height else None
    expected = ok.filter(pl.col("prompt_tokens_expected").is_not_null())
    s["prompt_token_mismatches"] = expected.filter(
        pl.col("prompt_tokens") != pl.col("prompt_tokens_expected")).height
    return s


def compare_outputs(frame: pl.DataFrame, reference: pl.DataFrame, *, tol: float = GAP_TOL) -> pl.DataFrame:
    """Each request's output token ids against the same request (same session and turn) in a
    reference run (typically served alone with caching off). Both runs need ``record_tokens``.

    Columns: ``equal``, ``first_diff`` (the first differing step or null), ``gap`` (the reference's
    top-2 logprob gap at that step: the margin the two runs disagreed on) and ``ok`` (equal, or a
    near-tie flip with ``gap <= tol``).

    Example:
        >>> c = compare_outputs(concurrent.frame, alone.frame)
        >>> c["ok"].all()
        True
    """
    keys = ["session", "turn"]
    a = frame.filter(pl.col("ok")).select(*keys, "name", pl.col("output_ids").alias("ids"))
    b = reference.filter(pl.col("ok")).select(*keys, pl.col("output_ids").alias("ref_ids"),
                                              pl.col("top2_gap").alias("ref_gap"))
    rows = []
    for r in a.join(b, on=keys, how="inner").iter_rows(named=True):
        ids, ref = r["ids"], r["ref_ids"]
        if ids is None or ref is None:
            rows.append({**{k: r[k] for k in (*keys, "name")}, "equal": None, "first_diff": None,
                         "gap": None, "ok": None})
            continue
        diff = next((i for i, (x, y) in enumerate(zip(ids, ref)) if x != y),
                    None if len(ids) == len(ref) else min(len(ids), len(ref)))
        gaps = r["ref_gap"] or []
        gap = gaps[diff] if diff is not None and diff < len(gaps) else None
        rows.append({**{k: r[k] for k in (*keys, "name")}, "equal": diff is None, "first_diff": diff,
                     "gap": gap, "ok": diff is None or (gap is not None and gap <= tol)})
    return pl.DataFrame(rows, schema={"session": pl.Int64, "turn": pl.Int64, "name": pl.String,
                                      "equal": pl.Boolean, "first_diff": pl.Int64, "gap": pl.Float64,
                                      "ok": pl.Boolean})
