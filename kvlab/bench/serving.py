"""Serving under load: kvlab serve with each store, plain mlx_lm.server (its own LRUPromptCache)
and vllm-mlx in its three modes, on the same model, workload and concurrency levels.

Every server runs as a child process on loopback (the load client never shares a process with
the server it measures), started fresh for each repeat, and the repeats are interleaved across
servers. The workload is vLLM's prefix_repetition (one shared prefix; a fresh prefix at each
concurrency level, so every level starts cold). The last two columns compare each row with plain
mlx_lm.server at the same concurrency: the adapter's overhead is the ``kvlab serve mlx-lru`` row
(the same LRUPromptCache, observed through kvlab's adapter).

Example:
    >>> t = bench_serving(kv.load("tiny"), 1, concurrency=(1, 2), servers=["mlx_lm.server"])
    >>> t.columns[:2]
    ('server', 'concurrency')
"""

from __future__ import annotations

import functools

from .settings import Settings
from .table import Table, spread

NEEDS_MODEL = True
PEERS = True  # runs mlx_lm.server and vllm-mlx, which load the folder's stored dtype
CONCURRENCY = (1, 2, 4, 8)
STORES = ("radix", "paged", "system", "mlx-lru")
VLLM_MODES = ("simple", "batched", "paged")
PLAIN = "mlx_lm.server"


def servers_for(model) -> dict:
    """Server name -> a function that starts it on ``model`` (a ``PeerServer`` context manager);
    every server runs ``model.dtype`` (kvlab serve is told it; the peers load the folder's stored
    dtype, so a model cast to another dtype is refused by ``require_stored_dtype``)."""
    from ..models.dtypes import require_stored_dtype
    from ..serving import peers

    require_stored_dtype(model, "mlx_lm.server and vllm-mlx")
    name = model.name if model.name in ("smollm2", "tiny", "tiny-hybrid") else str(model.path)
    out = {f"kvlab serve {s}": functools.partial(peers.start_kvlab_serve, name, s, dtype=model.dtype)
           for s in STORES}
    out[PLAIN] = functools.partial(peers.start_mlx_lm, model)
    out.update({f"vllm-mlx {m}": functools.partial(peers.start_vllm_mlx, model, m) for m in VLLM_MODES})
    return out


def bench_serving(model, repeats: int, *, concurrency=CONCURRENCY, servers=None, requests: int = 8,
                  prefix_len: int = 256, suffix_len: int = 64, output_len: int = 16) -> Table:
    """One row per server and concurrency: output throughput, TTFT p50/p99, TPOT p50, token hit
    rate, memory held, and the ratios to plain mlx_lm.server. ``servers`` picks a subset of
    :func:`servers_for`'s names.

    Example:
        >>> bench_serving(kv.load("tiny"), 1, concurrency=(2,), servers=["mlx_lm.server"]).rows[0][:2]
        ('mlx_lm.server', 2)
    """
    from ..errors import KvlabError

    every = servers_for(model)
    names = list(servers or every)
    unknown = set(names) - set(every)
    if unknown:
        raise KvlabError(f"unknown server(s) {sorted(unknown)}; choose from {list(every)}")
    runs: dict[tuple[str, int], list[dict]] = {(n, c): [] for n in names for c in concurrency}
    for rep in range(repeats):
        for name in names:
            with every[name]() as srv:
                for c in concurrency:
                    runs[(name, c)].append(_one(srv, model, c, rep, requests, prefix_len, suffix_len,
                                                output_len))
    rows = []
    for (name, c), xs in runs.items():
        base = runs.get((PLAIN, c))
        tput, ttft = spread([x["output_throughput"] for x in xs]), spread([x["ttft_ms_p50"] for x in xs])
        p99, tpot = spread([x["ttft_ms_p99"] for x in xs]), spread([x["tpot_ms_p50"] for x in xs])
        hit = spread([x["hit"] for x in xs]) if all(x["hit"] is not None for x in xs) else None
        held = xs[-1]["held"]
        vs = ("", "")
        if base:
            vs = (f"{tput['median'] / spread([x['output_throughput'] for x in base])['median']:.2f}x",
                  f"{ttft['median'] / spread([x['ttft_ms_p50'] for x in base])['median']:.2f}x")
        rows.append((name, c, f"{tput['median']:.1f} ± {tput['pstdev']:.1f}",
                     f"{ttft['median']:.0f} ({ttft['min']:.0f}-{ttft['max']:.0f})", f"{p99['median']:.0f}",
                     f"{tpot['median']:.1f}", "n/a" if hit is None else f"{hit['median']:.1%}{xs[-1]['hit_note']}",
                     held, *vs))
    return Table(f"serving under load: prefix_repetition ({requests} requests of {prefix_len}+{suffix_len} "
                 f"tokens, {output_len} out) on {model.name}, every server in {model.dtype}",
                 f"kvlab bench --only serving --model {model.name} --repeats {repeats}",
                 ("server", "concurrency", "output tok/s median ± pstdev", "TTFT p50 ms median (min-max)",
                  "TTFT p99 ms", "TPOT p50 ms", "token hit rate", "memory held",
                  "throughput vs mlx_lm.server", "TTFT p50 vs mlx_lm.server"), tuple(rows),
                 _notes(runs, concurrency), values={"runs": _medians(runs), "plain": PLAIN, "model": model.name})


