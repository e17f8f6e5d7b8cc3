"""kvlab.diagnostics on real rendered prompts (the tiny model's Qwen tokenizer and chat template):
the token index where two requests' prompts diverge, the message it falls in and the text around
it, inside the providers' objects."""

from __future__ import annotations

import pytest

import kvlab as kv
import kvlab.diagnostics as dx
from kvlab.serving.anthropic import to_chat
from kvlab.workloads.generators import BILLING_HEADER

pytestmark = pytest.mark.model

AGENT = "You are a careful coding agent. Keep answers short."
TOOLS = [{"name": n, "description": f"{n} a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}} for n in ("Read", "Grep")]
ASK = [{"role": "user", "content": "Fix the failing test in tests/test_app.py"}]


def body(system, tools=(), messages=ASK):
    return {"model": "tiny", "max_tokens": 8, "system": system, "tools": list(tools), "messages": list(messages)}


def rendered(model, b):
    chat = to_chat(b)
    return kv.tokenise(model, chat["messages"], tools=chat.get("tools"))


def test_billing_header_diverges_at_the_cch_value(tiny):
    # mutant: token index taken from the structural comparison (or off by one) -> not 35;
    # mutant: text taken around the end of the prompt -> the 'before' text is not the header
    first, second = (body([{"type": "text", "text": BILLING_HEADER.format(cch=c)}, {"type": "text", "text": AGENT}])
                     for c in ("eb6c6", "1f2a9"))
    ta, tb = rendered(tiny, first), rendered(tiny, second)
    # independent check of the expected index: the ids agree up to 35 and differ there
    assert ta.ids[:35] == tb.ids[:35] and ta.ids[35] != tb.ids[35] and (len(ta), len(tb)) == (70, 71)
    log = dx.FingerprintLog(clock=lambda: 0.0)
    log.remember("msg_1", dx.shape_of(first, "anthropic"), ta)
    d = dx.diagnose(log, "msg_1", dx.shape_of(second, "anthropic"), tb, cached_tokens=35)
    assert d["cache_miss_reason"] == {"type": "system_changed", "cache_missed_input_tokens": 35}
    k = d["kvlab"]
    # inside the system prompt: no request message, rendered message 0
    assert (k["token_index"], k["message_index"], k["role"], k["rendered_message_index"]) == (35, None, "system", 0)
    assert (k["reusable_tokens"], k["lost_tokens"], k["missed_tokens"], k["cached_tokens"]) == (35, 35, 36, 35)
    assert k["previous_text"] == {"before": "ion=2.1.100.7b4; cc_entrypoint=cli; cch=",
                                  "after": "eb6c6;\nYou are a careful coding agent. K"}
    assert k["current_text"] == {"before": "ion=2.1.100.7b4; cc_entrypoint=cli; cch=",
                                 "after": "1f2a9;\nYou are a careful coding agent. K"}
    # "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch=" is 75 characters
    assert k["comparison"]["system_char"] == 75


def test_reordered_tools_diverge_inside_the_rendered_tool_list(tiny):
    # mutant: tools sorted by name when shaped -> a hit; mutant: message index from the previous
    # prompt's spans when they differ -> still 0 here, so the role/text asserts carry it
    first, second = body(AGENT, TOOLS), body(AGENT, TOOLS[::-1])
    ta, tb = rendered(tiny, first), rendered(tiny, second)
    assert ta.ids[:62] == tb.ids[:62] and ta.ids[62] != tb.ids[62] and len(ta) == 204
    log = dx.FingerprintLog(clock=lambda: 0.0)
    log.remember("resp_1", dx.shape_of(first, "anthropic"), ta)
    d = dx.diagnose(log, "resp_1", dx.shape_of(second, "anthropic"), tb, cached_tokens=0, provider="openai")
    assert {k: v for k, v in d.items() if k != "kvlab"} == {
        "type": "cache_miss", "reason": "tools_changed", "cache_missed_tokens": 204 - 62,
        "comparison_reusable_tokens": 204}
    k = d["kvlab"]
    assert (k["token_index"], k["message_index"], k["role"], k["rendered_message_index"]) == (62, None, "system", 0)
    assert k["previous_text"]["after"].startswith('Read", "description": "Read a file"')
    assert k["current_text"]["after"].startswith('Grep", "description": "Grep a file"')
    assert k["comparison"]["tools"] == {"added": [], "removed": [], "reordered": True, "schema_changed": []}


def test_an_appended_turn_is_a_hit_with_the_whole_previous_prompt_reusable(tiny):
    # mutant: appended messages reported as messages_changed -> not a hit; mutant: reusable
    # counted on the current prompt -> not len(previous)
    turn2 = ASK + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
    first, second = body(AGENT, messages=ASK), body(AGENT, messages=turn2)
    ta, tb = rendered(tiny, first), rendered(tiny, second)
    log = dx.FingerprintLog(clock=lambda: 0.0)
    log.remember("msg_1", dx.shape_of(first, "anthropic"), ta)
    assert dx.diagnose(log, "msg_1", dx.shape_of(second, "anthropic"), tb, cached_tokens=len(ta)) is None
    detail = dx.token_detail(ta, tb)
    assert (detail.token_index, detail.reusable_tokens, detail.lost_tokens) == (None, len(ta), 0)
    assert detail.missed_tokens == len(tb) - len(ta) > 0


def test_a_dropped_message_is_placed_in_the_current_prompt(tiny):
    # mutant: message and role taken from the previous prompt's spans -> 'assistant', not 'user';
    # mutant: the rendered index reported as the request's -> 2 (the system prompt is rendered
    # message 0), where the structural comparison says 1
    turn2 = ASK + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
    dropped = ASK + [{"role": "user", "content": "Thanks"}]
    first, second = body(AGENT, messages=turn2), body(AGENT, messages=dropped)
    ta, tb = rendered(tiny, first), rendered(tiny, second)
    log = dx.FingerprintLog(clock=lambda: 0.0)
    log.remember("msg_1", dx.shape_of(first, "anthropic"), ta)
    d = dx.diagnose(log, "msg_1", dx.shape_of(second, "anthropic"), tb, cached_tokens=0)
    k = d["kvlab"]
    assert d["cache_miss_reason"]["type"] == "messages_changed"
    assert (k["comparison"]["messages"], k["comparison"]["message_index"]) == ("edited", 1)
    assert (k["message_index"], k["role"], k["rendered_message_index"]) == (1, "user", 2)
    assert k["previous_text"]["after"].startswith("assistant\nDone.")
    assert k["current_text"]["after"].startswith("user\nThanks")
    assert d["cache_miss_reason"]["cache_missed_input_tokens"] == len(ta) - k["token_index"]
