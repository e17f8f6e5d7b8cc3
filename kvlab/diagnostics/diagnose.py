"""diagnose(): from the id a client named to the provider's diagnostics object, with kvlab's
detail in its ``kvlab`` key. An unknown or expired id answers the provider's not-found type.

Example:
    >>> from kvlab.diagnostics import FingerprintLog, shape_of
    >>> log = FingerprintLog(clock=lambda: 0.0)
    >>> log.remember("msg_1", shape_of({"model": "m", "system": "A", "max_tokens": 8,
    ...     "messages": [{"role": "user", "content": "Hi"}]}, "anthropic"), [1, 2, 3, 4])
    >>> now = shape_of({"model": "m", "system": "B", "max_tokens": 8,
    ...     "messages": [{"role": "user", "content": "Hi"}]}, "anthropic")
    >>> diagnose(log, "msg_1", now, [1, 9, 3, 4], cached_tokens=1)["cache_miss_reason"]
    {'type': 'system_changed', 'cache_missed_input_tokens': 3}
    >>> diagnose(log, "msg_404", now, [1], cached_tokens=0)
    {'cache_miss_reason': {'type': 'previous_message_not_found'}}
"""

from __future__ import annotations

from ..errors import DiagnosticsError
from .compare import Comparison, compare
from .detail import TokenDetail, token_detail
from .log import FingerprintLog
from .provider import (anthropic_diagnostics, anthropic_not_found, openai_not_found,
                       openai_prompt_cache_diagnostics)
from .shape import PromptShape

PROVIDERS = ("anthropic", "openai")


def extension(comparison: Comparison, detail: TokenDetail | None = None, *,
              cached_tokens: int | None = None) -> dict:
    """The ``kvlab`` extension object: the structural comparison, the token-level detail when
    both prompts' tokens are known, and the tokens the server really reused.

    Example:
        >>> extension(Comparison(None), cached_tokens=12)["cached_tokens"]
        12
    """
    out = {"comparison": comparison.to_dict()}
    if detail is not None:
        out.update(detail.to_dict())
    if cached_tokens is not None:
        out["cached_tokens"] = cached_tokens
    return out


def system_messages(shape: PromptShape, tokens) -> int:
    """How many leading rendered messages are the request's system prompt: the leading
    system/developer spans of ``tokens`` when the request has one, else 0."""
    spans = getattr(tokens, "spans", ())
    if shape.system is None:
        return 0
    n = 0
    while n < len(spans) and spans[n].role in ("system", "developer"):
        n += 1
    return n


def diagnose(log: FingerprintLog, wanted_id: str | None, shape: PromptShape, tokens, *,
             cached_tokens: int, provider: str = "anthropic", now: float | None = None) -> dict | None:
    """The provider's diagnostics object for the current request (``shape`` and its rendered
    ``tokens``, ``Tokens`` or ids or None) compared with the request remembered as ``wanted_id``.

    Anthropic: None when nothing diverged or ``wanted_id`` is None (the first turn). OpenAI:
    None when ``wanted_id`` is None (nothing was asked). Token counts come from the two rendered
    prompts; without tokens on either side they are 0 and the extension has no token detail.
    The caller remembers the current request under its own response id afterwards."""
    if provider not in PROVIDERS:
        raise DiagnosticsError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    if wanted_id is None:
        return None
    entry = log.get(wanted_id, now=now)
    if entry is None or entry.shape is None:
        return anthropic_not_found() if provider == "anthropic" else openai_not_found()
    comparison = compare(entry.shape, shape)
    detail = None
    if entry.tokens is not None and tokens is not None:
        detail = token_detail(entry.tokens, tokens, system_messages=system_messages(shape, tokens))
    lost = detail.lost_tokens if detail else 0
    if provider == "anthropic":
        return anthropic_diagnostics(comparison, lost, extension(comparison, detail, cached_tokens=cached_tokens))
    reusable = detail.previous_tokens if detail else None
    return openai_prompt_cache_diagnostics(comparison, cached_tokens, lost, reusable,
                                           extension(comparison, detail))


def answer(log: FingerprintLog, wanted_id: str | None, shape: PromptShape, tokens, *,
           cached_tokens: int | None, provider: str, extra: dict | None = None, render=None,
           now: float | None = None) -> tuple[dict | None, dict | None]:
    """What a server answers a client that asked for diagnostics, as (the provider's object,
    kvlab's detail to put beside an Anthropic null): ``diagnose`` with ``extra`` (what the
    caller knows besides, such as what its store did) in the ``kvlab`` extension and in a
    not-found answer, and ``cached_tokens`` as reported (None: not known yet; counted as 0).
    ``render(previous_tokens)`` turns the remembered tokens into ``Tokens`` with text when they
    were remembered as bare ids. The first turn's opt-in (``wanted_id`` None) answers
    (None, ``extra``).

    Example:
        >>> from kvlab.diagnostics import shape_of
        >>> log = FingerprintLog(clock=lambda: 0.0)
        >>> s = shape_of({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
        ...              "anthropic")
        >>> answer(log, None, s, None, cached_tokens=0, provider="anthropic", extra={"store": "radix"})
        (None, {'store': 'radix'})
        >>> answer(log, "msg_404", s, None, cached_tokens=0, provider="openai")[0]["type"]
        'comparison_response_not_found'
    """
    if provider not in PROVIDERS:
        raise DiagnosticsError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    if wanted_id is None:
        return None, extra
    entry = log.get(wanted_id, now=now)
    if entry is None or entry.shape is None:
        return (anthropic_not_found(extra) if provider == "anthropic" else openai_not_found(extra)), None
    comparison = compare(entry.shape, shape)
    detail = None
    if entry.tokens is not None and tokens is not None:
        previous = render(entry.tokens) if render is not None else entry.tokens
        detail = token_detail(previous, tokens, system_messages=system_messages(shape, tokens))
    lost = detail.lost_tokens if detail else 0
    ext = {**extension(comparison, detail), **(extra or {}), "cached_tokens": cached_tokens}
    if provider == "anthropic":
        value = anthropic_diagnostics(comparison, lost, ext)
        return (value, None) if value is not None else (None, ext)
    reusable = detail.previous_tokens if detail else None
    obj = openai_prompt_cache_diagnostics(comparison, cached_tokens or 0, lost, reusable, ext)
    obj["kvlab"]["cached_tokens"] = cached_tokens  # None stays None: not known yet
    return obj, None


def not_found(obj: dict | None) -> bool:
    """True for either provider's not-found answer.

    Example:
        >>> not_found(anthropic_not_found()), not_found(openai_not_found()), not_found(None)
        (True, True, False)
    """
    if not obj:
        return False
    kind = (obj.get("cache_miss_reason") or {}).get("type") if "cache_miss_reason" in obj else obj.get("type")
    return kind in ("previous_message_not_found", "comparison_response_not_found")


__all__ = ["PROVIDERS", "answer", "diagnose", "extension", "not_found", "system_messages"]
