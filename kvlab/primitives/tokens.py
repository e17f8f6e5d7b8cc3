"""tokenise(): a conversation rendered through the model's chat template, with per-message spans.

Example:
    >>> toks = kv.tokenise(m, [{"role": "user", "content": "Hi"}])
    >>> toks.spans[0].role, toks.ids[toks.spans[0].token_start]     # m: the tiny Qwen3 model
    ('user', 151644)
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import TemplateError, TokenIdError
from .display import Html, summary_html
# the rendering side lives in chat_template; these names stay importable from here
from .chat_template import (KNOWN_ROLES, Tokeniser, char_to_token_span, common_prefix_len,  # noqa: F401
                            encode_with_offsets, has_content_lists, hf_tokenizer, is_messages,
                            message_char_spans, render, tokenizer_of, validate_messages, vocab_limit)

ROLE_COLOURS = {
    "system": "#e8d5ff", "user": "#d5ecff", "assistant": "#d9f7d5",
    "tool": "#ffe9c7", "developer": "#f0f0f0", "text": "#f0f0f0",
}


@dataclass(frozen=True)
class Span:
    """Where one message sits: tokens [token_start, token_end), characters [char_start, char_end)."""

    index: int
    role: str
    token_start: int
    token_end: int
    char_start: int
    char_end: int

    def __repr__(self) -> str:
        return f"Span({self.index}:{self.role} tokens {self.token_start}:{self.token_end})"


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: its content hash and the token span of its placeholder tokens."""

    hash: str
    token_start: int
    token_end: int
    message_index: int

    def __repr__(self) -> str:
        return f"ImageRef({self.hash[:12]} tokens {self.token_start}:{self.token_end})"


@dataclass(frozen=True)
class Tokens:
    """A tokenised prompt. ``offsets[i]`` is token i's (char_start, char_end) in ``text``."""

    ids: tuple[int, ...]
    text: str
    spans: tuple[Span, ...] = ()
    offsets: tuple[tuple[int, int], ...] = ()
    messages: tuple[dict, ...] | None = None
    images: tuple[ImageRef, ...] = ()
    tokenizer: Any = field(default=None, compare=False, repr=False)
    template_kwargs: tuple = field(default=(), compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def piece(self, i: int) -> str:
        """The text of token i as it appears in the rendering (empty for tokens with no text)."""
        if self.offsets:
            a, b = self.offsets[i]
            return self.text[a:b]
        if self.tokenizer is not None:
            return self.tokenizer.decode([self.ids[i]])
        return f"<{self.ids[i]}>"

    def span_at(self, token_index: int) -> Span | None:
        """The message span that contains token ``token_index``, if any."""
        return next((s for s in self.spans if s.token_start <= token_index < s.token_end), None)

    def __repr__(self) -> str:
        roles = ",".join(s.role for s in self.spans)
        return f"Tokens({len(self.ids)} ids, {len(self.spans)} messages [{roles}])"

    def _repr_html_(self, limit: int = 2000) -> str:
        cells = []
        for i in range(min(len(self.ids), limit)):
            span = self.span_at(i)
            colour = ROLE_COLOURS.get(span.role if span else "", "#ffffff")
            piece = html.escape(self.piece(i)).replace("\n", "↵")
            cells.append(
                f'<span title="#{i} id={self.ids[i]} {span.role if span else "template"}" '
                f'style="background:{colour};border-right:1px solid #fff;font-family:monospace">'
                f"{piece or '∅'}</span>")
        more = f" … {len(self.ids) - limit} more" if len(self.ids) > limit else ""
        legend = " ".join(
            f'<span style="background:{ROLE_COLOURS.get(s.role, "#fff")}">{s.index}:{s.role} '
            f"[{s.token_start}:{s.token_end})</span>" for s in self.spans)
        strip = f'<div style="white-space:pre-wrap;line-height:1.6">{"".join(cells)}{more}</div>'
        return summary_html("Tokens", f"{len(self.ids)} ids", Html(legend), body=strip)


def check_ids(ids: Sequence[int], vocab_size: int, what: str = "token ids") -> tuple[int, ...]:
    """``ids`` as a tuple of ints, or a TokenIdError naming the first id outside ``[0, vocab_size)``.

    MLX gathers embeddings without a bounds check, so an id past the vocabulary crashes the
    process (a notebook kernel dies) and a negative one silently wraps: check where ids enter.

    Example:
        >>> check_ids([5, 7], 10)
        (5, 7)
    """
    out = []
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, int) and not hasattr(x, "__index__"):
            raise TokenIdError(f"{what}: position {i} holds {x!r} ({type(x).__name__}), not an int")
        v = int(x)
        if not 0 <= v < vocab_size:
            raise TokenIdError(f"{what}: position {i} holds id {v}, outside this model's vocabulary "
                               f"[0, {vocab_size}); tokenise text with kv.tokenise(model, ...)")
        out.append(v)
    return tuple(out)


