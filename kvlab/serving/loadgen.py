"""``kv.generate_load``: drive any OpenAI-compatible server with concurrent, streamed sessions and
measure TTFT, TPOT, ITL and E2EL per request (definitions in :mod:`kvlab.serving.metrics`).

Arrivals: ``concurrency=N`` keeps N sessions in flight; ``rate=R`` starts sessions as a seeded
Poisson process of R a second (``concurrency`` then caps how many are in flight); a trace starts
each row at its recorded time times ``time_scale``. Every run is bounded: by ``num_requests``,
``duration`` (no request is sent after it) and the finite session list, and each request by
``timeout`` seconds. Reused tokens come from the server's usage
(``prompt_tokens_details.cached_tokens``: mlx-lm's server and kvlab serve report it) and are null
where the server does not say (vllm-mlx: read its counters, ``result.server_delta()``).

Example:
    >>> r = kv.generate_load("http://127.0.0.1:8080", "multi_turn", concurrency=4, num_requests=12)
    >>> r.summary["ttft_ms_p50"], r.frame.height
    (41.2, 12)
"""

from __future__ import annotations

import asyncio
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ..errors import RequestError
from ..primitives import timing
from ..primitives.display import summary_html, table_html
from ..primitives.files import atomic_write_with
from .client import Sender, fetch_events, flatten, model_name, server_stats, warmup_request
from .metrics import frame_of, legend, summarise
from .sessions import CHAT_SESSIONS, Session, sessions_for
from .workload_params import workload_kwargs

DURATION_USERS = 256  # sessions made for a duration-capped run when neither users nor a count is given


# a load run's headline figures, the columns of LoadResult.row()
ROW_FIELDS = ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
              "request_throughput", "output_throughput", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90",
              "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "e2el_ms_p50", "e2el_ms_p99",
              "reused_tokens", "token_hit_rate", "request_hit_rate", "prompt_token_mismatches")


@dataclass(frozen=True, eq=False)
class LoadResult:
    """One load run: ``frame`` has one row a request; ``summary`` the vLLM-style statistics.

    Example:
        >>> r.write("runs/multi_turn.parquet")
        PosixPath('runs/multi_turn.parquet')
    """

    frame: pl.DataFrame
    duration_s: float
    settings: dict
    server_before: dict = field(default_factory=dict)
    server_after: dict = field(default_factory=dict)
    server_events: list = field(default_factory=list)

    @property
    def summary(self) -> dict:
        return {"label": self.settings.get("label"), **summarise(self.frame, self.duration_s)}

    def row(self, **extra) -> dict:
        """The run's headline figures as one results row, ``extra`` columns first (definitions:
        ``kvlab.serving.metrics``). Example: ``rows.append(r.row(server="kvlab serve"))``."""
        s = self.summary
        return {**extra, **{k: s[k] for k in ROW_FIELDS}}

    def summary_frame(self) -> pl.DataFrame:
        """The summary as a one-row frame (concatenate runs with ``pl.concat``)."""
        return pl.DataFrame([self.summary])

    def server_delta(self) -> dict:
        """Numeric counters the server exposes (``/v1/cache/stats``, ``/kvlab/stats``), after minus
        before the run, flattened to ``"path:key.sub"`` names.

        Example:
            >>> r.server_delta()["/v1/cache/stats:engine_cache.tokens_saved"]
            4030
        """
        a, b = flatten(self.server_before), flatten(self.server_after)
        return {k: b[k] - a.get(k, 0) for k in b if not isinstance(b[k], bool)}

    def events(self) -> pl.DataFrame:
        """kvlab serve's events during the run (``/kvlab/events``; empty for other servers)."""
        return pl.DataFrame(self.server_events) if self.server_events else pl.DataFrame()

    def write(self, path) -> Path:
        """The frame as parquet, written atomically (a temporary file, then ``os.replace``)."""
        return atomic_write_with(path, self.frame.write_parquet)

    def __repr__(self) -> str:
        s = self.summary
        p50 = f"{s['ttft_ms_p50']:.1f} ms" if s["ttft_ms_p50"] is not None else "n/a"
        return (f"LoadResult({self.settings.get('label')!r}: {s['completed']}/{self.frame.height} ok, "
                f"{s['request_throughput']:.2f} req/s, TTFT p50 {p50})")

    def _repr_html_(self) -> str:
        s = self.summary
        keys = ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p50", "e2el_ms_p50",
                "token_hit_rate", "request_hit_rate")
        table = table_html(None, [(k, _fmt(s[k])) for k in keys], row_headers=True,
                           caption=" · ".join(legend(keys)))  # what each figure means
        return summary_html(repr(self), body=table)


