"""tokenise(): a conversation rendered through the model's chat template, with per-message spans.

Example:
    >>> toks = kv.tokenise(m, [{"role": "user", "content": "Hi"}])
    >>> toks.spans[0].role, toks.ids[toks.spans[0].token_start]
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import TemplateError

KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
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
        return (f"<div><b>Tokens</b> {len(self.ids)} ids · {legend}<br>"
                f'<div style="white-space:pre-wrap;line-height:1.6">{"".join(cells)}{more}</div></div>')


def _tokenizer_of(model_or_tokenizer):
    return getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)


def _hf(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def validate_messages(messages: Sequence[dict]) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise TemplateError("empty conversation: pass at least one message like "
                            "{'role': 'user', 'content': '...'}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise TemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in KNOWN_ROLES:
            raise TemplateError(f"message {i} has unknown role {m['role']!r}; "
                                f"use one of {sorted(KNOWN_ROLES)}")
        out.append(dict(m))
    return out


def render(tokenizer, messages, *, add_generation_prompt=True, **template_kwargs) -> str:
    """The chat template's rendering of ``messages`` as text."""
    hf = _hf(tokenizer)
    if not getattr(hf, "chat_template", None):
        raise TemplateError("this tokenizer has no chat template; pass plain text or token ids, "
                            "or load a model whose tokenizer_config.json has a chat_template")
    try:
        return hf.apply_chat_template(list(messages), tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as e:  # jinja raises many types; the user needs the template's words
        raise TemplateError(f"the chat template could not render this conversation: {e}") from e


def encode_with_offsets(tokenizer, text: str, add_special_tokens=False):
    hf = _hf(tokenizer)
    enc = hf(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return tuple(enc["input_ids"]), tuple(tuple(o) for o in enc["offset_mapping"])


def _message_char_spans(tokenizer, messages, text, template_kwargs):
    """Each message's characters: the growth of the rendering as messages are added.

    Templates that rewrite history (Qwen3 drops <think> from earlier turns) make a partial
    rendering differ from the full one; then fall back to locating the content itself.
    """
    bounds = []
    prev_end = 0
    for i in range(len(messages)):
        partial = render(tokenizer, messages[: i + 1], add_generation_prompt=False, **template_kwargs)
        common = common_prefix_len(partial, text)
        end = common if common > prev_end else prev_end
        if common < len(partial):
            found, content = _find_content(text, messages[i]["content"], prev_end)
            if found >= 0:
                end = max(end, found + len(content))
                nxt = text.find("\n", end)
                end = nxt + 1 if nxt >= 0 and i + 1 < len(messages) else end
        bounds.append((prev_end, end))
        prev_end = end
    return bounds


def _find_content(text: str, content, start: int) -> tuple[int, str]:
    """Where a message's content sits in the rendering, also when the template rewrote it
    (e.g. removed a <think> block); (-1, "") when it cannot be found."""
    if not isinstance(content, str) or not content:
        return -1, ""
    for candidate in (content, re.sub(r"<think>.*?</think>\s*", "", content, flags=re.S).strip(),
                      content.strip()[-40:]):
        found = text.find(candidate, start) if candidate else -1
        if found >= 0:
            return found, candidate
    return -1, ""


def common_prefix_len(a, b) -> int:
    """Length of the common prefix of two sequences (str, tuple, list)."""
    n = min(len(a), len(b))
    # compare C-level slices, then scan only the chunk that differs
    for lo in range(0, n, 4096):
        hi = min(lo + 4096, n)
        if a[lo:hi] != b[lo:hi]:
            return next(i for i in range(lo, hi) if a[i] != b[i])
    return n


def _char_to_token_span(offsets, c0, c1):
    t0 = next((i for i, (a, b) in enumerate(offsets) if b > c0), len(offsets))
    t1 = next((i for i, (a, b) in enumerate(offsets) if a >= c1 and i >= t0), len(offsets))
    return t0, t1


def tokenise(model, messages_or_text, *, add_generation_prompt=True, **template_kwargs) -> Tokens:
    """Render a conversation through the chat template and tokenise it, keeping message spans.

    ``messages_or_text`` is a list of ``{"role", "content"}`` dicts (rendered with the chat
    template), a plain string (tokenised as it is), or a sequence of token ids.

    Example:
        >>> t = kv.tokenise(m, [{"role": "system", "content": "Be brief."},
        ...                     {"role": "user", "content": "Hi"}])
        >>> [s.role for s in t.spans]
        ['system', 'user']
    """
    tokenizer = _tokenizer_of(model)
    vlm = getattr(model, "tokenise_images", None)
    if vlm is not None and isinstance(messages_or_text, (list, tuple)) and _has_content_lists(messages_or_text):
        return vlm(messages_or_text, add_generation_prompt=add_generation_prompt, **template_kwargs)
    if isinstance(messages_or_text, str):
        ids, offsets = encode_with_offsets(tokenizer, messages_or_text)
        if not ids:
            raise TemplateError("empty text: nothing to tokenise")
        span = Span(0, "text", 0, len(ids), 0, len(messages_or_text))
        return Tokens(ids, messages_or_text, (span,), offsets, None, (), tokenizer)
    if (isinstance(messages_or_text, (list, tuple)) and messages_or_text
            and all(isinstance(x, int) for x in messages_or_text)):
        return from_ids(messages_or_text, tokenizer)
    messages = validate_messages(messages_or_text)
    for i, m in enumerate(messages):
        if not isinstance(m["content"], str):
            raise TemplateError(f"message {i} has non-text content; this is a text-only model "
                                "(load a VLM with kv.load_vlm for image messages)")
    text = render(tokenizer, messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    ids, offsets = encode_with_offsets(tokenizer, text)
    spans = []
    for i, (c0, c1) in enumerate(_message_char_spans(tokenizer, messages, text, template_kwargs)):
        t0, t1 = _char_to_token_span(offsets, c0, c1)
        spans.append(Span(i, messages[i]["role"], t0, t1, c0, c1))
    return Tokens(ids, text, tuple(spans), offsets, tuple(messages), (), tokenizer,
                  tuple(sorted(template_kwargs.items())))


def _has_content_lists(messages) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def from_ids(ids: Sequence[int], tokenizer=None) -> Tokens:
    """Tokens for raw token ids (no template, no spans). The text is the decoded ids when a
    tokenizer is given."""
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise TemplateError("empty token id list: a request needs at least one token")
    text = _hf(tokenizer).decode(list(ids)) if tokenizer is not None else ""
    return Tokens(ids, text, (Span(0, "text", 0, len(ids), 0, len(text)),), (), None, (), tokenizer)