def tokenise(model, messages_or_text, *, add_generation_prompt=True, **template_kwargs) -> Tokens:
    """Render a conversation through the chat template and tokenise it, keeping message spans.

    ``model`` is a kvlab model (its own ``tokenise`` runs: a VLM expands image placeholders) or
    a bare tokenizer. ``messages_or_text`` is a list of ``{"role", "content"}`` dicts (rendered
    with the chat template), a plain string (tokenised as it is), or a sequence of token ids.

    Example:
        >>> t = kv.tokenise(m, [{"role": "system", "content": "Be brief."},
        ...                     {"role": "user", "content": "Hi"}])
        >>> [s.role for s in t.spans]
        ['system', 'user']
    """
    if isinstance(model, Tokeniser):
        return model.tokenise(messages_or_text, add_generation_prompt=add_generation_prompt,
                              **template_kwargs)
    return tokenise_text(model, messages_or_text, add_generation_prompt=add_generation_prompt,
                         **template_kwargs)


def tokenise_text(tokenizer, messages_or_text, *, add_generation_prompt=True, **template_kwargs) -> Tokens:
    """``tokenise`` for text-only conversations with an mlx-lm (or Hugging Face) tokenizer."""
    if isinstance(messages_or_text, str):
        ids, offsets = encode_with_offsets(tokenizer, messages_or_text)
        if not ids:
            raise TemplateError("empty text: nothing to tokenise")
        span = Span(0, "text", 0, len(ids), 0, len(messages_or_text))
        return Tokens(ids, messages_or_text, (span,), offsets, None, (), tokenizer)
    if is_id_sequence(messages_or_text):
        return from_ids(messages_or_text, tokenizer)
    messages = validate_messages(messages_or_text)
    for i, m in enumerate(messages):
        if not isinstance(m["content"], str):
            raise TemplateError(f"message {i} has non-text content; this is a text-only model "
                                "(load a VLM with kv.load_vlm for image messages)")
    text = render(tokenizer, messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    ids, offsets = encode_with_offsets(tokenizer, text)
    spans = []
    for i, (c0, c1) in enumerate(message_char_spans(tokenizer, messages, text, template_kwargs)):
        t0, t1 = char_to_token_span(offsets, c0, c1)
        spans.append(Span(i, messages[i]["role"], t0, t1, c0, c1))
    return Tokens(ids, text, tuple(spans), offsets, tuple(messages), (), tokenizer,
                  tuple(sorted(template_kwargs.items())))


def is_id_sequence(x) -> bool:
    """True for a non-empty list/tuple/1-d integer array of token ids."""
    if hasattr(x, "dtype") and hasattr(x, "ndim"):
        return x.ndim == 1 and x.dtype.kind in "iu" and len(x) > 0
    return (isinstance(x, (list, tuple)) and len(x) > 0
            and all(isinstance(v, int) or (hasattr(v, "__index__") and not isinstance(v, bool)
                                           and not isinstance(v, dict)) for v in x))


def from_ids(ids: Sequence[int], tokenizer=None, *, chatml_spans: bool = False) -> Tokens:
    """Tokens for raw token ids. With a tokenizer the text is the decoded ids, each token's
    characters are recorded, and ids outside its vocabulary raise TokenIdError. With
    ``chatml_spans`` message spans are recovered from ``<|im_start|>role`` markers, so a
    divergence can be placed in a message without the original messages.

    Example:
        >>> kv.tokens.from_ids([14990], kv.load("tiny").tokenizer).text
        'hello'
    """
    if tokenizer is not None:
        ids = check_ids(ids, vocab_limit(tokenizer))
    else:
        ids = tuple(int(i) for i in ids)
        bad = next((i for i, v in enumerate(ids) if v < 0), None)
        if bad is not None:
            raise TokenIdError(f"token ids: position {bad} holds id {ids[bad]}; ids are >= 0")
    if not ids:
        raise TemplateError("empty token id list: a request needs at least one token")
    if tokenizer is None:
        return Tokens(ids, "", (Span(0, "text", 0, len(ids), 0, 0),), (), None, (), None)
    hf = hf_tokenizer(tokenizer)
    if not chatml_spans:
        text = hf.decode(list(ids))
        return Tokens(ids, text, (Span(0, "text", 0, len(ids), 0, len(text)),), (), None, (), tokenizer)
    pieces = [hf.decode([i]) for i in ids]
    offsets, c = [], 0
    for p in pieces:
        offsets.append((c, c + len(p)))
        c += len(p)
    text = "".join(pieces)
    marker = _token_id(hf, "<|im_start|>")
    starts = [i for i, t in enumerate(ids) if t == marker] if marker is not None else []
    spans = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(ids)
        role = text[offsets[s][1]: offsets[e - 1][1]].split("\n", 1)[0].strip()
        if role in KNOWN_ROLES:
            spans.append(Span(len(spans), role, s, e, offsets[s][0], offsets[e - 1][1]))
    return Tokens(ids, text, tuple(spans), tuple(offsets), None, (), tokenizer)


def _token_id(hf, token: str) -> int | None:
    try:
        i = hf.convert_tokens_to_ids(token)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return i if isinstance(i, int) and i != getattr(hf, "unk_token_id", None) else None


def as_tokens(x, model=None, *, name: str = "prompt", chatml_spans: bool = False,
              allow_empty: bool = False) -> Tokens:
    """Anything a prompt can be, as ``Tokens``: Tokens (as they are), token ids (a sequence or a
    1-d integer array), text or messages (tokenised with ``model``, a kvlab model or tokenizer).
    ``name`` names the prompt in errors; ``chatml_spans`` recovers message spans from raw ids
    (``from_ids``); ``allow_empty`` turns an empty list or tuple into empty Tokens (a prefix of
    every prompt) instead of an error.

    Example:
        >>> as_tokens([1, 2, 3]).ids
        (1, 2, 3)
        >>> len(as_tokens([], allow_empty=True))
        0
    """
    if isinstance(x, Tokens):
        return x
    if allow_empty and isinstance(x, (list, tuple)) and not x:
        return Tokens((), "", tokenizer=tokenizer_of(model) if model is not None else None)
    if isinstance(x, str) or is_messages(x):
        if model is None:
            raise TemplateError(f"{name} is text or messages, which need a model to tokenise: pass "
                                "model=... (or a tokenizer), or tokenise first with kv.tokenise")
        return tokenise(model, x)
    if hasattr(x, "dtype") and hasattr(x, "ndim"):
        if x.dtype.kind not in "iu" or x.ndim != 1:
            raise TokenIdError(f"{name} must be a 1-d array of integer token ids, got dtype "
                               f"{x.dtype} with shape {x.shape}")
        x = x.tolist()
    try:
        seq = list(x)
    except TypeError:
        raise TokenIdError(f"{name} must be Tokens, token ids, text or messages, "
                           f"got {type(x).__name__}") from None
    bad = next((v for v in seq if isinstance(v, bool) or not (isinstance(v, int) or hasattr(v, "__index__"))), None)
    if bad is not None:
        raise TokenIdError(f"{name} holds {bad!r} ({type(bad).__name__}); token ids must be ints")
    return from_ids(seq, tokenizer_of(model) if model is not None else None, chatml_spans=chatml_spans)