def generate_load(url: str, workload="multi_turn", **kw) -> LoadResult:
    """Run a load test against ``url`` (blocking; from a running event loop it runs in a thread).
    Keywords as :func:`generate_load_async`.

    Example:
        >>> r = kv.generate_load(server.url, "prefix_repetition", tokenizer=m, concurrency=4,
        ...                  num_requests=20, prefix_len=512, suffix_len=128, output_len=16)
        >>> r.summary["token_hit_rate"] > 0.5
        True
    """
    coro = generate_load_async(url, workload, **kw)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:  # inside Jupyter's loop: run ours on another thread
        return pool.submit(asyncio.run, coro).result()


async def generate_load_async(url: str, workload="multi_turn", *, concurrency: int | None = None,
                          rate: float | None = None, num_requests: int | None = None,
                          duration: float | None = None, users: int | None = None,
                          tokenizer=None, model: str | None = None, api_key: str | None = None,
                          timeout: float = 120.0, temperature: float = 0.0, seed: int = 0,
                          time_scale: float | None = None, block_tokens: int | None = None,
                          max_prompt_tokens: int | None = None, record_tokens: bool = False,
                          extra_body: dict | None = None, warmup: bool = True, keep_text: bool = False,
                          progress: bool = True,
                          label: str | None = None, out=None, **params) -> LoadResult:
    """The load run as a coroutine. ``workload`` is a name (multi_turn, agentic_loop,
    shared_system_prompt, prefix_repetition, fixed, multimodal: text and image requests, the images
    sent as base64 PNG data URLs), a ``kv.Workload``, a trace or a trace file;
    ``params`` go to its generator, and one that does not apply to it is refused (the table in
    :mod:`kvlab.serving.workload_params`; ``output_len`` sets every request's ``max_tokens``;
    ``time_scale`` (default 1), ``block_tokens`` and ``max_prompt_tokens`` are for traces). ``record_tokens`` sends non-streamed requests with
    ``logprobs`` so each row has its output ids and top-2 logprob gaps (no TTFT then).
    ``warmup`` first sends one untimed two-character request (a server's first request pays for
    lazy loading and compilation; vLLM's bench warms up the same way). ``keep_text`` keeps each
    reply's text (column ``reply``). ``out`` writes the frame as parquet.

    Example:
        >>> r = await generate_load_async(url, "shared_system_prompt", rate=2.0, duration=10)
    """
    base = _base_url(url)
    if isinstance(tokenizer, (str, os.PathLike)):
        from ..models.loading import load

        tokenizer = load(os.fspath(tokenizer))
    sessions, cap = _plan(workload, concurrency, rate, num_requests, duration, users, timeout,
                          tokenizer=tokenizer, seed=seed,
                          params=dict(params, time_scale=time_scale, block_tokens=block_tokens,
                                      max_prompt_tokens=max_prompt_tokens))
    name = workload if isinstance(workload, str) else getattr(workload, "name", "trace")
    label = label or (f"{Path(name).stem}@c{concurrency}" if concurrency and not rate
                      else f"{Path(name).stem}@r{rate}" if rate else Path(name).stem)
    settings = dict(url=base, workload=str(name), concurrency=concurrency, rate=rate,
                    num_requests=num_requests, duration=duration, users=len(sessions),
                    timeout=timeout, temperature=temperature, seed=seed, time_scale=time_scale,
                    record_tokens=record_tokens, label=label)
    import httpx
    import openai
    from tqdm.auto import tqdm

    key = api_key or os.environ.get("KVLAB_API_KEY") or os.environ.get("OPENAI_API_KEY") or "kvlab"
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=timeout, http_client=http)
        model = model or await model_name(http, base)
        settings["model"] = model
        if warmup:
            await warmup_request(client, model, sessions[0].turns[0].endpoint, base)
        before = await server_stats(http, base)
        send = Sender(client, model, temperature, timeout, record_tokens, extra_body, tokenizer)
        rows: list[dict] = []
        bar = tqdm(total=cap, desc=f"kvlab loadgen {label}", unit="req", disable=not progress)
        t0 = timing.now()
        budget = _Budget(cap, duration, t0)
        sem = asyncio.Semaphore(concurrency) if concurrency else None

        async def run_session(s: Session, at: float | None = None) -> None:
            replies: list[str] = []
            for k, turn in enumerate(s.turns):
                idx = budget.take()
                if idx is None:
                    return
                row, reply = await send(turn, replies, t0)
                row.update(request=idx, session=s.index, turn=k, scheduled_s=at if k == 0 else None,
                           reply=reply if keep_text else None)
                rows.append(row)
                bar.update(1)
                if not row["ok"]:
                    return
                replies.append(reply)

        async def limited(s: Session, at: float | None) -> None:
            if at is not None:
                await asyncio.sleep(max(0.0, t0 + at - timing.now()))
            if sem is None:
                return await run_session(s, at)
            async with sem:
                await run_session(s, at)

        try:
            if rate is None and all(s.at_s is None for s in sessions):
                queue = iter(sessions)

                async def worker() -> None:
                    for s in queue:
                        await run_session(s)
                await asyncio.gather(*(worker() for _ in range(concurrency)))
            else:
                starts = _arrivals(sessions, rate, seed)
                await asyncio.gather(*(limited(s, at) for s, at in zip(sessions, starts)))
        finally:
            bar.close()
        wall = timing.now() - t0
        after = await server_stats(http, base)
        events = await fetch_events(http, base, before)
    frame = frame_of(sorted(rows, key=lambda r: r["request"])).with_columns(pl.lit(label).alias("label"))
    result = LoadResult(frame, wall, settings, before, after, events)
    if out is not None:
        result.write(out)
    return result


