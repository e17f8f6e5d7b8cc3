"""kvlab serve answers the providers' cache diagnostics (issue 19 §1): Anthropic's ``diagnostics``
on /v1/messages (JSON and on ``message_start``), OpenAI's ``prompt_cache_diagnostics`` on chat
completions (the completion object and the first chunk), kvlab's detail in a ``kvlab`` key, bad
input answered 400 / not-found (never 500), and ``GET /kvlab/requests`` per turn.

Each assertion names the mutant (broken implementation) it catches; each was checked by
breaking the code and watching the test fail."""

import json

import httpx
import pytest

import kvlab as kv
from kvlab.serving.diagnosing import ROW_FIELDS

pytestmark = [pytest.mark.serving, pytest.mark.model]

SYSTEM = "You are a careful assistant for a research lab. Answer in one short sentence. " * 2
TERSE = "You are a terse assistant. Be brief. " * 2  # another length: lost != missed tokens
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} a file", "parameters": PARAMS}}
         for name in ("read", "write")]
BETA = {"anthropic-beta": "cache-diagnosis-2026-04-07"}


def _post(server, route, body, headers=None):
    return httpx.post(server.url + route, json=body, headers=headers, timeout=120)


def _sse(server, route, body):
    """(event name, data) pairs of a streamed response, in order (pings and comments left out)."""
    events, name = [], None
    with httpx.stream("POST", server.url + route, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                events.append((name, json.loads(line[len("data: "):])))
    return [(n, d) for n, d in events if n != "ping"]


def _messages(server, system, messages, previous, **kw):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 3, "system": system, "messages": messages,
            "diagnostics": {"previous_message_id": previous}, **kw}
    r = _post(server, "/v1/messages", body, BETA)
    assert r.status_code == 200, r.text
    return r.json()


