"""The audit's HTTP side: random-letter prompts, a victim's request, an attacker's timed probe, and
the counters a server lets a caller read.

A probe is one streamed chat completion with ``max_tokens=1`` (and ``stream_options.include_usage``,
so servers that can report ``cached_tokens`` do) sent over a kept-alive connection: ``ttfb`` is the
time until the response's status line and headers arrive, ``ttft`` until the first event that
carries the token or the finish reason (a role-only first chunk, which some servers send before
prefill, is not a token). Prompts are Gu et al.'s: letters drawn uniformly from a-z and A-Z,
separated by spaces (about one token each).

Example:
    >>> with Probe("http://127.0.0.1:8080", "victim-key") as victim: ...
    >>> t = attacker.probe(prompt)          # Timed(ttfb_s=..., ttft_s=..., cached=...)
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass

from ..errors import KvlabError
from ..primitives import timing
from ..primitives.display import summary_html

LETTERS = string.ascii_letters
STATS_PATHS = ("/v1/cache/stats", "/kvlab/stats")  # vllm-mlx's and kvlab serve's counters


def letters(rng: random.Random, n: int) -> list[str]:
    """``n`` letters drawn uniformly from a-z, A-Z (Gu et al.'s prompt distribution)."""
    return [rng.choice(LETTERS) for _ in range(n)]


def text(parts: list[str]) -> str:
    return " ".join(parts)


@dataclass(frozen=True)
class Timed:
    """One probe: time to first byte and to first token (seconds), and the cached tokens the
    response reported (None: it reported none)."""

    ttfb_s: float
    ttft_s: float
    cached: int | None

    def __repr__(self) -> str:
        return f"Timed(ttfb {self.ttfb_s * 1e3:.1f} ms, ttft {self.ttft_s * 1e3:.1f} ms, cached {self.cached})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


class Probe:
    """A client of one key at ``url`` (a server, or a kvlab proxy in front of one): ``send`` a
    victim's request, ``probe`` (timed), ``counters`` the server exposes to this key."""

    def __init__(self, url: str, key: str | None, *, model: str | None = None, timeout: float = 120.0):
        import httpx

        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)
        self.model = model or self._model()

    def _model(self) -> str:
        try:
            r = self.http.get(self.url + "/v1/models")
            data = r.json().get("data") if r.status_code == 200 else None
            return str(data[0]["id"]) if data else "default_model"
        except (OSError, ValueError, KeyError, IndexError):
            return "default_model"
        except Exception as e:  # noqa: BLE001  httpx's own errors
            raise KvlabError(f"the server at {self.url} cannot be reached: {e}") from e

    def _body(self, prompt: str, stream: bool) -> dict:
        body = {"model": self.model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def send(self, prompt: str) -> str | None:
        """A victim's request (not timed); its response id."""
        r = self.http.post(self.url + "/v1/chat/completions", json=self._body(prompt, False))
        if r.status_code != 200:
            raise KvlabError(f"the server at {self.url} answered {r.status_code} to a request: {r.text[:300]}")
        return r.json().get("id")

    def probe(self, prompt: str) -> Timed:
        """One timed, streamed request (module docstring)."""
        start = timing.now()
        ttft, cached = None, None
        with self.http.stream("POST", self.url + "/v1/chat/completions", json=self._body(prompt, True)) as r:
            ttfb = timing.now() - start
            if r.status_code != 200:
                raise KvlabError(f"the server at {self.url} answered {r.status_code} to a probe: "
                                 f"{r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                try:
                    data = json.loads(line[5:])
                except ValueError:
                    continue
                if ttft is None and _carries_token(data):
                    ttft = timing.now() - start
                usage = data.get("usage") if isinstance(data, dict) else None
                if isinstance(usage, dict):
                    n = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    cached = n if isinstance(n, int) else cached
        return Timed(ttfb, ttft if ttft is not None else timing.now() - start, cached)

    def counters(self) -> dict[str, float]:
        """The numeric counters this key can read (vllm-mlx's ``/v1/cache/stats``, kvlab serve's
        ``/kvlab/stats``), flattened to ``path.field`` names; {} when the server has none."""
        out = {}
        for path in STATS_PATHS:
            try:
                r = self.http.get(self.url + path)
            except OSError:
                continue
            if r.status_code == 200:
                try:
                    _flatten(path, r.json(), out)
                except ValueError:
                    pass
        return out

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Probe({self.url}, model {self.model!r})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def _carries_token(data) -> bool:
    for choice in (data.get("choices") or []) if isinstance(data, dict) else []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning") or choice.get("finish_reason"):
            return True
    return False


def _flatten(prefix: str, obj, out: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)
