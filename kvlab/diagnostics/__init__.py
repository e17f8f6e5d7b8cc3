"""Why did this request miss the prompt cache? The providers' cache diagnostics, answered
locally, model-free, for ``kvlab serve`` and a proxy in front of any server.

Shapes followed field for field (looked up 2026-11-26):

- Anthropic, "Cache diagnostics", https://platform.claude.com/docs/en/build-with-claude/cache-diagnostics
  and the Messages API reference (``Message.diagnostics``, ``CacheMiss*`` types). Request:
  ``"diagnostics": {"previous_message_id": "<id>" | null}`` ("On the first turn, pass
  ``previous_message_id: null`` to opt in without a prior message to compare against"); the
  beta header ``cache-diagnosis-2026-04-07`` is still accepted but no longer needed. Response
  ``diagnostics``: ``null`` when "``previous_message_id`` was ``null`` (first turn, nothing to
  compare), or a comparison ran and found no divergence"; else ``{"cache_miss_reason": {"type":
  "model_changed" | "system_changed" | "tools_changed" | "messages_changed",
  "cache_missed_input_tokens": N}}`` (N: "approximate number of input tokens that would have been
  read from cache had the prefix matched the previous request") or ``{"cache_miss_reason":
  {"type": "previous_message_not_found" | "unavailable"}}``. "In streaming responses,
  ``diagnostics`` appears on the ``message_start`` event" (in its ``message``). "``unavailable``
  ... includes the case where ``model``, ``system``, and ``tools`` match but another
  prompt-affecting request parameter (``tool_choice``, ``thinking``, ...) differs".
- OpenAI, "Prompt cache diagnostics",
  https://developers.openai.com/api/docs/guides/prompt-caching/diagnostics (Responses API; types
  as in the SDKs' ``PromptCacheDiagnostics``). Request: ``"prompt_cache_options":
  {"comparison_response_id": "<id>"}``. Response ``prompt_cache_diagnostics``: ``{"type":
  "cache_hit"}``; ``{"type": "cache_miss", "reason": ..., "cache_missed_tokens": N,
  "comparison_reusable_tokens": M}`` (M optional: "the comparison response's ``cached_tokens +
  cache_write_tokens``"; N "estimates how many of the comparison response's reusable tokens were
  not reused"); ``{"type": "comparison_response_not_found"}`` ("missing or expired");
  ``{"type": "unavailable"}``. Reasons, in the guide's order: model_changed,
  prompt_cache_key_changed, service_tier_changed, tools_changed, text_format_changed,
  reasoning_effort_changed, verbosity_changed, context_compacted, input_changed (instructions
  and edited messages are both input_changed; a ``compaction`` input item replacing them is
  context_compacted). "When ``stream=True``, read
  ``prompt_cache_diagnostics`` from ``event.response`` in the ``response.completed`` event."

kvlab adds what only it knows in a ``"kvlab"`` key inside the provider object: the structural
comparison (which tools were added / removed / reordered, which message was edited), the token
index where the two rendered prompts diverge with ~40 characters either side, the message it
falls in (``message_index`` counts the request's ``messages`` array like the comparison does;
``rendered_message_index`` counts rendered messages, the system prompt being 0), and token
counts (``reusable_tokens``: the common prefix; ``lost_tokens``: previous-prompt tokens after it,
the providers' "missed"; ``missed_tokens``: current-prompt tokens to prefill again;
``cached_tokens``: what the server really reused). Anthropic's ``null`` (nothing diverged) has no
room for it: a server that wants kvlab's detail then puts ``extension(...)`` beside it.

Pieces: ``shape_of`` (request body -> ``PromptShape``), ``compare`` -> ``Comparison``,
``token_detail`` -> ``TokenDetail``, ``dominant_miss`` -> ``DominantMiss`` (a whole run's
main divergence, its volatile field and the rule that fixes it), the provider objects (``anthropic_diagnostics``,
``openai_prompt_cache_diagnostics`` and their not-found / unavailable forms), the request
readers (``anthropic_request``, ``openai_request``), ``FingerprintLog`` and ``diagnose``.

Example:
    >>> import kvlab.diagnostics as dx
    >>> log = dx.FingerprintLog()
    >>> first = {"model": "m", "max_tokens": 8, "system": "Today is Monday.",
    ...          "messages": [{"role": "user", "content": "Hi"}], "diagnostics": {"previous_message_id": None}}
    >>> log.remember("msg_1", dx.shape_of(first, "anthropic"), [5, 6, 7, 8])
    >>> second = dict(first, system="Today is Tuesday.", diagnostics={"previous_message_id": "msg_1"})
    >>> wants, previous = dx.anthropic_request(second)
    >>> d = dx.diagnose(log, previous, dx.shape_of(second, "anthropic"), [5, 9, 7, 8], cached_tokens=1)
    >>> d["cache_miss_reason"], d["kvlab"]["token_index"]
    ({'type': 'system_changed', 'cache_missed_input_tokens': 3}, 1)
"""

from .compare import TYPES, Comparison, ToolsChange, compare, tools_change
from .detail import TokenDetail, token_detail
from .dominant import DominantMiss, dominant_miss, request_why
from .diagnose import PROVIDERS, answer, diagnose, extension, not_found
from .log import Entry, FingerprintLog, SeenBy
from .provider import (ANTHROPIC_BETA, ANTHROPIC_TYPES, OPENAI_REASONS, OPENAI_TYPES, anthropic_diagnostics,
                       anthropic_not_found, anthropic_request, anthropic_type, anthropic_unavailable,
                       openai_not_found, openai_prompt_cache_diagnostics, openai_reason, openai_request,
                       openai_unavailable)
from .shape import APIS, Message, PromptShape, ToolDef, canonical_json, shape_of

__all__ = ["ANTHROPIC_BETA", "ANTHROPIC_TYPES", "APIS", "Comparison", "DominantMiss", "Entry", "FingerprintLog", "Message",
           "SeenBy",
           "OPENAI_REASONS", "OPENAI_TYPES", "PROVIDERS", "PromptShape", "TYPES", "TokenDetail", "ToolDef",
           "ToolsChange", "answer", "anthropic_diagnostics", "anthropic_not_found", "anthropic_request",
           "anthropic_type", "anthropic_unavailable", "canonical_json", "compare", "diagnose", "dominant_miss",
           "extension",
           "not_found", "openai_not_found", "openai_prompt_cache_diagnostics", "openai_reason", "openai_request",
           "openai_unavailable", "request_why", "shape_of", "token_detail", "tools_change"]
