"""Tokenizers and chat templates, the text side of ``tokenise()``: the Hugging Face tokenizer inside
a model, a conversation rendered through its chat template and encoded with character offsets, and
where each message sits in that rendering.

Example:
    >>> text = render(m.tokenizer, [{"role": "user", "content": "Hi"}])    # m: the tiny Qwen3 model
    >>> message_char_spans(m.tokenizer, [{"role": "user", "content": "Hi"}], text, {})
    [(0, 30)]
"""

from __future__ import annotations

import re
from typing import Any, Protocol, Sequence, runtime_checkable

from ..errors import TemplateError

KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@runtime_checkable
class Tokeniser(Protocol):
    """What a model offers to turn a conversation into ``Tokens`` (kv.Model and kv.VLModel do).

    ``kv.tokenise(model, x)`` calls ``model.tokenise(x)``; a bare tokenizer takes the text path.
    """

    tokenizer: Any

    def tokenise(self, messages_or_text, *, add_generation_prompt: bool = True,
                 **template_kwargs) -> "Tokens": ...  # kvlab.primitives.tokens.Tokens


def tokenizer_of(model_or_tokenizer):
    """The mlx-lm tokenizer of a kvlab model (or the tokenizer itself)."""
    return model_or_tokenizer.tokenizer if isinstance(model_or_tokenizer, Tokeniser) else model_or_tokenizer


def hf_tokenizer(obj):
    """The Hugging Face tokenizer inside a kvlab model, mlx-lm's TokenizerWrapper, or itself.

    Example:
        >>> hf_tokenizer(kv.load("tiny")).decode([14990])
        'hello'
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    obj = tokenizer_of(obj)
    return obj._tokenizer if isinstance(obj, TokenizerWrapper) else obj


def vocab_limit(tokenizer) -> int:
    """How many token ids the tokenizer knows (base vocabulary plus added tokens)."""
    return len(hf_tokenizer(tokenizer))


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
    hf = hf_tokenizer(tokenizer)
    if not getattr(hf, "chat_template", None):
        raise TemplateError("this tokenizer has no chat template; pass plain text or token ids, "
                            "or load a model whose tokenizer_config.json has a chat_template")
    try:
        return hf.apply_chat_template(list(messages), tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as e:  # jinja raises many types; the user needs the template's words
        raise TemplateError(f"the chat template could not render this conversation: {e}") from e


def encode_with_offsets(tokenizer, text: str, add_special_tokens=False):
    hf = hf_tokenizer(tokenizer)
    enc = hf(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return tuple(enc["input_ids"]), tuple(tuple(o) for o in enc["offset_mapping"])


def message_char_spans(tokenizer, messages, text, template_kwargs) -> list[tuple[int, int]]:
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


def char_to_token_span(offsets, c0, c1) -> tuple[int, int]:
    """The tokens [t0, t1) that cover characters [c0, c1), given each token's (start, end)."""
    t0 = next((i for i, (a, b) in enumerate(offsets) if b > c0), len(offsets))
    t1 = next((i for i, (a, b) in enumerate(offsets) if a >= c1 and i >= t0), len(offsets))
    return t0, t1


def has_content_lists(messages) -> bool:
    """True when some message's content is a list of parts (images, text pieces)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), (list, tuple)) for m in messages)


def is_messages(x) -> bool:
    """True for a non-empty list/tuple of message dicts."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)
