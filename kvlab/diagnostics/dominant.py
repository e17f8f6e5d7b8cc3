"""dominant_miss(): when most of a run's missed tokens diverge at the same place, where (token
index, message, role), what differs there (the volatile field and its values) and which
normalisation rule fixes it (``--normalise`` / ``kv.normalise``). Pure: it reads the requests'
miss records (``Result.miss_reasons``, ``diverged_at``, ``prompt_ids``) and their rendered prompts.

A request that diverged is compared with the earlier prompt it shares the longest prefix with (what
it diverged from); its divergence is placed in the volatile field that covers the token where they
part. Divergences in the same message and field form one place; the place is dominant when its
diverged tokens are more than half of every missed token of the run.

Example:
    >>> d = dominant_miss(engine.results, tokenizer=model.tokenizer)   # after agentic_loop
    >>> d.token_index, d.field, d.rule
    (34, 'cch', 'billing_header')
    >>> print(d.sentence())
    2,192 of 3,079 missed tokens (71.2%) diverge at token 34 in message 0 (system), so each reused at most 32: ...
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..primitives.display import Html, summary_html, table_html
from ..primitives.divergence import clipped
from ..primitives.normalisation import DEFAULT_RULES, normalise_text
from ..primitives.tokens import Tokens, common_prefix_len, from_ids
from ..primitives.volatile import volatile_fields

# what turns a rule on, per surface (kvlab's own names for the same fix)
FIXES = {"magic": "%kvlab run ... --normalise", "cli": "kvlab workload ... --normalise",
         "api": "kv.normalise(messages) before engine.run", "server": "kvlab serve --normalise"}
SHARE = 0.5  # a place is dominant above this share of the run's missed tokens


@dataclass(frozen=True)
class DominantMiss:
    """The place most missed tokens diverge at. ``token_index``: the first token that differs
    (the smallest over the requests that diverge there); ``field``: the volatile field's name
    (``cch``) or None; ``previous``/``current``: its text in the prompt diverged from and in the
    diverging one (first such request); ``rule``: the normalisation rule whose rewrite makes the
    two messages equal (None: no rule does); ``requests``: the ids of the requests that diverge
    here; ``tokens``: their diverged tokens; ``missed``: every missed token of the run;
    ``reused``: the most any of them reused (a block store stops at the last full block before
    ``token_index``)."""

    token_index: int
    message_index: int | None
    role: str | None
    field: str | None
    previous: str
    current: str
    rule: str | None
    requests: tuple[int, ...]
    tokens: int
    missed: int
    reused: int = 0

    @property
    def share(self) -> float:
        return self.tokens / self.missed if self.missed else 0.0

    @property
    def fix(self) -> str:
        """What to do, in the magic's, the API's and the server's words."""
        return self.fix_for("magic")

    def fix_for(self, surface: str = "magic") -> str:
        """The fix in one surface's words (a key of ``FIXES``), then the API's and the server's."""
        if self.rule is None:
            return ("no kvlab rule covers it: add a kv.Rule for this field to kv.normalise's rules, "
                    "or make the client send it at the end of the prompt")
        also = "; ".join(f"{k}: {FIXES[k]}" for k in ("api", "server") if k != surface)
        return f"rule {self.rule}: {FIXES[surface]} ({also})"

    def where(self) -> str:
        msg = "" if self.message_index is None else f" in message {self.message_index} ({self.role})"
        return f"token {self.token_index}{msg}"

    def what(self) -> str:
        name = f"the volatile field {self.field}=" if self.field else "the text"
        return f"{name} changes per request ({clipped(self.previous, 24)} -> {clipped(self.current, 24)})"

    def sentence(self, surface: str = "magic") -> str:
        """The one-line cause and fix, as every surface prints it (the fix in ``surface``'s words)."""
        return (f"{self.tokens:,} of {self.missed:,} missed tokens ({self.share:.1%}) diverge at "
                f"{self.where()}, so each reused at most {self.reused:,}: {self.what()}. Fix: {self.fix_for(surface)}.")

    def __repr__(self) -> str:
        return (f"DominantMiss({self.where()}, field {self.field}, rule {self.rule}: "
                f"{self.tokens}/{self.missed} missed tokens, {len(self.requests)} requests)")

    def _repr_html_(self) -> str:
        rows = [("where", self.where()), ("what", self.what()), ("fix", self.fix),
                ("requests", ", ".join(f"#{r}" for r in self.requests))]
        return summary_html("Dominant miss", f"{self.tokens:,} of {self.missed:,} missed tokens",
                            f"{self.share:.1%}", note=self.sentence(),
                            body=table_html(None, [(k, Html(f"<code>{html.escape(v)}</code>"))
                                                   for k, v in rows], row_headers=True))