def test_anthropic_three_turns_unknown_id_and_bad_input(start):
    server = start("radix")
    m1 = [{"role": "user", "content": "What is a prefix cache?"}]
    t1 = _messages(server, SYSTEM, m1, None)
    # turn 1 opted in with nothing to compare: Anthropic's null, kvlab's store detail beside it
    assert "diagnostics" in t1 and t1["diagnostics"] is None
    assert t1["kvlab_diagnostics"]["store"]["reused_tokens"] == 0 == t1["usage"]["cache_read_input_tokens"]

    m2 = m1 + [{"role": "assistant", "content": t1["content"]}, {"role": "user", "content": "And a radix tree?"}]
    t2 = _messages(server, SYSTEM, m2, t1["id"])
    # mutant "responses not remembered": turn 2 would be previous_message_not_found; mutant
    # "fixed or reused message ids": the ids collide
    assert t2["diagnostics"] is None  # only appended: nothing diverged
    k2 = t2["kvlab_diagnostics"]
    r1, r2 = server.results[0], server.results[1]
    assert k2["comparison"]["messages"] == "appended" and k2["token_index"] is None
    assert k2["reusable_tokens"] == k2["previous_tokens"] == r1.prompt_tokens
    assert k2["current_tokens"] == r2.prompt_tokens
    # mutant "store detail from the previous request / cumulative counters": reused differs
    assert k2["store"]["reused_tokens"] == k2["cached_tokens"] == r2.reused_tokens > 0
    assert k2["store"]["reused_tokens"] == t2["usage"]["cache_read_input_tokens"]
    assert k2["store"]["miss_reasons"] == {k: v for k, v in r2.miss_reasons.items() if v}

    t3 = _messages(server, TERSE, m2, t2["id"])
    r3 = server.results[2]
    d = kv.diverge(r2.prompt_ids, r3.prompt_ids)
    # mutant "token detail compares the current prompt with itself": the index would not be
    # the divergence of turns 2 and 3; mutant "missed = the current prompt's tail" (not the
    # previous prompt's, which the providers count): the count differs (TERSE is shorter)
    assert t3["diagnostics"]["cache_miss_reason"] == {
        "type": "system_changed", "cache_missed_input_tokens": r2.prompt_tokens - d.token_index}
    assert d.token_index is not None and r2.prompt_tokens - d.token_index > 0
    k3 = t3["diagnostics"]["kvlab"]
    assert k3["token_index"] == d.token_index and k3["role"] == "system" and k3["message_index"] is None
    assert k3["current_text"]["after"].startswith(" terse") and k3["previous_text"]["after"].startswith(" careful")
    assert k3["comparison"]["changed"] == ["system_changed"]
    assert k3["store"]["reused_tokens"] == r3.reused_tokens == t3["usage"]["cache_read_input_tokens"]
    assert "kvlab_diagnostics" not in t3
    assert len({t1["id"], t2["id"], t3["id"]}) == 3
    assert all(t["id"] in server.diagnostics.log for t in (t1, t2, t3))

    # mutant "an unknown id raises": a 500 instead of Anthropic's not-found type
    t4 = _messages(server, SYSTEM, m1, "msg_never_answered")
    assert t4["diagnostics"]["cache_miss_reason"] == {"type": "previous_message_not_found"}

    # mutant "a malformed diagnostics object reaches the generator": 500 instead of a 400 saying why
    for bad in ({"previous_message_id": 5}, "yes"):
        r = _post(server, "/v1/messages", {"model": "c", "max_tokens": 3, "messages": m1, "diagnostics": bad})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "previous_message_id" in r.json()["error"]["message"] or "object" in r.json()["error"]["message"]
    r = _post(server, "/v1/messages", {"model": "c", "max_tokens": 3, "messages": m1,
                                       "diagnostics": {"previous_message_id": 5}})
    assert r.json()["error"]["message"] == ("diagnostics.previous_message_id must be a non-empty string "
                                            "(the id of an earlier response) or null, got 5")

    # per turn, not cumulative: each row's reused tokens are that response's cached tokens
    rows = httpx.get(server.url + "/kvlab/requests", timeout=30).json()
    assert rows["next"] == 4
    assert [r["response_id"] for r in rows["requests"]] == [t["id"] for t in (t1, t2, t3, t4)]
    for row, t, res in zip(rows["requests"], (t1, t2, t3, t4), server.results):
        assert tuple(row) == ROW_FIELDS
        # mutant "row from the ledger's running totals": turn 2 on would carry earlier turns' tokens
        assert row["reused_tokens"] == t["usage"]["cache_read_input_tokens"] == res.reused_tokens
        assert row["prompt_tokens"] == res.prompt_tokens
        assert row["missed_tokens"] == res.prompt_tokens - res.reused_tokens
        assert sum(row["miss_reasons"].values()) == res.prefilled_tokens
        assert row["api"] == "messages" and row["main_reason"] == max(row["miss_reasons"], key=row["miss_reasons"].get)
    assert rows["requests"][2]["diverged_at"] == r3.diverged_at
    later = httpx.get(server.url + "/kvlab/requests", params={"since": 3}, timeout=30).json()
    assert [r["seq"] for r in later["requests"]] == [3] and later["next"] == 4
    assert httpx.get(server.url + "/kvlab/requests", params={"since": "x"}, timeout=30).status_code == 400
    assert server.requests(2) == rows["requests"][2:]


def test_anthropic_streaming_carries_diagnostics_on_message_start(start):
    import anthropic

    server = start("radix")
    m1 = [{"role": "user", "content": "What is a prefix cache?"}]
    # the official SDK sends `diagnostics` and reads the answer back
    a = anthropic.Anthropic(base_url=server.url, api_key="none", timeout=120, max_retries=0)
    first = a.messages.create(model="claude", max_tokens=3, system=SYSTEM, messages=m1,
                              diagnostics={"previous_message_id": None})
    assert first.diagnostics is None
    body = {"model": "claude", "max_tokens": 3, "system": TERSE, "messages": m1, "stream": True,
            "diagnostics": {"previous_message_id": first.id}}
    events = _sse(server, "/v1/messages", body)
    # mutant "diagnostics added when the message ends": message_start would not carry them
    name, start_event = events[0]
    assert name == "message_start"
    streamed = start_event["message"]["diagnostics"]
    r1, r2 = server.results
    d = kv.diverge(r1.prompt_ids, r2.prompt_ids)
    assert streamed["cache_miss_reason"] == {"type": "system_changed",
                                             "cache_missed_input_tokens": r1.prompt_tokens - d.token_index}
    assert streamed["kvlab"]["token_index"] == d.token_index
    assert start_event["message"]["id"] in server.diagnostics.log
    # the same request not streamed: the same provider object (the SDK parses it)
    plain = a.messages.create(model="claude", max_tokens=3, system=TERSE, messages=m1,
                              diagnostics={"previous_message_id": first.id})
    assert plain.diagnostics.cache_miss_reason.type == "system_changed"
    assert plain.diagnostics.cache_miss_reason.cache_missed_input_tokens == r1.prompt_tokens - d.token_index


