"""One workload through a real router and through the cluster simulator, side by side: the same
routing decisions, the same reused tokens per request, and TTFT modelled after calibration.

``run_through(url, prompts)`` sends each prompt to a fresh ``kvlab route`` (streamed ``/v1/completions``)
one at a time: send, read the whole response, wait (``settle(upstream, i)``, e.g. for an
in-process server's final insert, then ``GET /kvlab/route?sync=1``: the router's view holds every
event published so far), send the next. TTFT is the client's: send -> first text chunk.

``beside(real, ids, ...)`` replays the same token ids as a trace through ``kv.simulate(...,
instances=N)`` with the arrivals ``gap_s`` apart (nothing queues, as nothing did for real), with a
ServiceModel calibrated (Theil-Sen, robust to requests a busy machine slowed) on the even-numbered
real requests, and reports on the odd ones how far
the modelled TTFT is from the measured one (median of |modelled - measured| / measured); each
instance's first request, which pays for its warm-up, is left out of both.

Example:
    >>> real = run_through(router.url, texts, model="tiny")
    >>> frame, summary = beside(real, [m.tokenizer.encode(t) for t in texts], "llmd_weighted", "precise",
    ...                         instances=2, capacity_tokens=4096)
    >>> summary["decisions_equal"], summary["reused_equal"]
    (True, True)
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import polars as pl

from ..errors import KvlabError
from ..primitives import timing
from ..proxying.usage import Watch
from .service import ServiceModel

HEADER = "x-kvlab-upstream"


def run_through(url: str, prompts, *, model: str = "tiny", max_tokens: int = 1, settle=None,
                timeout: float = 120.0) -> pl.DataFrame:
    """One row a prompt: its ``instance`` and ``upstream``, ``prompt_tokens`` and ``reused_tokens``
    (the server's usage) and ``ttft_s`` (module docstring)."""
    import httpx

    rows = []
    with httpx.Client(timeout=timeout) as http:
        for i, text in enumerate(prompts):
            watch, first = Watch(), None
            body = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = timing.now()
            with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise KvlabError(f"request {i} through {url} answered {r.status_code}: {r.read()[:300]!r}")
                upstream = r.headers.get(HEADER)
                for chunk in r.iter_raw():
                    if watch.feed(chunk) and first is None:
                        first = timing.now()
            if settle is not None:
                settle(upstream, i)
            route = _get(f"{url}/kvlab/route?sync=1&since={i}")
            rows.append({"request": i, "instance": route["rows"][0]["instance"], "upstream": upstream,
                         "prompt_tokens": watch.prompt_tokens, "reused_tokens": watch.cached_tokens,
                         "ttft_s": None if first is None else first - t0, "view_behind": not route["caught_up"]})
    return pl.DataFrame(rows)


def beside(real: pl.DataFrame, ids, router: str, view: str = "precise", *, instances: int,
           capacity_tokens=None, block_size: int = 16, gap_s: float = 1000.0, decode_s: float = 0.0):
    """(one frame with the real and simulated columns per request, a summary dict) for ``real``
    (run_through's frame) and the token ids it sent (module docstring)."""
    from ..experiments import traces
    from .simulate import simulate_cluster

    n = real.height
    if len(ids) != n or [len(x) for x in ids] != real["prompt_tokens"].to_list():
        raise KvlabError("the token ids do not match what the server counted per request; tokenize the prompts "
                         "with the servers' own tokenizer")
    # each instance's first request pays for its warm-up (compilation, first allocations): neither
    # fitted nor checked; then the even-numbered requests fit the model and the odd ones check it
    first = pl.col("request") == pl.col("request").min().over("instance")
    role = (pl.when(first).then(pl.lit("first on its instance")).when(pl.col("request") % 2 == 0)
            .then(pl.lit("calibration")).otherwise(pl.lit("held out")))
    real = real.with_columns(role=role)
    fitted = real.filter(pl.col("role") == "calibration")
    if fitted.height < 2 or real.filter(pl.col("role") == "held out").height < 1:
        raise KvlabError(f"{n} requests are too few to calibrate on half and check on the rest; send at least 6")
    service = ServiceModel.calibrate(fitted["prompt_tokens"], fitted["reused_tokens"], fitted["ttft_s"], decode_s,
                                     source=f"calibrated on {fitted.height} requests of a real run", robust=True)
    trace = traces.from_requests([list(x) for x in ids], 1, block_size, timestamps=[int(gap_s * 1000) * i for i in range(n)])
    sim = simulate_cluster(trace, instances, router, view, capacity_tokens, service=service).requests
    frame = real.with_columns(sim_instance=sim["instance"], sim_reused_tokens=sim["hit_tokens"],
                              sim_view_match_tokens=sim["view_match_tokens"], modelled_ttft_s=sim["ttft_s"])
    held = frame.filter(pl.col("role") == "held out")
    err = (held["modelled_ttft_s"] - held["ttft_s"]).abs() / held["ttft_s"]
    summary = {"requests": n, "decisions_equal": frame["instance"].to_list() == frame["sim_instance"].to_list(),
               "reused_equal": frame["reused_tokens"].to_list() == frame["sim_reused_tokens"].to_list(),
               "service": service, "calibrated": fitted.height, "held_out": held.height,
               "ttft_median_s": float(np.median(held["ttft_s"])),
               "modelled_ttft_median_s": float(np.median(held["modelled_ttft_s"])),
               "ttft_median_abs_rel_error": float(np.median(err))}
    return frame, summary


def prefix_texts(tokenizer, groups: int = 3, per_group: int = 8, *, base_words: int = 120, step_words: int = 30,
                 block_size: int = 16, seed: int = 0) -> list[str]:
    """``groups`` conversations-like prefix groups, interleaved: request j of group g is g's base text
    and the first ``j * step_words`` words of g's continuation, so each extends the one before. No
    prompt is ``k * block_size - 1`` tokens long: a server also caches the one token it generates
    (max_tokens=1), which would complete one more block than the simulator, which caches prompts.

    Example:
        >>> texts = prefix_texts(kv.load("tiny").tokenizer, groups=2, per_group=3)
        >>> len(texts), texts[2].startswith(texts[0])
        (6, True)
    """
    rng = np.random.default_rng(seed)
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
             "upsilon phi chi psi omega").split()
    enc = getattr(tokenizer, "tokenizer", tokenizer).encode
    bases = [" ".join(rng.choice(words, base_words)) for _ in range(groups)]
    tails = [list(rng.choice(words, step_words * per_group)) for _ in range(groups)]
    texts = []
    for j in range(per_group):
        for g in range(groups):
            t = " ".join([bases[g], *tails[g][:j * step_words]])
            while len(enc(t)) % block_size == block_size - 1:
                t += " ."
            texts.append(t)
    return texts


def wait_stored(upstream: str, n: int, timeout: float = 60.0) -> None:
    """Wait until the kvlab serve at ``upstream`` has stored the prompt + output of its ``n``-th
    request (its ``/kvlab/events`` offer rows: mlx-lm makes that insert just after the response)."""
    import time

    deadline = timing.deadline(timeout)
    while True:
        rows = _get(f"{upstream}/kvlab/events")["events"]
        if sum(e["event"] == "offer" and e["segment"] == "assistant" for e in rows) >= n:
            return
        if deadline.expired():
            raise KvlabError(f"{upstream} has not stored request {n}'s prompt + output within {timeout} s")
        time.sleep(0.02)


def settler(timeout: float = 60.0):
    """A ``settle(upstream, i)`` for :func:`run_through` that counts what each instance answered
    and waits for its store to hold it (:func:`wait_stored`)."""
    answered: dict[str, int] = {}

    def settle(upstream: str, i: int = 0) -> None:
        answered[upstream] = answered.get(upstream, 0) + 1
        wait_stored(upstream, answered[upstream], timeout)

    return settle


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())
