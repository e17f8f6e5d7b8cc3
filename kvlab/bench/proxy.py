"""The proxy's cost: TTFT through ``kvlab proxy`` against the same requests sent straight to plain
``mlx_lm.server`` (issue 19's target: the proxy adds at most 5 ms p50).

The upstream runs with its prompt cache off, so every request does the same work whichever way
it comes; both the upstream and the proxy are child processes on loopback (the client shares a
process with neither), and the proxy has the model's tokenizer, as a user runs it for token-level
rows. Each repeat sends the same requests both ways, one at a time, in alternating order (direct
first on even repeats); the added TTFT is the proxied run's p50 minus the direct run's, per repeat.

Example:
    >>> t = bench_proxy(kv.load("tiny"), 1, requests=4)
    >>> t.values["added_ms"]["median"] < 50
    True
"""

from __future__ import annotations

from .serving import served_load
from .settings import Settings
from .table import Table, spread

NEEDS_MODEL = True
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def bench_proxy(model, repeats: int, *, requests: int = 24, max_tokens: int = 2) -> Table:
    """Rows: direct, through the proxy, and the added TTFT p50 (ms, median ± pstdev over repeats)."""
    from ..request import Request, Workload
    from ..serving import peers

    name = model.name if model.name in ("smollm2", "tiny") else str(model.path)
    workload = Workload("same prompt", tuple(Request(messages=PROMPT, max_tokens=max_tokens, name=f"r{i}")
                                             for i in range(requests)), {}, "one short chat prompt, repeated")
    ttft = {"direct": [], "proxy": []}
    e2e = {"direct": [], "proxy": []}
    with peers.start_mlx_lm(model, prompt_cache_size=0) as upstream, \
            peers.start_kvlab_proxy(upstream.url, tokenizer=name) as px:
        for rep in range(max(1, repeats)):
            order = (("direct", upstream), ("proxy", px))
            for way, srv in (order if rep % 2 == 0 else order[::-1]):
                r = served_load(srv, way, workload, tokenizer=model, concurrency=1, seed=rep)
                ttft[way].append(r.summary["ttft_ms_p50"])
                e2e[way].append(r.summary["e2el_ms_p50"])
    added = spread([p - d for p, d in zip(ttft["proxy"], ttft["direct"])])
    rows = [(way, f"{spread(ttft[way])['median']:.1f} ± {spread(ttft[way])['pstdev']:.1f}",
             f"{spread(e2e[way])['median']:.1f}") for way in ("direct", "proxy")]
    rows.append(("added by the proxy (per-repeat difference)", f"{added['median']:+.1f} ± {added['pstdev']:.1f}", ""))
    return Table(f"kvlab proxy in front of mlx_lm.server ({requests} requests x {repeats}, {model.name})",
                 f"kvlab bench --only proxy --model {model.name} --repeats {repeats}",
                 ("path", "TTFT p50 ms median ± pstdev", "E2E p50 ms median"), tuple(rows),
                 "mlx_lm.server with its prompt cache off (every request the same work), the proxy with the "
                 f"model's tokenizer; {requests} requests of one short chat prompt, {max_tokens} tokens out, "
                 "one at a time, sent straight and through the proxy in alternating order each repeat. "
                 "Target: the proxy adds <= 5 ms to TTFT p50.",
                 values={"added_ms": added, "direct_ms": spread(ttft["direct"]), "proxy_ms": spread(ttft["proxy"]),
                         "requests": requests, "repeats": repeats, "model": model.name})


def table(s: Settings) -> Table:
    return bench_proxy(s.model, s.repeats)
