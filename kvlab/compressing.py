"""Compression meets prefix caching: what the Engine and kvlab's server do with a press.

A request's context (by default the prompt before its last message) is compressed once and stored
under a key that includes the press and its settings: an extra-key span ``(0, context_end,
"press:<key>")`` (``kvlab.keys``), so a compressed entry never serves an uncompressed request nor
another press's, from its first token on. The rest of the prompt (the last message) and the reply
run on the compressed cache. The next request with the same context is a whole-context hit and
restores exactly what a fresh compression gives; a match on part of a compressed entry is refused
by the reuse core (``PrefixCache.lookup(whole=True)``) with the reason. A query-aware press (its
kept rows depend on the last queries of the context) is never offered to the store. Each fresh
compression is an event row ``compress`` (tokens: the context; bytes: what the press saved;
detail: the press), which the Inspector's memory view adds up.

Example:
    >>> engine = kv.Engine(m, kv.RadixStore(), press=kv.press("knorm", 0.5))
    >>> engine.run(doc_and_question_1); r = engine.run(doc_and_question_2)
    >>> r.reused_tokens == r.press_tokens                # the compressed document, reused whole
"""

from __future__ import annotations

from .errors import PressError
from .keys import CacheKey
from .presses.apply import check_compressible
from .presses.base import Press
from .presses.compress import Prefilled
from .primitives.tokens import Tokens

SPAN = "press:"  # an extra key's prefix: the press part of a compressed entry's key
NOT_REUSED = ("{name} is query-aware: its kept rows depend on the last queries of the context, so "
              "its compressed context is not reused (use a query-agnostic press to reuse it)")


def check_press(press, model, store) -> Press | None:
    """``press`` checked for an Engine of ``model`` over ``store`` (None: no press)."""
    if press is None:
        return None
    if not isinstance(press, Press):
        raise PressError(f"press= takes a press (kv.press(name, ratio)), got {type(press).__name__}")
    if getattr(model, "kind", "text") != "text":
        raise PressError("a press runs on text models; this one is a VLM (its image tokens are bound per request)")
    check_compressible(model, model.make_cache())
    if store is not None and "compressed" not in store.capabilities.holds:
        raise PressError(f"the {store.name} store keeps {', '.join(sorted(store.capabilities.holds))} KV "
                         "in token blocks or edges; a compressed cache holds kept rows, not tokens: use a "
                         "store that keeps whole entries (radix, system, mlx-lru, disk, tiered)")
    return press


def context_end_of(toks: Tokens, end: int | None = None) -> int:
    """Where the compressed context ends: ``end`` if given, else the start of the last message,
    else (a prompt of one message or bare ids) all but the last token."""
    n = len(toks.ids)
    if end is not None:
        if isinstance(end, bool) or not isinstance(end, int) or not 1 <= end < n:
            raise PressError(f"context_end must be an int in 1..{n - 1} (the last token always runs on "
                             f"the compressed cache), got {end!r}")
        return end
    spans = list(toks.spans)
    if len(spans) > 1 and spans[-1].role == "assistant" and spans[-1].token_end == n:
        spans.pop()  # the generation prompt (an open assistant turn recovered from ChatML markers)
    last = spans[-1].token_start if spans else 0
    return last if last >= 1 else n - 1


def press_key(key: CacheKey, press: Press, end: int) -> CacheKey:
    """``key`` with the press span over its first ``end`` tokens."""
    span = (0, end, SPAN + press.key)
    return CacheKey(key.ids, tuple(sorted(key.extra_keys + (span,))), key.salt)


def compress_context(model, ids, end: int, press: Press, kv: dict):
    """``ids[:end]`` compressed afresh (a ``Compressed``; quantized after compressing, as ``kv`` says)."""
    return Prefilled(model, list(ids[:end]), [press]).compress(
        press, kv_bits=kv.get("kv_bits"), kv_group_size=kv.get("kv_group_size", 64))
