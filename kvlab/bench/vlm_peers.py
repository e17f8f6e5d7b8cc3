"""VLM peers: the same image load through mlx-vlm's server with its Automatic Prefix Caching on,
with it off, and through ``kvlab serve --model <vlm> --store <store>`` (issue 21 §3).

Each (model, traffic, arm) runs on a fresh server (child processes on loopback, stopped by pid),
one request at a time (``concurrency=1``, so queueing never reads as prefill), with the
``multimodal`` workload: ``text`` traffic (text-only requests sharing a system prompt) and
``mixed`` traffic (every second request an image, the images cycling through two of one size).
Figures: TTFT p50 / p99 (ms, first content chunk; median over repeats), reused tokens as the
server reports them in usage (``cached_tokens``) and, for APC, what its stats say it matched and
restored, and the bytes its cache holds at the end (APC: ``resident_bytes`` + ``exact_resident_bytes``;
kvlab serve: its store's ``bytes``).

The kvlab serve arm needs a kvlab serve that serves VLMs; where it cannot start on the model the
section raises a PeerError saying so (choose ``arms=APC_ARMS`` to run mlx-vlm alone).

Example:
    >>> t = bench_vlm_peers(1, arms=APC_ARMS, num_requests=6)
    >>> t.values["tiny-vlm"]["mixed"]["mlx-vlm APC"]["restored_tokens"]
    128
"""

from __future__ import annotations

import statistics

from ..serving.peer_venv import PeerError
from .settings import Settings
from .table import Table

NEEDS_MODEL = False  # it loads the VLMs itself
MODELS = ("tiny-vlm", "tiny-vlm:qwen3_5", "tiny-vlm:gemma4")  # dense, hybrid, sliding
TRAFFIC = ("text", "mixed")
APC_ARMS = ("mlx-vlm APC", "mlx-vlm APC off")
ARMS = (*APC_ARMS, "kvlab serve")
APC_STATS = "/v1/cache/stats"


def start_arm(arm: str, model: str, store: str):
    """The server of ``arm`` on ``model``, started on loopback."""
    from ..serving import peers
    from ..serving.peers_vlm import start_mlx_vlm

    if arm == "mlx-vlm APC":
        return start_mlx_vlm(model, apc=True)
    if arm == "mlx-vlm APC off":
        return start_mlx_vlm(model, apc=False)
    if arm == "kvlab serve":
        try:
            return peers.start_kvlab_serve(model, store)
        except PeerError as e:
            raise PeerError(f"kvlab serve cannot serve the VLM {model!r} here (this kvlab's serve does not "
                            f"take VLMs yet): {str(e)[:600]}\nRun the section with arms=APC_ARMS to "
                            "compare mlx-vlm's APC on and off alone") from e
    raise PeerError(f"unknown arm {arm!r}; use one of {', '.join(ARMS)}")


def run_arm(arm: str, model: str, traffic: str, *, store: str, num_requests: int, output_len: int,
            seed: int = 0) -> dict:
    """One arm's figures on a fresh server (see :func:`measure`)."""
    with start_arm(arm, model, store) as srv:
        return measure(srv.url, f"{arm} {traffic}", traffic, num_requests=num_requests, output_len=output_len,
                       seed=seed)


def measure(url: str, label: str, traffic: str, *, num_requests: int, output_len: int, seed: int = 0) -> dict:
    """The multimodal load (``traffic``) on the server at ``url``, one request at a time: TTFT
    p50/p99, reused tokens (usage), APC's matched and restored tokens (None without APC), prompt
    tokens and the bytes the cache holds at the end.

    Example:
        >>> measure(srv.url, "APC mixed", "mixed", num_requests=6, output_len=4)["restored_tokens"]
        128
    """
    from ..serving.loadgen import generate_load

    r = generate_load(url, "multimodal", concurrency=1, num_requests=num_requests, traffic=traffic,
                      output_len=output_len, seed=seed, progress=False, label=label)
    failed = r.frame.filter(~r.frame["ok"])
    if failed.height:
        raise PeerError(f"{label} at {url} failed {failed.height} of {r.frame.height} {traffic} requests; "
                        f"first: {failed['error'][0]}")
    s, delta = r.summary, r.server_delta()
    after = r.server_after
    if APC_STATS in after and after[APC_STATS].get("enabled"):
        held = int(after[APC_STATS]["resident_bytes"]) + int(after[APC_STATS]["exact_resident_bytes"])
    else:
        held = int((after.get("/kvlab/stats") or {}).get("bytes") or 0)
    return {"ttft_ms_p50": s["ttft_ms_p50"], "ttft_ms_p99": s["ttft_ms_p99"],
            "reused_tokens": int(r.frame["reused_tokens"].fill_null(0).sum()),
            "matched_tokens": delta.get(f"{APC_STATS}:matched_tokens"),
            "restored_tokens": delta.get(f"{APC_STATS}:restored_tokens"),
            "prompt_tokens": int(r.frame["prompt_tokens"].fill_null(0).sum()), "bytes_held": held}


def bench_vlm_peers(repeats: int = 1, *, models=MODELS, traffic=TRAFFIC, arms=ARMS, store: str = "radix",
                    num_requests: int = 8, output_len: int = 4) -> Table:
    """Rows: model x traffic x arm, each on a fresh server per repeat (medians over repeats)."""
    values: dict = {}
    rows = []
    for model in models:
        for tr in traffic:
            for arm in arms:
                runs = [run_arm(arm, model, tr, store=store, num_requests=num_requests, output_len=output_len,
                                seed=rep) for rep in range(max(1, repeats))]
                med = {k: (statistics.median(x[k] for x in runs) if runs[0][k] is not None else None)
                       for k in runs[0]}
                values.setdefault(model, {}).setdefault(tr, {})[arm] = med
                apc = ("-" if med["matched_tokens"] is None
                       else f"{med['matched_tokens']:.0f} / {med['restored_tokens']:.0f}")
                rows.append((model, tr, arm, f"{med['ttft_ms_p50']:.1f}", f"{med['ttft_ms_p99']:.1f}",
                             f"{med['reused_tokens']:.0f} of {med['prompt_tokens']:.0f}", apc,
                             f"{med['bytes_held'] / 1024:.0f}"))
    return Table(f"VLM peers: mlx-vlm APC on / off vs kvlab serve --store {store} ({num_requests} requests, "
                 f"{output_len} tokens out, {', '.join(traffic)} traffic)",
                 f"kvlab bench --only vlm_peers --repeats {repeats}",
                 ("model", "traffic", "server", "TTFT p50 ms", "TTFT p99 ms", "reused tokens (usage)",
                  "APC matched / restored", "KiB held"),
                 tuple(rows),
                 "Each row a fresh server on loopback, one request at a time (the multimodal workload: a shared "
                 "system prompt; mixed traffic sends every second request with one of two images of 56x56 px). "
                 "TTFT is the first content chunk (ms). Reused tokens: usage cached_tokens summed. APC matched "
                 "counts what its lookups matched, restored what it reused: an image request's matched prefix "
                 "that holds image tokens is counted, then dropped (kvlab.serving.apc_audit).",
                 values=values)


def table(s: Settings) -> Table:
    return bench_vlm_peers(s.repeats)
