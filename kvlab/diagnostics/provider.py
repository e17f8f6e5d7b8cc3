"""The providers' diagnostics objects, field for field, and reading what a client asked for.

Anthropic (Messages): the response's ``diagnostics`` is None when nothing diverged, else
``{"cache_miss_reason": {"type": ..., "cache_missed_input_tokens": N}}`` for the four
``*_changed`` types and ``{"cache_miss_reason": {"type": "previous_message_not_found"}}`` /
``{"type": "unavailable"}`` without a count. OpenAI (Responses): ``prompt_cache_diagnostics`` is
``{"type": "cache_hit"}``, ``{"type": "cache_miss", "reason": ..., "cache_missed_tokens": N,
"comparison_reusable_tokens": M}``, ``{"type": "comparison_response_not_found"}`` or
``{"type": "unavailable"}``. kvlab's own detail goes in a ``"kvlab"`` key inside the provider
object, which clients that do not know it ignore.

Example:
    >>> from kvlab.diagnostics.compare import Comparison
    >>> anthropic_diagnostics(Comparison("system_changed", ("system_changed",)), 1200)
    {'cache_miss_reason': {'type': 'system_changed', 'cache_missed_input_tokens': 1200}}
    >>> openai_prompt_cache_diagnostics(Comparison("system_changed", ("system_changed",)), 0, 1200, 1300)
    {'type': 'cache_miss', 'reason': 'input_changed', 'cache_missed_tokens': 1200, 'comparison_reusable_tokens': 1300}
"""

from __future__ import annotations

from ..errors import DiagnosticsError
from .compare import Comparison

ANTHROPIC_BETA = "cache-diagnosis-2026-04-07"  # GA since; still accepted, no longer required
ANTHROPIC_TYPES = ("model_changed", "system_changed", "tools_changed", "messages_changed",
                   "previous_message_not_found", "unavailable")
OPENAI_TYPES = ("cache_hit", "cache_miss", "comparison_response_not_found", "unavailable")
# OpenAI's reasons in the order its guide lists them (the first one found is reported)
OPENAI_REASONS = ("model_changed", "prompt_cache_key_changed", "service_tier_changed", "tools_changed",
                  "text_format_changed", "reasoning_effort_changed", "verbosity_changed",
                  "context_compacted", "input_changed")
_SETTING_REASONS = {"prompt_cache_key": "prompt_cache_key_changed", "service_tier": "service_tier_changed",
                    "text_format": "text_format_changed", "reasoning_effort": "reasoning_effort_changed",
                    "verbosity": "verbosity_changed"}


def _with(obj: dict, extension: dict | None) -> dict:
    if extension is not None:
        obj["kvlab"] = extension
    return obj


