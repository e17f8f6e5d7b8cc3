"""One request of a load run: send a turn through the official ``openai`` SDK, streamed, and time
its token chunks; or, when recording tokens, non-streamed with ``logprobs`` so the output ids and
each step's top-2 logprob gap come back (mlx-lm's server returns them; TTFT is then unknown).
Also the run's other HTTP calls: the model name, the warm-up request, and the counters a server
exposes (vllm-mlx's ``/v1/cache/stats``, kvlab serve's ``/kvlab/stats`` and ``/kvlab/events``).

Example:
    >>> send = Sender(openai.AsyncOpenAI(base_url=url + "/v1", api_key="x"), "default_model")
    >>> row, reply = await send(turn, [], timing.now())
"""

from __future__ import annotations

import asyncio
import json

from ..errors import KvlabError
from ..primitives import timing
from .metrics import request_metrics
from .sessions import Turn
from ..primitives.display import summary_html

STATS_PATHS = ("/v1/cache/stats", "/kvlab/stats")  # vllm-mlx's and kvlab serve's counters


class Sender:
    """Sends one turn (streamed, or with logprobs when recording tokens) and times it; returns
    the request's row (see :data:`kvlab.serving.metrics.SCHEMA`) and the reply text."""

    def __init__(self, client, model: str, temperature: float = 0.0, timeout: float = 120.0,
                 record_tokens: bool = False, extra_body: dict | None = None, tokenizer=None):
        self.client, self.model, self.temperature = client, model, temperature
        self.timeout, self.record_tokens = timeout, record_tokens
        self.extra_body, self.tokenizer = dict(extra_body or {}), tokenizer

    def __repr__(self) -> str:
        mode = "logprobs" if self.record_tokens else "streamed"
        return f"Sender({self.model!r}, {mode}, timeout={self.timeout:g}s)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    async def __call__(self, turn: Turn, replies: list[str], t0: float) -> tuple[dict, str]:
        import openai

        row = {"name": turn.name, "endpoint": turn.endpoint, "ok": False,
               "prompt_tokens_expected": len(turn.ids) if turn.ids is not None else None}
        t_send = timing.now()
        row["start_s"] = t_send - t0
        try:
            body = await asyncio.wait_for(self._send(turn, replies, t_send), self.timeout)
        except asyncio.TimeoutError:
            row["error"] = f"timeout after {self.timeout}s"
            return row, ""
        except openai.APIStatusError as e:
            row["error"] = f"HTTP {e.status_code}: {str(e.message)[:300]}"
            return row, ""
        except (openai.APIError, OSError) as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return row, ""
        text, usage = body.pop("text"), body.pop("usage") or {}
        row.update(body)
        row["prompt_tokens"] = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        row["reused_tokens"], row["reused_source"] = (cached, "usage") if cached is not None else (None, None)
        if row.get("output_tokens") is None:
            row["output_tokens"] = usage.get("completion_tokens")
        row["output_tokens_source"] = "usage" if row["output_tokens"] is not None else None
        if row["output_tokens"] is None and self.tokenizer is not None:  # vLLM's fallback
            from ..primitives.tokens import hf_tokenizer

            row["output_tokens"] = len(hf_tokenizer(self.tokenizer).encode(text, add_special_tokens=False))
            row["output_tokens_source"] = "tokenizer"
        if row["output_tokens"] is None and "times" in body:  # last resort: one token a content chunk
            row["output_tokens"], row["output_tokens_source"] = len(body["times"]), "chunks"
        row.update(request_metrics(t_send, body.pop("times"), row["output_tokens"]) if "times" in body
                   else {})
        row["reply_chars"] = len(text)
        row["ok"] = True
        return row, text

    def _args(self, turn: Turn, replies: list[str]) -> tuple:
        kw = {"model": self.model, "max_tokens": turn.max_tokens, "temperature": self.temperature}
        extra = dict(self.extra_body)
        if turn.endpoint == "chat":
            kw["messages"] = turn.with_replies(replies)
            if turn.tools:
                kw["tools"] = list(turn.tools)
            api = self.client.chat.completions
            if self.record_tokens:
                kw.update(logprobs=True, top_logprobs=2)
        else:
            kw["prompt"] = turn.prompt
            api = self.client.completions
            if self.record_tokens:  # mlx-lm's server wants a bool here, not the legacy int
                extra.update(logprobs=True, top_logprobs=2)
        if extra:
            kw["extra_body"] = extra
        return api, kw

    async def _send(self, turn: Turn, replies: list[str], t_send: float) -> dict:
        api, kw = self._args(turn, replies)
        if self.record_tokens:
            raw = await api.with_raw_response.create(stream=False, **kw)
            data = json.loads(raw.text)
            choice = (data.get("choices") or [{}])[0]
            ids, gaps = _logprob_ids(choice.get("logprobs"))
            text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
            e2el = (timing.now() - t_send) * 1e3
            return {"text": text, "usage": data.get("usage"), "output_ids": ids, "top2_gap": gaps,
                    "finish_reason": choice.get("finish_reason"), "e2el_ms": e2el,
                    "output_tokens": (data.get("usage") or {}).get("completion_tokens")}
        stream = await api.create(stream=True, stream_options={"include_usage": True}, **kw)
        return await read_stream(stream, turn.endpoint)