def _tokens(result, prompt, tokenizer) -> Tokens:
    if isinstance(prompt, Tokens):
        return prompt
    return from_ids(result.prompt_ids, tokenizer, chatml_spans=True)


def _origin(results, i: int):
    """The earlier result whose prompt shares the longest prefix with result ``i``'s."""
    ids = results[i].prompt_ids
    best, n = None, -1
    for j in range(i):
        c = common_prefix_len(results[j].prompt_ids, ids)
        if c > n:
            best, n = j, c
    return best


def _segment(toks: Tokens, index: int | None) -> tuple[str | None, str]:
    for s in toks.spans:
        if s.index == index:
            return s.role, toks.text[s.char_start:s.char_end]
    return None, toks.text


def _place(prev: Tokens, cur: Tokens, at: int):
    """(message index, role, field name, previous text, current text, rule) where ``cur`` parts
    from ``prev`` at token ``at``."""
    span = cur.span_at(at) if cur.spans else None
    index = span.index if span is not None else None
    role = span.role if span is not None else None
    field = None
    # compare the two rendered prompts' fields; the one covering (or first after) the divergence
    fields = [f for f in volatile_fields([prev, cur]) if f.token_start is not None]
    covering = [f for f in fields if f.token_start <= at < max(f.token_end, f.token_start + 1)]
    after = [f for f in fields if f.token_start >= at and f.message_index == index]
    f = (covering or after or [None])[0]
    if f is not None:
        field, before, now = f.name, f.values[0] or "", f.values[1] or ""
    else:
        before, now = prev.text[prev.offsets[at][0]:][:24] if at < len(prev.offsets) else "", \
            cur.text[cur.offsets[at][0]:][:24] if at < len(cur.offsets) else ""
    rule = None
    _, a = _segment(prev, index)
    _, b = _segment(cur, index)
    for r in DEFAULT_RULES:
        if a != b and normalise_text(a, [r], role) == normalise_text(b, [r], role):
            rule = r.name
            break
    return index, role, field, before, now, rule


def dominant_miss(results, prompts=None, *, tokenizer=None) -> DominantMiss | None:
    """The place where more than half of the run's missed tokens diverge, or None.

    ``results``: the run's ``Result``s in order (``engine.results``); ``prompts``: their rendered
    ``Tokens`` (``engine.tokens_of(request)[0]``), else rebuilt from the ids with ``tokenizer``
    (ChatML message spans recovered from the ids)."""
    results = list(results)
    prompts = list(prompts) if prompts is not None else [None] * len(results)
    missed = sum(r.prompt_tokens - r.reused_tokens for r in results)
    groups: dict = {}
    memo: dict = {}

    def toks(k):
        if k not in memo:
            memo[k] = _tokens(results[k], prompts[k], tokenizer)
        return memo[k]

    for i, r in enumerate(results):
        n = (r.miss_reasons or {}).get("diverged", 0)
        if not n or r.diverged_at is None:
            continue
        j = _origin(results, i)
        if j is None:
            continue
        at = common_prefix_len(results[j].prompt_ids, r.prompt_ids)
        place = _place(toks(j), toks(i), at)
        key = place[:3] if place[2] is not None else (*place[:2], at)
        g = groups.setdefault(key, {"place": place, "at": at, "requests": [], "tokens": 0})
        g["at"] = min(g["at"], at)
        g["requests"].append(r.request_id)
        g["tokens"] += n
        g["reused"] = max(g.get("reused", 0), r.reused_tokens)
    if not groups or not missed:
        return None
    g = max(groups.values(), key=lambda g: g["tokens"])
    if g["tokens"] <= SHARE * missed:
        return None
    index, role, field, before, now, rule = g["place"]
    return DominantMiss(token_index=g["at"], message_index=index, role=role, field=field, previous=before,
                        current=now, rule=rule, requests=tuple(g["requests"]), tokens=g["tokens"],
                        missed=missed, reused=g["reused"])


def request_why(result) -> str:
    """A request's main miss reason and, when it diverged, the token: ``"diverged 1008 at token 34"``."""
    reasons = {k: v for k, v in (result.miss_reasons or {}).items() if v}
    if not reasons:
        return result.why or ""
    main = max(reasons, key=reasons.get)
    at = f" at token {result.diverged_at}" if main == "diverged" and result.diverged_at is not None else ""
    text = f"{main} {reasons[main]}{at}"
    return f"{text}; {result.why}" if result.why else text


__all__ = ["DominantMiss", "FIXES", "SHARE", "dominant_miss", "request_why"]
