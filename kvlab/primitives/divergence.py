"""diverge(): the first token where two prompts stop sharing a prefix, and the message it falls in
(see also kvlab.primitives.volatile for the fields that change per request, kvlab.primitives.normalisation for the fix).

Example:
    >>> req_a, req_b = ([{"role": "system", "content": kv.workloads.BILLING_HEADER.format(cch=c)
    ...                   + "\\nBe brief."}, {"role": "user", "content": "Hi"}]
    ...                 for c in ("eb6c6", "1f2a9"))
    >>> d = kv.diverge(kv.tokenise(m, req_a), kv.tokenise(m, req_b))
    >>> d.token_index, d.role         # the seed-002 billing header's cch= value
    (35, 'system')
    >>> kv.diverge(kv.tokenise(m, kv.normalise(req_a)), kv.tokenise(m, kv.normalise(req_b))).identical
    True
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from .display import Html, summary_html, table_html
from .tokens import as_tokens, common_prefix_len


# ---------------------------------------------------------------------------------------- diverge

@dataclass(frozen=True)
class Divergence:
    """Where two prompts' token ids first differ; ``token_index`` is None when one is a prefix of
    the other (or they are equal). ``char_a``/``char_b`` are where that token starts in each text."""

    token_index: int | None
    common: int
    len_a: int
    len_b: int
    message_index: int | None = None
    role: str | None = None
    char_a: int | None = None
    char_b: int | None = None
    before: tuple[str, ...] = ()   # shared pieces just before the split
    token_a: str = ""              # the first differing token's text ('' past the end)
    token_b: str = ""
    after_a: tuple[str, ...] = ()  # pieces after it
    after_b: tuple[str, ...] = ()
    has_messages: bool = field(default=False, compare=False)  # False for raw ids and plain text

    @property
    def identical(self) -> bool:
        return self.token_index is None and self.len_a == self.len_b

    @property
    def is_prefix(self) -> bool:
        """One prompt is a strict prefix of the other: a cache can reuse all of the shorter one."""
        return self.token_index is None and self.len_a != self.len_b

    @property
    def context_a(self) -> str:
        return "".join(self.before) + self.token_a + "".join(self.after_a)

    @property
    def context_b(self) -> str:
        return "".join(self.before) + self.token_b + "".join(self.after_b)

    def reusable_blocks(self, block_size: int = 16) -> int:
        """Full blocks of the common prefix: what a block-hashing prefix cache can reuse."""
        return self.common // block_size

    def _where(self) -> str:
        if not self.has_messages:
            return ""
        if self.message_index is None:
            return " outside any message (template tokens)"
        return f" in message {self.message_index} ({self.role})"

    def __repr__(self) -> str:
        if self.identical:
            return f"Divergence(identical, {self.len_a} tokens)"
        if self.is_prefix:
            short, long_ = ("a", "b") if self.len_a < self.len_b else ("b", "a")
            return (f"Divergence(none: {short} is a prefix of {long_}, "
                    f"{self.common} of {max(self.len_a, self.len_b)} tokens shared)")
        side_a = _side(self.before, self.token_a, self.after_a, self.token_index)
        side_b = _side(self.before, self.token_b, self.after_b, self.token_index)
        return f"Divergence(at token {self.token_index}{self._where()}: {side_a} vs {side_b})"

    def _repr_html_(self) -> str:
        if self.token_index is None:
            return summary_html(repr(self))
        grey = "color:#999"
        rows = []
        for name, tok, after, char in (("a", self.token_a, self.after_a, self.char_a),
                                       ("b", self.token_b, self.after_b, self.char_b)):
            shared = "".join(f'<span style="{grey}">{piece_html(p)}</span>' for p in self.before)
            rest = "".join(f"<span>{piece_html(p)}</span>" for p in after)
            rows.append((Html(f"<b>{name}</b>"), Html(
                f'<span style="font-family:monospace;white-space:pre">{shared}<span style="background:'
                f'#ffb3b3;font-weight:bold">{piece_html(tok) or "∅"}</span>{rest}</span>'),
                Html(f"<span style=\"{grey}\">{'' if char is None else f'char {char}'}</span>")))
        return summary_html("Divergence", f"at token {self.token_index}{self._where()}",
                            f"{self.common} tokens shared of {self.len_a} / {self.len_b}",
                            f"{self.reusable_blocks()} blocks of 16 reusable", body=table_html(None, rows))


def _side(before: tuple[str, ...], token: str, after: tuple[str, ...], index: int) -> str:
    """A few characters either side of the differing token (kept whole up to 16 characters)."""
    left = "".join(before)
    dots = "..." if len(left) > 10 or index > len(before) else ""
    return repr(dots + left[-10:] + token[:16] + "".join(after)[:10])


def clipped(s: str, n: int = 24) -> str:
    """``repr`` of ``s``, cut to ``n`` characters (for one-line reprs).

    Example:
        >>> clipped("x-anthropic-billing-header", 8)
        "'x-anthro...'"
    """
    return repr(s if len(s) <= n else s[:n] + "...")


def piece_html(piece: str) -> str:
    """A token's (or value's) text for an HTML cell: escaped, newlines shown as ↵.

    Example:
        >>> piece_html("<a>\\n")
        '&lt;a&gt;↵'
    """
    return html.escape(piece).replace("\n", "↵")


def diverge(a, b, *, context: int = 4, model=None) -> Divergence:
    """The first token where two prompts differ, the message it falls in, and the text around it.

    ``a`` and ``b`` are ``Tokens`` or token id sequences (or text / messages with ``model=``).

    Example:
        >>> kv.diverge([1, 2, 3, 4], [1, 2, 9])
        Divergence(at token 2: '<1><2><3><4>' vs '<1><2><9>')
    """
    ta, tb = (as_tokens(x, model, name=n, allow_empty=True) for x, n in ((a, "a"), (b, "b")))
    common = common_prefix_len(ta.ids, tb.ids)
    differ = common < len(ta) and common < len(tb)
    i = common
    before = tuple(ta.piece(j) for j in range(max(0, i - context), i))
    token_a = ta.piece(i) if i < len(ta) else ""
    token_b = tb.piece(i) if i < len(tb) else ""
    after_a = tuple(ta.piece(j) for j in range(i + 1, min(len(ta), i + 1 + context)))
    after_b = tuple(tb.piece(j) for j in range(i + 1, min(len(tb), i + 1 + context)))
    span = ta.span_at(i) if differ else None
    if span is not None and span.role == "text":
        span = None  # plain text or raw ids: there are no messages to name
    return Divergence(
        token_index=i if differ else None, common=common, len_a=len(ta), len_b=len(tb),
        message_index=span.index if span else None, role=span.role if span else None,
        char_a=ta.offsets[i][0] if differ and ta.offsets else None,
        char_b=tb.offsets[i][0] if differ and tb.offsets else None,
        before=before, token_a=token_a, token_b=token_b, after_a=after_a, after_b=after_b,
        has_messages=any(s.role != "text" for s in ta.spans))


__all__ = ["Divergence", "clipped", "diverge", "piece_html"]
