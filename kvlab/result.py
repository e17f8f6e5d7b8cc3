"""What one request reused, what it cost and why (``Result``), and the one place hit rates are
computed (``hit_rates``): per token (vLLM's definition) and per request (vllm-mlx's), named
(pitfall 10 in the README). The Engine, kvlab's server, the replay and the bench all use them.

Example:
    >>> hit_rates([(100, 60), (50, 0)])
    {'token_hit_rate': 0.4, 'request_hit_rate': 0.5}
"""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field

from .policies.reasons import ALL_REASONS
from .primitives.display import Html, summary_html


def hit_rates(pairs) -> dict:
    """Both hit rates of ``(prompt_tokens, reused_tokens)`` pairs, one pair per request:
    ``token_hit_rate`` = reused / prompt tokens, ``request_hit_rate`` = requests that reused any
    token / requests."""
    pairs = [(int(p), int(r)) for p, r in pairs]
    prompt = sum(p for p, _ in pairs)
    reused = sum(r for _, r in pairs)
    return {"token_hit_rate": reused / prompt if prompt else 0.0,
            "request_hit_rate": sum(r > 0 for _, r in pairs) / len(pairs) if pairs else 0.0}


@dataclass(frozen=True, kw_only=True)
class Result:
    """What one request reused, what it cost, and why; built by keyword. ``miss_reasons``: the
    missed tokens by reason (``kvlab.policies.reasons``); ``diverged_at``: the first token that
    differs from everything cached; ``evicted_by``: the request whose insert evicted what it
    needed."""

    request_id: int
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    match: str
    ttft_s: float
    lookup_s: float
    restore_s: float
    prefill_s: float
    decode_s: float
    output_ids: tuple[int, ...]
    text: str
    store_bytes: int
    evictions: int
    verify_diff: float | None = None
    why: str = ""
    drift_index: int | None = None
    entry_tokens: int = 0
    checkpoints: int = 0
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)
    # missed tokens by reason (kvlab.policies.reasons); empty when unknown (a server's results)
    miss_reasons: dict = field(default_factory=dict, repr=False)
    diverged_at: int | None = None
    evicted_by: int | None = None
    press: str | None = None  # the press's key when the context was compressed (kvlab.compressing)
    press_tokens: int = 0     # tokens of the compressed context

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def row(self) -> dict:
        d = asdict(self)
        d.pop("prompt_ids")
        reasons = d.pop("miss_reasons")
        d.update({r: reasons.get(r) for r in ALL_REASONS})  # one column per reason (null: unknown)
        d["output_ids"] = list(self.output_ids)
        d["reuse_ratio"] = self.reuse_ratio
        return d

    def __repr__(self) -> str:
        v = "" if self.verify_diff is None else f", verify {self.verify_diff:.2e}"
        return (f"Result(#{self.request_id} {self.match}: reused {self.reused_tokens}/{self.prompt_tokens}, "
                f"prefilled {self.prefilled_tokens}, ttft {self.ttft_s * 1e3:.0f} ms{v})")

    def _repr_html_(self) -> str:
        bar = int(300 * self.reuse_ratio)
        missed = ", ".join(f"{k} {n}" for k, n in self.miss_reasons.items() if n)
        diverged = (f"diverged from what is cached at token {self.diverged_at}"
                    if self.diverged_at is not None and self.miss_reasons.get("diverged") else "")
        lines = [self.why, f"missed: {missed}" if missed else "", diverged,
                 f"re-tokenisation drift at token {self.drift_index}" if self.drift_index is not None else ""]
        body = Html(f'<div style="width:300px;height:8px;background:#eee"><div style="width:{bar}px;'
                    f'height:8px;background:#2a7"></div></div>'
                    f"<pre style='white-space:pre-wrap'>{html.escape(self.text[:500])}</pre>")
        return summary_html(
            f"Request #{self.request_id}", Html(f"<code>{html.escape(self.match)}</code>"),
            f"reused {self.reused_tokens}/{self.prompt_tokens} tokens",
            f"TTFT {self.ttft_s * 1e3:.1f} ms (prefill {self.prefill_s * 1e3:.1f} ms)",
            None if self.verify_diff is None else f"verify max|Δlogit| {self.verify_diff:.2e}",
            note=" · ".join(x for x in lines if x), body=body)
