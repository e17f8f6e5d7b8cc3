"""kvlab.diagnostics without a model: request shapes, compare(), the providers' objects (exact
dicts), the request readers, FingerprintLog and diagnose(). Each test names the mutant (a broken
implementation) it catches."""

from __future__ import annotations

import doctest
import importlib
from collections import OrderedDict

import pytest

import kvlab as kv
from kvlab.diagnostics import (Comparison, FingerprintLog, ToolDef, ToolsChange, anthropic_diagnostics,
                               anthropic_not_found, anthropic_request, anthropic_unavailable, compare,
                               diagnose, openai_not_found, openai_prompt_cache_diagnostics, openai_request,
                               openai_unavailable, shape_of, token_detail, tools_change)
from kvlab.errors import DiagnosticsError, KvlabError

TOOL_A = {"name": "Read", "description": "read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
TOOL_B = {"name": "Grep", "description": "search", "input_schema": {"type": "object"}}
TOOL_C = {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}


def anthropic(system="You are helpful.", tools=(TOOL_A, TOOL_B), messages=None, model="claude", **kw):
    body = {"model": model, "max_tokens": 16, "system": system, "tools": list(tools),
            "messages": messages or [{"role": "user", "content": "Hi"}]}
    body.update(kw)
    return shape_of(body, "anthropic")


# ------------------------------------------------------------------------------------- shapes

def test_equal_prompts_compare_equal_whatever_the_spelling():
    # mutant: content blocks kept as raw dicts (string vs [text block] differ) -> first assert fails;
    # mutant: tool-call arguments compared as sent (JSON string vs object) -> second fails;
    # mutant: cache_control kept in tool definitions -> third fails
    as_string = anthropic(messages=[{"role": "user", "content": "Hi"}])
    as_blocks = anthropic(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert as_string == as_blocks
    chat_a = shape_of({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}]}, "chat")
    chat_b = shape_of({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":2,"b":1}'}}]}]}, "chat")
    assert chat_a == chat_b
    assert chat_a.messages[0].parts == (("tool_call", "c1", "f", '{"a":2,"b":1}'),)
    marked = dict(TOOL_B, cache_control={"type": "ephemeral"})
    assert anthropic(tools=(TOOL_A, marked)) == anthropic(tools=(TOOL_A, TOOL_B))


def test_anthropic_shape_fields():
    # mutant: system blocks joined without a newline, tool_use/tool_result parts lost -> values differ
    s = shape_of({"model": "claude", "max_tokens": 8,
                  "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {}}],
                  "tools": [TOOL_A], "tool_choice": {"type": "auto"},
                  "messages": [{"role": "user", "content": "list"},
                               {"role": "assistant", "content": [
                                   {"type": "thinking", "thinking": "hmm", "signature": "x"},
                                   {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a"}}]},
                               {"role": "user", "content": [
                                   {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]}, "anthropic")
    assert (s.model, s.system, s.tool_names) == ("claude", "A\nB", ("Read",))
    assert [m.role for m in s.messages] == ["user", "assistant", "user"]
    assert s.messages[1].parts == (("thinking", "hmm"), ("tool_call", "t1", "Read", '{"path":"a"}'))
    assert s.messages[2].parts == (("tool_result", "t1", "42"),)
    assert s.settings == (("tool_choice", '{"type":"auto"}'),)


def test_chat_and_responses_shape_fields():
    # mutant: the leading system message kept as a message (or `instructions` ignored) -> system None
    chat = shape_of({"model": "m", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"}, {"role": "system", "content": "late"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "prompt_cache_key": "k1"}, "chat")
    assert (chat.system, chat.tool_names, chat.settings) == ("S", ("f",), (("prompt_cache_key", '"k1"'),))
    assert [(m.role, m.parts) for m in chat.messages] == [
        ("user", (("text", "Q"),)), ("tool", (("tool_result", "c1", "out"),)), ("system", (("text", "late"),))]
    resp = shape_of({"model": "m", "instructions": "S", "reasoning": {"effort": "high"},
                     "text": {"verbosity": "low"}, "tools": [{"type": "function", "name": "g"}],
                     "input": [{"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
                               {"type": "function_call", "call_id": "c1", "name": "g", "arguments": "{}"},
                               {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
                    "responses")
    assert (resp.system, resp.tool_names) == ("S", ("g",))
    assert resp.settings == (("reasoning_effort", '"high"'), ("verbosity", '"low"'))
    assert [m.parts for m in resp.messages] == [
        (("text", "Q"),), (("tool_call", "c1", "g", "{}"),), (("tool_result", "c1", "ok"),)]
    assert shape_of({"model": "m", "input": "Hi"}, "responses").messages[0].parts == (("text", "Hi"),)


@pytest.mark.parametrize("body, api, words", [
    ([], "chat", "JSON object"),
    ({"messages": "hi"}, "chat", "list"),
    ({"messages": [{"content": "x"}]}, "anthropic", r"messages\[0\] must be an object with a string .role."),
    ({"messages": [], "system": 5}, "anthropic", "system must be a string"),
    ({"input": 3}, "responses", "input must be"),
    ({"messages": [], "tools": {"a": 1}}, "chat", "tools must be a list"),
    ({}, "gemini", "api must be one of"),
])
def test_bad_bodies_are_kvlab_errors_that_say_what_is_wrong(body, api, words):
    # mutant: no validation (KeyError/AttributeError escape) -> not a DiagnosticsError
    with pytest.raises(DiagnosticsError, match=words) as e:
        shape_of(body, api)
    assert isinstance(e.value, KvlabError) and e.value.status == 400


# ------------------------------------------------------------------------------------ compare

def test_compare_types_in_provider_order():
    # mutant: checks in another order (messages before system...) -> type differs on multi-change
    base = anthropic()
    assert compare(base, base) == Comparison(None, (), "claude", "claude", None, None, (), None, "same", 1, 1, False)
    both = compare(base, anthropic(model="other", system="You are terse."))
    assert (both.type, both.changed) == ("model_changed", ("model_changed", "system_changed"))
    assert (both.previous_model, both.current_model) == ("claude", "other")
    sys_ = compare(base, anthropic(system="You are helpless."))
    # "You are help" is shared: the change starts at character 12
    assert (sys_.type, sys_.system_char) == ("system_changed", 12)
    assert compare(base, anthropic(tool_choice={"type": "any"})).type == "settings_changed"


def test_tools_changes_are_named():
    # mutant: reordering not detected (set comparison) -> reordered False; mutant: tools sorted
    # by name in the shape -> no change at all
    assert compare(anthropic(tools=(TOOL_A, TOOL_B)), anthropic(tools=(TOOL_B, TOOL_A))).tools == ToolsChange(
        (), (), True, ())
    grown = compare(anthropic(tools=(TOOL_A, TOOL_B)), anthropic(tools=(TOOL_A, TOOL_C)))
    assert (grown.type, grown.tools) == ("tools_changed", ToolsChange(("Bash",), ("Grep",), False, ()))
    edited = dict(TOOL_A, description="read any file")
    assert compare(anthropic(), anthropic(tools=(edited, TOOL_B))).tools == ToolsChange((), (), False, ("Read",))
    assert str(ToolsChange(("Bash",), ("Grep",), True, ("Read",))) == (
        "added Bash; removed Grep; reordered; definition of Read changed")
    assert tools_change((ToolDef("a", "{}"),), (ToolDef("a", "{}"),)) is None


def test_appending_is_a_hit_editing_or_removing_is_not():
    # mutant: any difference in messages is a miss -> the appended case is messages_changed;
    # mutant: index of the last message instead of the first changed one -> message_index 2
    turn1 = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    turn2 = turn1 + [{"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    grown = compare(anthropic(messages=turn1), anthropic(messages=turn2))
    assert (grown.type, grown.messages, grown.message_index) == (None, "appended", None)
    assert grown.describe() == "no change: 2 message(s) appended"
    edited = [turn2[0], {"role": "assistant", "content": "B"}] + turn2[2:]
    e = compare(anthropic(messages=turn2), anthropic(messages=edited))
    assert (e.type, e.messages, e.message_index) == ("messages_changed", "edited", 1)
    r = compare(anthropic(messages=turn2), anthropic(messages=turn1))
    assert (r.type, r.messages, r.message_index) == ("messages_changed", "removed", 3)
    assert r.to_dict() == {"type": "messages_changed", "changed": ["messages_changed"],
                           "description": "message 3 removed (not only appended)", "messages": "removed",
                           "message_index": 3, "previous_messages": 5, "current_messages": 3}


# ---------------------------------------------------------------------------- provider objects

def test_anthropic_objects_exactly():
    # mutant: a count on unavailable, or no null on a hit, or "kvlab" outside the object -> dicts differ
    miss = compare(anthropic(), anthropic(tools=(TOOL_B, TOOL_A)))
    assert anthropic_diagnostics(miss, 812) == {
        "cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 812}}
    assert anthropic_diagnostics(miss, 812, {"token_index": 40}) == {
        "cache_miss_reason": {"type": "tools_changed", "cache_missed_input_tokens": 812},
        "kvlab": {"token_index": 40}}
    assert anthropic_diagnostics(compare(anthropic(), anthropic()), 0) is None
    settings_only = compare(anthropic(), anthropic(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert anthropic_diagnostics(settings_only, 50) == {"cache_miss_reason": {"type": "unavailable"}}
    assert anthropic_not_found() == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert anthropic_unavailable({"x": 1}) == {"cache_miss_reason": {"type": "unavailable"}, "kvlab": {"x": 1}}
    with pytest.raises(DiagnosticsError, match="missed_tokens must be an integer >= 0"):
        anthropic_diagnostics(miss, -1)


def test_openai_objects_exactly():
    # mutant: system changes reported as system_changed (not an OpenAI reason), or settings
    # precedence ignored -> reason differs; mutant: reusable None written as null -> key present
    sys_miss = compare(anthropic(), anthropic(system="Now it is 10:42."))
    assert openai_prompt_cache_diagnostics(sys_miss, 0, 900, 1000) == {
        "type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 900,
        "comparison_reusable_tokens": 1000}
    assert openai_prompt_cache_diagnostics(sys_miss, 0, 900, None) == {
        "type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 900}
    chat = lambda **kw: shape_of({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}, "chat")
    key_and_tools = compare(chat(prompt_cache_key="a"), chat(
        prompt_cache_key="b", tools=[{"type": "function", "function": {"name": "f"}}]))
    assert openai_prompt_cache_diagnostics(key_and_tools, 0, 5, 6)["reason"] == "prompt_cache_key_changed"
    assert openai_prompt_cache_diagnostics(compare(chat(), chat(service_tier="flex")), 0, 1, 1)["reason"] == (
        "service_tier_changed")
    assert openai_prompt_cache_diagnostics(compare(chat(), chat(tool_choice="none")), 3, 0, 9) == {
        "type": "cache_hit"}
    assert openai_prompt_cache_diagnostics(compare(chat(), chat()), 7, 0, 9, {"token_index": None}) == {
        "type": "cache_hit", "kvlab": {"token_index": None, "cached_tokens": 7}}
    # mutant: compaction not recognised -> input_changed instead of context_compacted
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    compacted = [{"type": "compaction", "encrypted_content": "opaque"}, {"role": "user", "content": "c"}]
    resp = lambda items: shape_of({"model": "m", "instructions": "S", "input": items}, "responses")
    c = compare(resp(history), resp(compacted))
    assert (c.type, c.message_index, c.compacted) == ("messages_changed", 0, True)
    assert openai_prompt_cache_diagnostics(c, 0, 7, 9)["reason"] == "context_compacted"
    assert openai_prompt_cache_diagnostics(compare(resp(history), resp(history[:2])), 0, 1, 9)["reason"] == (
        "input_changed")
    assert openai_not_found() == {"type": "comparison_response_not_found"}
    assert openai_unavailable() == {"type": "unavailable"}


# ------------------------------------------------------------------------------ request readers

@pytest.mark.parametrize("body, headers, expected", [
    ({"messages": []}, {}, (False, None)),
    ({"diagnostics": None}, {}, (False, None)),
    ({"diagnostics": {"previous_message_id": None}}, {}, (True, None)),
    ({"diagnostics": {}}, {}, (True, None)),
    ({"diagnostics": {"previous_message_id": "msg_01"}}, {"anthropic-beta": "cache-diagnosis-2026-04-07"},
     (True, "msg_01")),
])
def test_anthropic_request(body, headers, expected):
    # mutant: a null previous_message_id treated as "not asked" -> (False, None) on the first turn
    assert anthropic_request(body, headers) == expected


def test_anthropic_request_beta_header_and_bad_ids():
    # mutant: require_beta_header ignored -> (True, ...) without the header; mutant: a numeric id
    # passed through -> no error (and a later lookup that can never match)
    body = {"diagnostics": {"previous_message_id": "msg_01"}}
    assert anthropic_request(body, {"Anthropic-Beta": "x, cache-diagnosis-2026-04-07"},
                             require_beta_header=True) == (True, "msg_01")
    assert anthropic_request(body, {}, require_beta_header=True) == (False, None)
    with pytest.raises(DiagnosticsError, match="previous_message_id must be a non-empty string"):
        anthropic_request({"diagnostics": {"previous_message_id": 17}})
    with pytest.raises(DiagnosticsError, match="diagnostics must be an object"):
        anthropic_request({"diagnostics": "msg_01"})


def test_openai_request():
    # mutant: prompt_cache_options without a comparison id counted as asking -> (True, None)
    assert openai_request({"prompt_cache_options": {"comparison_response_id": "resp_9"}}) == (True, "resp_9")
    assert openai_request({"prompt_cache_options": {"ttl": "30m"}}) == (False, None)
    assert openai_request({"input": "x"}) == (False, None)
    with pytest.raises(DiagnosticsError, match="comparison_response_id must be a non-empty string"):
        openai_request({"prompt_cache_options": {"comparison_response_id": ["resp_9"]}})
    with pytest.raises(DiagnosticsError, match="prompt_cache_options must be an object"):
        openai_request({"prompt_cache_options": "resp_9"})


# ------------------------------------------------------------------------------- the log

def test_log_expiry_and_bound():
    # mutant: no expiry -> the entry at t=101 is still there; mutant: newest evicted first ->
    # "b" gone instead of "a"; mutant: re-remembering does not refresh the order -> "a" evicted
    log = FingerprintLog(max_entries=2, ttl_s=100, clock=lambda: 0.0)
    log.remember("a", None, [1], now=0)
    assert log.get("a", now=100).tokens == (1,)
    assert log.get("a", now=101) is None and len(log) == 0
    log.remember("a", None, [1], now=0)
    log.remember("b", None, [2], now=1)
    log.remember("a", None, [3], now=2)
    log.remember("c", None, [4], now=3)
    assert (log.get("b", now=3), log.get("a", now=3).tokens, log.get("c", now=3).tokens) == (None, (3,), (4,))
    assert log.get("never", now=0) is None and log.get(12, now=0) is None


def test_log_clock_and_bad_arguments():
    # mutant: `now` ignored in favour of the clock -> expiry decided by the wrong time
    t = [0.0]
    log = FingerprintLog(ttl_s=10, clock=lambda: t[0])
    log.remember("a", None, None)
    t[0] = 10.5
    assert "a" not in log
    for kw, words in (({"max_entries": 0}, "max_entries"), ({"ttl_s": 0}, "ttl_s"), ({"ttl_s": True}, "ttl_s")):
        with pytest.raises(DiagnosticsError, match=words):
            FingerprintLog(**kw)
    with pytest.raises(DiagnosticsError, match="non-empty string"):
        log.remember("", None)


def test_log_changes_its_entries_only_under_its_lock():
    # mutant: no lock (or a lock not taken around a change) -> the checking dict sees an unheld
    # lock; checked deterministically, without racing threads
    log = FingerprintLog(max_entries=1, clock=lambda: 0.0)

    class Checked(OrderedDict):
        def __setitem__(self, k, v):
            assert log._lock.locked(), "entries changed outside the lock"
            super().__setitem__(k, v)

        def __delitem__(self, k):
            assert log._lock.locked(), "entries changed outside the lock"
            super().__delitem__(k)

        def pop(self, *a):
            assert log._lock.locked(), "entries changed outside the lock"
            return super().pop(*a)

        def popitem(self, last=True):
            assert log._lock.locked(), "entries changed outside the lock"
            return super().popitem(last)

    log._entries = Checked()
    log.remember("a", None, [1], now=0)
    log.remember("b", None, [2], now=0)
    assert log.get("b", now=10**9) is None and len(log) == 0


# ------------------------------------------------------------------------------- diagnose

def test_diagnose_anthropic_end_to_end():
    # mutant: missed tokens counted from the current prompt instead of the previous one -> 4 not 3;
    # mutant: an unknown id raises -> no not-found object
    log = FingerprintLog(ttl_s=300, clock=lambda: 0.0)
    log.remember("msg_1", anthropic(), [10, 11, 12, 13, 14], now=0)
    now = anthropic(tools=(TOOL_B, TOOL_A))
    d = diagnose(log, "msg_1", now, [10, 11, 99, 98, 97, 96], cached_tokens=2, now=5)
    assert d["cache_miss_reason"] == {"type": "tools_changed", "cache_missed_input_tokens": 3}
    k = d["kvlab"]
    assert (k["token_index"], k["reusable_tokens"], k["lost_tokens"], k["missed_tokens"], k["cached_tokens"]) == (
        2, 2, 3, 4, 2)
    assert k["comparison"]["tools"] == {"added": [], "removed": [], "reordered": True, "schema_changed": []}
    assert diagnose(log, "msg_1", anthropic(), [10, 11, 12, 13, 14, 15], cached_tokens=5, now=5) is None
    assert diagnose(log, "msg_1", now, [1], cached_tokens=0, now=301) == {
        "cache_miss_reason": {"type": "previous_message_not_found"}}
    assert diagnose(log, None, now, [1], cached_tokens=0) is None


def test_diagnose_openai_end_to_end():
    # mutant: comparison_reusable_tokens from the current prompt -> 6 not 5
    log = FingerprintLog(clock=lambda: 0.0)
    log.remember("resp_1", anthropic(), [10, 11, 12, 13, 14])
    d = diagnose(log, "resp_1", anthropic(system="x"), [10, 11, 12, 7, 7, 7], cached_tokens=3, provider="openai")
    assert {k: v for k, v in d.items() if k != "kvlab"} == {
        "type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 2, "comparison_reusable_tokens": 5}
    assert d["kvlab"]["cached_tokens"] == 3 and d["kvlab"]["token_index"] == 3
    hit = diagnose(log, "resp_1", anthropic(), [10, 11, 12, 13, 14, 1], cached_tokens=5, provider="openai")
    assert (hit["type"], hit["kvlab"]["token_index"], hit["kvlab"]["missed_tokens"]) == ("cache_hit", None, 1)
    assert diagnose(log, "resp_404", anthropic(), [1], cached_tokens=0, provider="openai") == {
        "type": "comparison_response_not_found"}
    with pytest.raises(DiagnosticsError, match="provider must be one of"):
        diagnose(log, "resp_1", anthropic(), [1], cached_tokens=0, provider="gemini")


def test_token_detail_on_raw_ids():
    # mutant: lost/missed swapped -> (5, 3) instead of (3, 5); mutant: prefix treated as divergence
    d = token_detail([1, 2, 3, 4, 5], [1, 2, 7, 8, 9, 10, 11])
    assert (d.token_index, d.reusable_tokens, d.lost_tokens, d.missed_tokens) == (2, 2, 3, 5)
    assert d.previous == ("<1><2>", "<3><4><5>") and d.current == ("<1><2>", "<7><8><9><10><11>")
    p = token_detail([1, 2], [1, 2, 3])
    assert (p.token_index, p.reusable_tokens, p.lost_tokens, p.missed_tokens, p.previous) == (None, 2, 0, 1, ("", ""))


def test_every_public_object_shows_itself():
    # mutant: a _repr_html_ removed or raising -> this fails
    log = FingerprintLog(clock=lambda: 0.0)
    log.remember("m1", anthropic(), [1, 2])
    objects = [anthropic(), compare(anthropic(), anthropic(model="x")), token_detail([1, 2], [1, 3]), log]
    for obj in objects:
        assert obj._repr_html_().startswith("<div><b>") and repr(obj).split("(")[0] in obj._repr_html_()
    assert repr(compare(anthropic(), anthropic(model="x"))) == (
        "Comparison(model_changed: model changed from 'claude' to 'x')")
    assert kv.diagnostics.compare is compare


@pytest.mark.parametrize("name", ["kvlab.diagnostics", "kvlab.diagnostics.shape", "kvlab.diagnostics.compare",
                                  "kvlab.diagnostics.detail", "kvlab.diagnostics.provider",
                                  "kvlab.diagnostics.log", "kvlab.diagnostics.diagnose"])
def test_docstring_examples(name):
    # mutant: any documented output changed -> doctest reports the example
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