def _plan(workload, concurrency, rate, num_requests, duration, users, timeout, *, tokenizer, seed,
          params: dict):
    for name, v in (("concurrency", concurrency), ("num_requests", num_requests), ("users", users)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise RequestError(f"{name} must be a positive int, got {v!r}")
    for name, v in (("rate", rate), ("duration", duration), ("timeout", timeout)):
        if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
            raise RequestError(f"{name} must be a positive number of {'requests/s' if name == 'rate' else 's'}, "
                               f"got {v!r}")
    kw = dict(workload_kwargs(workload, params), tokenizer=tokenizer, seed=seed)
    kw.setdefault("time_scale", 1.0)  # trace replay's default; refused for other workloads when given
    is_trace = not isinstance(workload, str) or str(workload).endswith((".jsonl", ".json"))
    if concurrency is None and rate is None and not (is_trace and not hasattr(workload, "requests")):
        raise RequestError("pass concurrency=N (sessions in flight) or rate=R (Poisson arrivals a "
                           "second); trace replay needs neither")
    if users is None and not is_trace:
        turns = kw.get("turns", 3 if workload == "multi_turn" else 4)
        per = turns if workload in CHAT_SESSIONS else 1
        users = (math.ceil(num_requests / per) if num_requests else
                 DURATION_USERS if duration else max(8, concurrency or 1))
    sessions = sessions_for(workload, users=users or 1, **kw)
    total = sum(len(s.turns) for s in sessions)
    if not total:
        raise RequestError("the workload has no requests to send")
    return sessions, min(total, num_requests or total)


def _arrivals(sessions, rate, seed) -> list[float | None]:
    if rate is None:
        return [s.at_s for s in sessions]
    gaps = np.random.default_rng([seed, 7]).exponential(1.0 / rate, size=len(sessions))
    return list(np.cumsum(gaps) - gaps[0])  # the first session starts at once


class _Budget:
    """Hands out request numbers until the count cap or the duration is reached."""

    def __init__(self, cap: int, duration: float | None, t0: float):
        self.cap, self.duration, self.t0, self.sent = cap, duration, t0, 0

    def take(self) -> int | None:
        late = self.duration is not None and timing.now() - self.t0 >= self.duration
        if self.sent >= self.cap or late:
            return None
        self.sent += 1
        return self.sent - 1


def _base_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise RequestError(f"url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def load_test(url: str, workload="multi_turn", **kw) -> LoadResult:
    """Deprecated name of :func:`generate_load` (``load`` is for models); removed in the next release."""
    warnings.warn("kv.load_test is deprecated: use kv.generate_load", FutureWarning, stacklevel=2)
    return generate_load(url, workload, **kw)
