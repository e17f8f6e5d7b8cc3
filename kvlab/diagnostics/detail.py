"""token_detail(): what only kvlab knows, from the two rendered prompts' token ids: the token
index where they diverge, the message (index and role) it falls in, about 40 characters of text
either side in each prompt, and the token counts that follow (see kvlab.primitives.divergence).

Example:
    >>> d = token_detail([1, 2, 3, 4], [1, 2, 9, 9, 9])
    >>> d.token_index, d.reusable_tokens, d.lost_tokens, d.missed_tokens
    (2, 2, 2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..primitives.display import summary_html, table_html
from ..primitives.divergence import diverge
from ..primitives.tokens import Tokens, as_tokens

CONTEXT_CHARS = 40


@dataclass(frozen=True)
class TokenDetail:
    """Where the rendered prompts part. ``token_index`` is None when one is a prefix of the
    other. ``reusable_tokens``: the common prefix (what a prefix cache can still reuse);
    ``lost_tokens``: previous-prompt tokens after it (what the providers call missed: they would
    have been read from cache had the prefix matched); ``missed_tokens``: current-prompt tokens
    after it (what must be prefilled again). ``previous``/``current``: (text before, text from)
    the divergence point in each prompt. ``rendered_message_index`` counts the rendered
    conversation's messages (a system prompt is message 0 there); ``message_index`` counts the
    request's ``messages`` array, as the structural comparison does (None inside the system prompt)."""

    token_index: int | None
    message_index: int | None
    role: str | None
    rendered_message_index: int | None
    reusable_tokens: int
    lost_tokens: int
    missed_tokens: int
    previous_tokens: int
    current_tokens: int
    previous: tuple[str, str] = ("", "")
    current: tuple[str, str] = ("", "")

    def to_dict(self) -> dict:
        return {"token_index": self.token_index, "message_index": self.message_index, "role": self.role,
                "rendered_message_index": self.rendered_message_index,
                "reusable_tokens": self.reusable_tokens, "lost_tokens": self.lost_tokens,
                "missed_tokens": self.missed_tokens, "previous_tokens": self.previous_tokens,
                "current_tokens": self.current_tokens,
                "previous_text": {"before": self.previous[0], "after": self.previous[1]},
                "current_text": {"before": self.current[0], "after": self.current[1]}}

    def __repr__(self) -> str:
        if self.token_index is None:
            return (f"TokenDetail(no divergence: {self.reusable_tokens} tokens shared, "
                    f"{self.missed_tokens} new)")
        where = "" if self.message_index is None else f" in message {self.message_index} ({self.role})"
        return (f"TokenDetail(at token {self.token_index}{where}: {self.previous[1][:16]!r} -> "
                f"{self.current[1][:16]!r}; {self.reusable_tokens} reusable, {self.missed_tokens} missed)")

    def _repr_html_(self) -> str:
        rows = [(name, before, after) for name, (before, after) in
                (("previous", self.previous), ("current", self.current))]
        return summary_html("TokenDetail", f"token {self.token_index}" if self.token_index is not None
                            else "no divergence", f"{self.reusable_tokens} reusable",
                            f"{self.missed_tokens} missed", body=table_html(["prompt", "before", "from"], rows))


def _around(tokens: Tokens, i: int, chars: int) -> tuple[str, str]:
    """``chars`` characters of text before token ``i`` and from it on."""
    if tokens.offsets and tokens.text:
        c = tokens.offsets[i][0] if i < len(tokens) else len(tokens.text)
        return tokens.text[max(0, c - chars):c], tokens.text[c:c + chars]
    # no character offsets (raw ids): build the text from the tokens' pieces
    before, j = "", i
    while j > 0 and len(before) < chars:
        j -= 1
        before = tokens.piece(j) + before
    after, j = "", i
    while j < len(tokens) and len(after) < chars:
        after += tokens.piece(j)
        j += 1
    return before[-chars:], after[:chars]


def token_detail(previous, current, *, chars: int = CONTEXT_CHARS, system_messages: int = 0) -> TokenDetail:
    """Compare the previous and current rendered prompts (``Tokens`` or token ids; see the
    module docstring). Message index and role come from the current prompt's spans;
    ``system_messages`` is how many rendered messages the request's system prompt became (the
    leading ones), so ``message_index`` can count the request's ``messages`` array."""
    prev = as_tokens(previous, name="previous", allow_empty=True)
    cur = as_tokens(current, name="current", allow_empty=True)
    d = diverge(cur, prev)  # a = current: the message named is the current prompt's
    common = d.common
    rendered = d.message_index
    index = None if rendered is None or rendered < system_messages else rendered - system_messages
    return TokenDetail(
        token_index=d.token_index, message_index=index, role=d.role, rendered_message_index=rendered,
        reusable_tokens=common, lost_tokens=len(prev) - common, missed_tokens=len(cur) - common,
        previous_tokens=len(prev), current_tokens=len(cur),
        previous=_around(prev, common, chars) if d.token_index is not None else ("", ""),
        current=_around(cur, common, chars) if d.token_index is not None else ("", ""))


__all__ = ["CONTEXT_CHARS", "TokenDetail", "token_detail"]