def _chat(server, messages, tools, comparison=None, **kw):
    body = {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 3, **kw}
    if comparison is not None:
        body["prompt_cache_options"] = {"comparison_response_id": comparison}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_completions_tools_reordered_unknown_id_and_streaming(start, client):
    server = start("radix")
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Read setup.py"}]
    c1 = _chat(server, m1, TOOLS)
    assert "prompt_cache_diagnostics" not in c1  # nothing asked, nothing added
    m2 = m1 + [{"role": "assistant", "content": c1["choices"][0]["message"]["content"] or ""},
               {"role": "user", "content": "Now write it"}]
    c2 = _chat(server, m2, TOOLS, c1["id"])
    hit = c2["prompt_cache_diagnostics"]
    assert hit["type"] == "cache_hit"
    assert hit["kvlab"]["cached_tokens"] == c2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert hit["kvlab"]["reusable_tokens"] == server.results[0].prompt_tokens

    # the tools reordered, and a turn appended (not a change), so the current prompt is longer
    m3 = m2 + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
    c3 = _chat(server, m3, TOOLS[::-1], c2["id"])
    r2, r3 = server.results[1], server.results[2]
    d = kv.diverge(r2.prompt_ids, r3.prompt_ids)
    miss = c3["prompt_cache_diagnostics"]
    # mutant "token detail against the wrong prompt" / "missed = current prompt's tail"
    assert {k: miss[k] for k in ("type", "reason", "cache_missed_tokens", "comparison_reusable_tokens")} == {
        "type": "cache_miss", "reason": "tools_changed", "cache_missed_tokens": r2.prompt_tokens - d.token_index,
        "comparison_reusable_tokens": r2.prompt_tokens}
    assert miss["kvlab"]["comparison"]["tools"] == {"added": [], "removed": [], "reordered": True,
                                                    "schema_changed": []}
    assert miss["kvlab"]["token_index"] == d.token_index
    assert miss["kvlab"]["store"]["reused_tokens"] == c3["usage"]["prompt_tokens_details"]["cached_tokens"]
    # mlx-lm's ids are unique (chatcmpl-<uuid4>) and every one is remembered
    assert len({c1["id"], c2["id"], c3["id"]}) == 3 and all(c["id"] in server.diagnostics.log for c in (c1, c2, c3))

    # mutant "an unknown id raises": 500 instead of OpenAI's not-found type
    gone = _chat(server, m1, TOOLS, "chatcmpl-unknown")
    assert gone["prompt_cache_diagnostics"]["type"] == "comparison_response_not_found"
    # mutant "malformed options reach the generator": 500 instead of a 400 saying why
    for bad in ({"comparison_response_id": 5}, "resp_1"):
        r = _post(server, "/v1/chat/completions", {"model": "t", "messages": m1, "max_tokens": 2,
                                                   "prompt_cache_options": bad})
        assert r.status_code == 400 and "prompt_cache_options" in r.json()["error"]["message"]

    # streaming: on the first chunk only (mutant "attached to every chunk": the pending request
    # is not consumed; mutant "attached to the last chunk": the first has none)
    body = {"model": "tiny", "messages": m2, "tools": TOOLS[::-1], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {"151645": -100, "151643": -100},
            "prompt_cache_options": {"comparison_response_id": c2["id"]}}
    chunks = [d for _, d in _sse(server, "/v1/chat/completions", body)]
    assert len(chunks) >= 2 and chunks[0]["prompt_cache_diagnostics"]["reason"] == "tools_changed"
    assert chunks[0]["prompt_cache_diagnostics"]["kvlab"]["token_index"] == d.token_index
    assert not any("prompt_cache_diagnostics" in c for c in chunks[1:])

    # the official SDK: the field rides along on the completion object
    sdk = client(server).chat.completions.create(
        model="tiny", messages=m2, tools=TOOLS[::-1], max_tokens=2,
        prompt_cache_options={"comparison_response_id": c2["id"]})
    assert sdk.prompt_cache_diagnostics["reason"] == "tools_changed"
    rows = server.requests()
    assert [r["response_id"] for r in rows[:3]] == [c1["id"], c2["id"], c3["id"]]
    assert all(r["api"] == "chat" for r in rows)


