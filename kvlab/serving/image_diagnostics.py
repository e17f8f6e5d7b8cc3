"""Cache diagnostics for VLM requests: two prompts with identical token ids can still differ,
in an image's pixels (vllm-mlx#718), and no id comparison sees it.

``kvlab.diagnostics`` compares the rendered token ids of a request and the one it names. For a
served VLM the ledger also keeps each request's image keys (``(token_start, token_end, pixel
hash)``, the extra keys of its ``kv.cache_key``); ``with_images`` cuts the comparison back to the
first image whose key differs, when that comes before the ids diverge: the reusable prefix, the
lost and missed tokens, the provider's missed-token count, and a sentence naming the image.

Example:
    >>> first_difference(((19, 25, "aa"),), ((19, 25, "bb"),))
    (19, 0)
"""

from __future__ import annotations


def first_difference(previous, current) -> tuple[int, int] | None:
    """(token position, image index) of the first image key that differs between two requests'
    image spans, or None when they are the same images at the same places."""
    for i in range(max(len(previous), len(current))):
        a = previous[i] if i < len(previous) else None
        b = current[i] if i < len(current) else None
        if a != b:
            return min(x[0] for x in (a, b) if x is not None), i
    return None


def with_images(fields: dict, previous, current) -> dict:
    """``fields`` (what ServedDiagnostics answers: ``prompt_cache_diagnostics``, or Anthropic's
    ``diagnostics`` / ``kvlab_diagnostics``) with the token comparison cut back to the first
    image that differs, if it differs before the ids do. Changed in place and returned."""
    found = first_difference(tuple(previous), tuple(current))
    obj = fields.get("prompt_cache_diagnostics") or fields.get("diagnostics") or {}
    ext = obj.get("kvlab") or fields.get("kvlab_diagnostics")
    if found is None or not isinstance(ext, dict) or ext.get("reusable_tokens") is None:
        return fields
    pos, i = found
    if ext["reusable_tokens"] <= pos:
        return fields  # the ids diverge first: the id comparison already says where
    lost = ext["previous_tokens"] - pos
    ext.update(token_index=pos, reusable_tokens=pos, lost_tokens=lost, missed_tokens=ext["current_tokens"] - pos)
    before = previous[i][2][:12] if i < len(previous) else "none"
    after = current[i][2][:12] if i < len(current) else "none"
    ext["image"] = (f"image {i} at token {pos} differs from the compared request's (pixel sha256 "
                    f"{before}... -> {after}...): the same token ids with other pixels, so the KV from "
                    "there on cannot be reused")
    if "cache_missed_tokens" in obj:
        obj["cache_missed_tokens"] = lost
    reason = obj.get("cache_miss_reason")
    if isinstance(reason, dict) and "cache_missed_input_tokens" in reason:
        reason["cache_missed_input_tokens"] = lost
    return fields