def served_load(srv, what: str, workload: str, **kw):
    """``generate_load`` against a started server ``srv``, every request answered: a failure raises
    KvlabError naming ``what`` was measured, with the end of the server's log."""
    from ..errors import KvlabError
    from ..serving.loadgen import generate_load

    try:
        r = generate_load(srv.url, workload, progress=False, **kw)
    except KvlabError as e:
        raise KvlabError(f"{srv!r} {what}: {e}\nits log ends:\n{srv.log(tail=15)}") from e
    failed = r.summary["failed"]
    if failed:
        raise KvlabError(f"{srv!r} {what}: {failed} of {r.frame.height} requests failed: "
                         f"{r.frame.filter(~r.frame['ok'])['error'][0]}\nits log ends:\n{srv.log(tail=15)}")
    return r


def _one(srv, model, c, rep, requests, prefix_len, suffix_len, output_len) -> dict:
    from ..primitives.units import fmt_bytes

    r = served_load(srv, f"at concurrency {c}", "prefix_repetition", tokenizer=model, concurrency=c,
                    num_requests=requests, prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len,
                    num_prefixes=1, seed=1000 * rep + c)
    s = r.summary
    delta, after = r.server_delta(), r.server_after
    hit, note = s["token_hit_rate"], ""
    saved = delta.get("/v1/cache/stats:engine_cache.tokens_saved")
    if hit is None and saved is not None:  # vllm-mlx: only its own counter says
        hit, note = saved / max(1, s["total_input_tokens"]), " (its counter)"
    held = "n/a"
    if "/kvlab/stats" in after:
        held = fmt_bytes(int(after["/kvlab/stats"].get("bytes") or 0))
    elif ((after.get("/v1/cache/stats") or {}).get("engine_cache") or {}).get("current_memory_mb") is not None:
        held = f"{after['/v1/cache/stats']['engine_cache']['current_memory_mb']:.1f} MB (its report)"
    return {"output_throughput": s["output_throughput"], "ttft_ms_p50": s["ttft_ms_p50"],
            "ttft_ms_p99": s["ttft_ms_p99"], "tpot_ms_p50": s["tpot_ms_p50"] or 0.0, "hit": hit,
            "hit_note": note, "held": held}


def _medians(runs: dict) -> dict:
    """server -> concurrency -> medians and pstdevs of throughput, TTFT p50 and hit rate."""
    out: dict = {}
    for (name, c), xs in runs.items():
        if not xs:
            continue
        tput, ttft = spread([x["output_throughput"] for x in xs]), spread([x["ttft_ms_p50"] for x in xs])
        hits = [x["hit"] for x in xs if x["hit"] is not None]
        out.setdefault(name, {})[c] = {"throughput": tput["median"], "throughput_pstdev": tput["pstdev"],
                                       "ttft_ms_p50": ttft["median"], "ttft_ms_p50_pstdev": ttft["pstdev"],
                                       "hit": spread(hits)["median"] if hits else None}
    return out


ADAPTER = "kvlab serve mlx-lru"


def adapter_overhead(a: dict, b: dict) -> tuple[bool, str]:
    """The adapter's overhead at one concurrency, from :func:`_medians` entries of ``kvlab serve
    mlx-lru`` (``a``) and plain mlx_lm.server (``b``): met when its throughput is within 5% and its
    TTFT p50 no higher (median <= plain's median + pstdev: repeats of the same server spread that
    much) at equal hit rate (within one point)."""
    tput, ttft = a["throughput"] / b["throughput"], a["ttft_ms_p50"] / b["ttft_ms_p50"]
    equal_hits = a["hit"] is not None and b["hit"] is not None and abs(a["hit"] - b["hit"]) <= 0.01
    ok = tput >= 0.95 and (a["ttft_ms_p50"] <= b["ttft_ms_p50"] + b["ttft_ms_p50_pstdev"] or not equal_hits)
    hits = "n/a" if a["hit"] is None or b["hit"] is None else f"{a['hit']:.1%} vs {b['hit']:.1%}"
    return ok, f"throughput {tput:.2f}x, TTFT p50 {ttft:.2f}x at hit rates {hits}"


def _notes(runs: dict, concurrency) -> str:
    lines = ["Target (the adapter's overhead): `kvlab serve mlx-lru` within 5% of plain mlx_lm.server's "
             "throughput, and no higher TTFT p50 (median <= plain's median + pstdev) at equal hit rate."]
    medians = _medians(runs)
    for c in concurrency:
        a, b = medians.get(ADAPTER, {}).get(c), medians.get(PLAIN, {}).get(c)
        if not a or not b:
            continue
        ok, text = adapter_overhead(a, b)
        lines.append(f"concurrency {c}: {text}: {'meets' if ok else 'misses'} the target.")
    lines.append("vllm-mlx's hit rate is its own `tokens_saved` counter over prompt tokens (its usage "
                 "reports none); notebook 09_serving shows that counter overstates what its memory-aware "
                 "cache saves.")
    from ..serving.metrics import legend

    shown = ("ttft_ms", "tpot_ms", "output_throughput")
    lines.append("Definitions (kvlab load): " + "; ".join(legend(shown)) + ".")
    return "\n".join(lines)


def table(s: Settings) -> Table:
    return bench_serving(s.model, s.repeats)