def test_paged_store_diagnostics_by_block(start):
    server = start("paged", block_size=16)
    m1 = [{"role": "user", "content": "What is a prefix cache?"}]
    t1 = _messages(server, SYSTEM, m1, None)
    t2 = _messages(server, TERSE, m1, t1["id"])
    r1, r2 = server.results
    d = kv.diverge(r1.prompt_ids, r2.prompt_ids)
    assert t2["diagnostics"]["cache_miss_reason"]["type"] == "system_changed"
    assert t2["diagnostics"]["kvlab"]["token_index"] == d.token_index
    store = t2["diagnostics"]["kvlab"]["store"]
    # a paged store reuses whole blocks before the divergence
    assert store["store"] == "paged" and store["reused_tokens"] == (d.token_index // 16) * 16
    assert store["reused_tokens"] == t2["usage"]["cache_read_input_tokens"] == r2.reused_tokens
    assert sum(store["miss_reasons"].values()) == r2.prompt_tokens - r2.reused_tokens
    rows = server.requests()
    assert [r["reused_tokens"] for r in rows] == [t1["usage"]["cache_read_input_tokens"],
                                                  t2["usage"]["cache_read_input_tokens"]]


def test_evicted_prefix_names_the_request_and_policy(start):
    # about 1 KiB of KV per token here: one 39-token conversation fits in 64 KiB, two do not
    server = start("radix", budget="64KiB")
    alpha, beta = "Alpha system prompt is here. " * 4, "Beta system prompt differs entirely. " * 4
    a = _messages(server, alpha, [{"role": "user", "content": "One"}], None)
    b = _messages(server, beta, [{"role": "user", "content": "Two"}], a["id"])
    c = _messages(server, alpha, [{"role": "user", "content": "One"}], b["id"])
    ra, rb, rc = server.results
    assert rb.evictions == 1 and rc.reused_tokens < ra.prompt_tokens - 1
    store = c["diagnostics"]["kvlab"]["store"]
    assert c["diagnostics"]["cache_miss_reason"]["type"] == "system_changed"
    # mutant "store detail without the eviction": b's insert evicted a's prefix, under LRU
    assert (store["main_reason"], store["evicted_by"], store["eviction_policy"]) == ("evicted", rb.request_id, "lru")
    assert store["miss_reasons"] == {k: v for k, v in rc.miss_reasons.items() if v}
    assert store["miss_reasons"]["evicted"] == rc.prompt_tokens - rc.reused_tokens - 1  # the last: partial
    row = server.requests(2)[0]
    assert (row["main_reason"], row["evicted_by"], row["reused_tokens"]) == ("evicted", rb.request_id,
                                                                            c["usage"]["cache_read_input_tokens"])


def test_responses_route_answers_prompt_cache_diagnostics(start):
    # mutants: the writer never asking for the object (no prompt_cache_diagnostics); the request
    # not remembered under its resp_ id (the second turn answers not found); computed twice (the
    # second call finds nothing pending: response.completed carries None)
    server = start("radix")
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": PARAMS} for t in TOOLS]
    base = {"model": "tiny", "instructions": SYSTEM, "input": "Read the notes.", "tools": tools,
            "max_output_tokens": 4, "temperature": 0}
    first = _post(server, "/v1/responses", base).json()
    assert first["id"].startswith("resp_") and "prompt_cache_diagnostics" not in first
    asked = {**base, "prompt_cache_options": {"comparison_response_id": first["id"]}}
    hit = _post(server, "/v1/responses", asked).json()
    assert hit["prompt_cache_diagnostics"]["type"] == "cache_hit"
    events = _sse(server, "/v1/responses", {**asked, "tools": tools[::-1], "stream": True})
    done = next(d for _, d in events if d["type"] in ("response.completed", "response.incomplete"))["response"]
    d = done["prompt_cache_diagnostics"]
    assert d["type"] == "cache_miss" and d["reason"] == "tools_changed" and d["cache_missed_tokens"] > 0
    assert d["kvlab"]["cached_tokens"] == done["usage"]["input_tokens_details"]["cached_tokens"]
    created = next(d for _, d in events if d["type"] == "response.created")["response"]
    assert created["prompt_cache_diagnostics"] == d
    gone = _post(server, "/v1/responses", {**base, "prompt_cache_options": {"comparison_response_id": "resp_x"}})
    assert gone.status_code == 200 and gone.json()["prompt_cache_diagnostics"]["type"] == "comparison_response_not_found"
    bad = _post(server, "/v1/responses", {**base, "prompt_cache_options": {"comparison_response_id": 7}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_options"