def _count(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise DiagnosticsError(f"{name} must be an integer >= 0, got {n!r}")
    return n


def anthropic_type(comparison: Comparison) -> str | None:
    """Anthropic's ``cache_miss_reason.type`` for a comparison, None when nothing diverged.
    A change of settings only (tool_choice, thinking, ...) is ``unavailable``, as Anthropic's
    guide says; model, system and tools come first."""
    for t in comparison.changed:
        if t == "settings_changed":
            return "unavailable"
        return t
    return None


def openai_reason(comparison: Comparison) -> str | None:
    """OpenAI's ``reason`` for a comparison, None for a hit. The system prompt and messages are
    both ``input_changed`` (``context_compacted`` when a compaction item replaced the messages);
    settings OpenAI does not name (tool_choice) are not a miss there."""
    found = set()
    if "model_changed" in comparison.changed:
        found.add("model_changed")
    if "tools_changed" in comparison.changed:
        found.add("tools_changed")
    if "system_changed" in comparison.changed or "messages_changed" in comparison.changed:
        found.add("input_changed")
    if comparison.compacted:
        found.add("context_compacted")  # listed before input_changed: it names the cause
    found.update(_SETTING_REASONS[s] for s in comparison.settings if s in _SETTING_REASONS)
    return next((r for r in OPENAI_REASONS if r in found), None)


def anthropic_diagnostics(comparison: Comparison, missed_tokens: int, extension: dict | None = None) -> dict | None:
    """The response's ``diagnostics`` value: None when nothing diverged (the provider's null;
    the extension is then not carried), else ``{"cache_miss_reason": {...}}``."""
    kind = anthropic_type(comparison)
    if kind is None:
        return None
    reason = {"type": kind}
    if kind != "unavailable":
        reason["cache_missed_input_tokens"] = _count(missed_tokens, "missed_tokens")
    return _with({"cache_miss_reason": reason}, extension)


def anthropic_not_found(extension: dict | None = None) -> dict:
    """``previous_message_not_found``: the id is unknown or its fingerprint expired."""
    return _with({"cache_miss_reason": {"type": "previous_message_not_found"}}, extension)


def anthropic_unavailable(extension: dict | None = None) -> dict:
    """``unavailable``: no comparison could be produced."""
    return _with({"cache_miss_reason": {"type": "unavailable"}}, extension)


def openai_prompt_cache_diagnostics(comparison: Comparison, cached_tokens: int, missed_tokens: int,
                                    reusable_tokens: int | None, extension: dict | None = None) -> dict:
    """The response's ``prompt_cache_diagnostics``. ``missed_tokens``: the comparison's reusable
    tokens that were not reused; ``reusable_tokens``: the comparison response's reusable prefix
    (left out when None, as OpenAI may). ``cached_tokens`` (what the server really reused) is
    not an OpenAI field: it goes in the extension, beside kvlab's detail."""
    _count(cached_tokens, "cached_tokens")
    if extension is not None:
        extension = {**extension, "cached_tokens": cached_tokens}
    reason = openai_reason(comparison)
    if reason is None:
        return _with({"type": "cache_hit"}, extension)
    obj = {"type": "cache_miss", "reason": reason, "cache_missed_tokens": _count(missed_tokens, "missed_tokens")}
    if reusable_tokens is not None:
        obj["comparison_reusable_tokens"] = _count(reusable_tokens, "reusable_tokens")
    return _with(obj, extension)


def openai_not_found(extension: dict | None = None) -> dict:
    """``comparison_response_not_found``: the id is unknown or its record expired."""
    return _with({"type": "comparison_response_not_found"}, extension)


def openai_unavailable(extension: dict | None = None) -> dict:
    """``unavailable``: the comparison could not produce a conclusive result."""
    return _with({"type": "unavailable"}, extension)


def anthropic_request(body, headers=None, *, require_beta_header: bool = False) -> tuple[bool, str | None]:
    """(wants diagnostics, previous_message_id) from a Messages request. A request opts in by
    carrying a ``diagnostics`` object; ``{"previous_message_id": null}`` opts in with nothing to
    compare (the first turn). The beta header is no longer required since the feature went GA;
    ``require_beta_header`` restores the beta behaviour (no header: no diagnostics).

    Example:
        >>> anthropic_request({"diagnostics": {"previous_message_id": "msg_1"}})
        (True, 'msg_1')
    """
    if not isinstance(body, dict) or body.get("diagnostics") is None:
        return False, None
    if require_beta_header:
        betas = ",".join(v for k, v in (headers or {}).items() if k.lower() == "anthropic-beta")
        if ANTHROPIC_BETA not in [b.strip() for b in betas.split(",")]:
            return False, None
    diag = body["diagnostics"]
    if not isinstance(diag, dict):
        raise DiagnosticsError("diagnostics must be an object like {\"previous_message_id\": \"msg_...\"} "
                               f"(or null on the first turn), got {type(diag).__name__}")
    return True, _id(diag.get("previous_message_id"), "diagnostics.previous_message_id",
                     "the id of an earlier response")


def openai_request(body) -> tuple[bool, str | None]:
    """(wants diagnostics, comparison_response_id) from a Responses or chat request: only
    ``prompt_cache_options.comparison_response_id`` asks for them.

    Example:
        >>> openai_request({"prompt_cache_options": {"comparison_response_id": "resp_1"}})
        (True, 'resp_1')
    """
    if not isinstance(body, dict) or body.get("prompt_cache_options") is None:
        return False, None
    opts = body["prompt_cache_options"]
    if not isinstance(opts, dict):
        raise DiagnosticsError("prompt_cache_options must be an object like "
                               "{\"comparison_response_id\": \"resp_...\"}, got " + type(opts).__name__)
    found = _id(opts.get("comparison_response_id"), "prompt_cache_options.comparison_response_id",
                "the id of an earlier completed response")
    return found is not None, found


def _id(value, where: str, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise DiagnosticsError(f"{where} must be a non-empty string ({what}) or null, got {value!r}")
    return value


__all__ = ["ANTHROPIC_BETA", "ANTHROPIC_TYPES", "OPENAI_REASONS", "OPENAI_TYPES", "anthropic_diagnostics",
           "anthropic_not_found", "anthropic_request", "anthropic_type", "anthropic_unavailable",
           "openai_not_found", "openai_prompt_cache_diagnostics", "openai_reason", "openai_request",
           "openai_unavailable"]