async def read_stream(stream, endpoint: str) -> dict:
    """Text, usage, finish reason and the arrival time of every *content chunk* of a streamed
    reply (openai SDK chunk objects, async-iterated). A content chunk carries text, a reasoning
    delta or a tool-call delta; the closing chunk with only ``finish_reason`` (mlx-lm's server
    sends one after the last token) and the usage-only chunk are not tokens.

    Example:
        >>> out = await read_stream(await client.chat.completions.create(..., stream=True), "chat")
        >>> len(out["times"])  # content chunks: 32 for 32 one-token chunks, not 33
        32
    """
    times, parts, usage, finish = [], [], None, None
    async for chunk in stream:
        now = timing.now()
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if endpoint == "chat":
            d = c.delta
            piece = (d.content or "") if d is not None else ""
            extra = (d.model_extra or {}) if d is not None else {}
            other = (extra.get("reasoning") or extra.get("reasoning_content")
                     or (d.tool_calls if d is not None else None))
        else:
            piece, other = c.text or "", None
        if piece or other:
            times.append(now)
        parts.append(piece)
        finish = c.finish_reason or finish
    return {"text": "".join(parts), "usage": usage, "times": times, "finish_reason": finish}


def _logprob_ids(logprobs) -> tuple[list[int] | None, list[float] | None]:
    """Output ids and top-2 logprob gaps from mlx-lm's ``logprobs.content`` entries."""
    content = (logprobs or {}).get("content") or []
    if not content or any("id" not in c for c in content):
        return None, None
    gaps = []
    for c in content:
        top = sorted((t["logprob"] for t in c.get("top_logprobs") or []), reverse=True)
        gaps.append(top[0] - top[1] if len(top) >= 2 else None)
    return [int(c["id"]) for c in content], gaps



async def model_name(http, base: str) -> str:
    """The first model ``/v1/models`` lists; a KvlabError when it answers with none (pass
    ``model=``; mlx-lm's ``default_model`` only when the listing itself times out)."""
    import httpx

    try:
        r = await http.get(f"{base}/v1/models")
    except httpx.ConnectError as e:
        raise KvlabError(f"cannot connect to {base}: is the server running? ({e})") from e
    except httpx.HTTPError:  # a slow listing (a tiny timeout): mlx-lm's name for its one model
        return "default_model"
    try:
        data = r.json().get("data") if r.status_code == 200 else None
    except (ValueError, AttributeError):
        data = None
    if not data or not isinstance(data, list) or not isinstance(data[0], dict) or "id" not in data[0]:
        raise KvlabError(f"{base}/v1/models listed no model (HTTP {r.status_code}, {len(r.content)} "
                         "bytes); pass the model name the server answers to (--model / model=)")
    return str(data[0]["id"])


async def warmup_request(client, model: str, endpoint: str, base: str) -> None:
    """One untimed two-character request; a KvlabError saying what to check when it fails."""
    import openai

    try:
        if endpoint == "chat":
            await client.chat.completions.create(model=model, max_tokens=1, temperature=0.0,
                                                 messages=[{"role": "user", "content": "Hi"}])
        else:
            await client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0.0)
    except openai.APIError as e:
        body = getattr(getattr(e, "response", None), "text", "") or ""
        raise KvlabError(f"the warm-up request to {base} failed ({type(e).__name__}: {e} {body[:200]}); "
                         "check the URL, the API key and the server's log, or pass warmup=False") from e


async def server_stats(http, base: str) -> dict:
    """The counters the server exposes at :data:`STATS_PATHS` (JSON), by path."""
    out = {}
    for path in STATS_PATHS:
        try:
            r = await http.get(f"{base}{path}")
        except Exception:  # the route is optional: any transport error means "not exposed"
            continue
        if r.status_code == 200:
            try:
                out[path] = r.json()
            except ValueError:
                continue
    return out


async def fetch_events(http, base: str, before: dict) -> list:
    """kvlab serve's events since the run began (its stats count them)."""
    since = (before.get("/kvlab/stats") or {}).get("events")
    if since is None:
        return []
    r = await http.get(f"{base}/kvlab/events", params={"since": int(since)})
    return r.json().get("events", []) if r.status_code == 200 else []


def flatten(stats: dict) -> dict:
    """Numeric leaves of ``{path: json}`` as ``{"path:key.sub": value}``."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix[-1] != ":" else f"{prefix}{k}", x)
        elif isinstance(v, (int, float)):
            out[prefix] = v
    for path, v in stats.items():
        walk(f"{path}:", v)
    return out
