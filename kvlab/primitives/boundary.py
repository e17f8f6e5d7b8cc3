"""split_at_boundary(): cut a tokenised conversation at a message boundary, and check the cut is clean.

A cut is *clean* when tokenising the rendered prefix alone gives a token-prefix of the whole: only
then is a KV snapshot of the prefix reusable for every conversation that starts with it (seed 003).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BoundaryError
from .display import Html, summary_html
from .tokens import Tokens, common_prefix_len, encode_with_offsets, render


@dataclass(frozen=True)
class Split:
    """``prefix_ids + suffix_ids == tokens.ids``; ``index`` is the token index of the cut.

    When not ``clean``, ``index`` is where the separately rendered prefix stops matching and
    ``reason`` says why.
    """

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    index: int
    clean: bool
    message_index: int
    reason: str = ""

    def __repr__(self) -> str:
        state = "clean" if self.clean else f"NOT clean: {self.reason}"
        return (f"Split(at message {self.message_index}, token {self.index}: "
                f"{len(self.prefix_ids)}+{len(self.suffix_ids)} ids, {state})")

    def _repr_html_(self) -> str:
        colour = "#2a7" if self.clean else "#c33"
        word = "clean" if self.clean else "not clean"
        return summary_html("Split", f"at message {self.message_index}, token {self.index}",
                            f"prefix {len(self.prefix_ids)} ids | suffix {len(self.suffix_ids)} ids",
                            Html(f'<span style="color:{colour};font-weight:bold">{word}</span>'),
                            note=self.reason)


def _message_index(tokens: Tokens, at) -> int:
    n = len(tokens.messages)
    if at == "system":
        k = 0
        while k < n and tokens.messages[k]["role"] == "system":
            k += 1
        if k == 0:
            raise BoundaryError("split at='system' needs a conversation that starts with a system "
                                "message; this one starts with role "
                                f"{tokens.messages[0]['role']!r}. Pass a message index instead.")
        return k
    if isinstance(at, bool) or not isinstance(at, int):
        raise BoundaryError(f"at must be 'system' or a message index, got {at!r}")
    if not 1 <= at <= n:
        raise BoundaryError(f"message index {at} is outside 1..{n}: the prefix must hold at least "
                            f"one message and at most all {n}")
    return at


def split_at_boundary(tokens: Tokens, at="system") -> Split:
    """Split before message ``at`` (or after the leading system messages with ``at="system"``).

    Example:
        >>> msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        >>> s = kv.split_at_boundary(kv.tokenise(m, msgs), at="system")
        >>> s.clean, len(s.prefix_ids), len(s.suffix_ids)
        (True, 8, 9)
    """
    if not tokens.messages or tokens.tokenizer is None:
        raise BoundaryError("this Tokens has no messages (it came from text or ids); tokenise a "
                            "conversation with kv.tokenise(model, messages) to split it")
    k = _message_index(tokens, at)
    kwargs = dict(tokens.template_kwargs)
    prefix_text = render(tokens.tokenizer, tokens.messages[:k], add_generation_prompt=False, **kwargs)
    alone, _ = encode_with_offsets(tokens.tokenizer, prefix_text)
    ids = tokens.ids
    common = common_prefix_len(alone, ids)
    clean = common == len(alone)
    reason = ""
    if not clean:
        if not tokens.text.startswith(prefix_text):
            text_common = next((i for i, (x, y) in enumerate(zip(prefix_text, tokens.text)) if x != y),
                               min(len(prefix_text), len(tokens.text)))
            reason = (f"the template renders messages[:{k}] differently inside the whole conversation "
                      f"(text differs at character {text_common}), e.g. it rewrites earlier turns")
        else:
            got = tokens.tokenizer.decode([alone[common]]) if common < len(alone) else ""
            want = tokens.piece(common) if common < len(ids) else ""
            reason = (f"tokenising the prefix alone gives {len(alone)} tokens that stop matching at "
                      f"token {common} ({got!r} alone vs {want!r} in the whole): a token spans the cut")
    return Split(tuple(ids[:common]), tuple(ids[common:]), common, clean, k, reason)
