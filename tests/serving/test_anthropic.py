"""POST /v1/messages through the official anthropic SDK: plain and streaming, Anthropic's event
types in order, usage from the prompt cache, the billing header with and without --normalise,
and the API key on every route."""

import json

import httpx
import pytest

pytestmark = [pytest.mark.serving, pytest.mark.model]

HEADER = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};"
AGENT = "You are an agent for software engineering tasks. Use the tools you are given. " * 4


def _anthropic(server, key="none"):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=key, timeout=120, max_retries=0)


def _system(cch):
    # as the agent client sends it: the billing header is the first text block of the system prompt
    return [{"type": "text", "text": HEADER.format(cch)}, {"type": "text", "text": AGENT}]


def test_messages_plain_and_streaming(start):
    server = start("radix")
    a = _anthropic(server)
    msg = a.messages.create(model="claude-sonnet-4-5", max_tokens=5, system=_system("eb6c6"),
                            messages=[{"role": "user", "content": "List the files."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-sonnet-4-5"
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 5
    r1 = server.results[0]
    assert msg.usage.input_tokens == r1.prompt_tokens and msg.usage.cache_read_input_tokens == 0
    assert "".join(b.text for b in msg.content if b.type == "text") == r1.text

    with a.messages.stream(model="claude", max_tokens=5, system=_system("eb6c6"),
                           messages=[{"role": "user", "content": "List the files."}]) as stream:
        final = stream.get_final_message()
    r2 = server.results[1]
    assert final.usage.cache_read_input_tokens == r2.reused_tokens == r2.prompt_tokens - 1
    assert final.usage.input_tokens == 1
    assert r2.output_ids == r1.output_ids  # same request at temperature 0, now from the cache
    events = server.events  # one snapshot: a second read may hold more rows than the first
    assert events.filter(events["detail"] == "messages").height == 2  # arrive rows

    # the raw stream: Anthropic's event types, in Anthropic's order
    body = {"model": "claude", "max_tokens": 4, "stream": True, "system": _system("x"),
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("event: "):] for line in resp.iter_lines() if line.startswith("event: ")]
    events = [e for e in events if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_billing_header_breaks_reuse_unless_normalised(start, tiny):
    user = [{"role": "user", "content": "Fix the failing test."}]
    for normalise in (False, True):
        server = start("radix", normalise=normalise)
        a = _anthropic(server)
        for cch in ("eb6c6", "91f02"):
            a.messages.create(model="claude", max_tokens=3, system=_system(cch), messages=user)
        first, second = server.results
        if normalise:
            # the header line is gone: both prompts are identical, all but the last token reused
            assert first.prompt_ids == second.prompt_ids
            assert second.reused_tokens == second.prompt_tokens - 1
        else:
            # reuse stops where the two headers' token ids part (pitfall 1)
            common = next(i for i, (x, y) in enumerate(zip(first.prompt_ids, second.prompt_ids)) if x != y)
            text = tiny.tokenizer.decode(list(first.prompt_ids[:common + 1]))
            assert text.endswith(tiny.tokenizer.decode(list(first.prompt_ids[common:common + 1])))
            assert "cch=" in text and second.reused_tokens == common < 40
        server.stop()


def test_messages_errors_are_anthropic_errors(start):
    import anthropic

    server = start("radix")
    a = _anthropic(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="c", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(model="c", max_tokens=4, messages=[])
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_api_key_checked_on_every_route(start, client):
    import anthropic
    import openai

    server = start("radix", api_key="s3cret")
    for method, route in [("GET", "/kvlab/stats"), ("GET", "/kvlab/events"), ("GET", "/health"),
                          ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                          ("POST", "/v1/messages"), ("POST", "/v1/completions"), ("GET", "/nowhere")]:
        r = httpx.request(method, server.url + route, json={}, timeout=30)
        assert r.status_code == 401, route
        assert "API key" in json.dumps(r.json())
        wrong = httpx.request(method, server.url + route, json={}, timeout=30,
                              headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, route
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").chat.completions.create(model="t", messages=[{"role": "user", "content": "x"}])
    ok = client(server, "s3cret").chat.completions.create(
        model="t", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert ok.usage.completion_tokens <= 2
    msg = _anthropic(server, "s3cret").messages.create(model="c", max_tokens=2,
                                                       messages=[{"role": "user", "content": "x"}])
    assert msg.usage.output_tokens <= 2
    with pytest.raises(anthropic.AuthenticationError):
        _anthropic(server, "nope").messages.create(model="c", max_tokens=2,
                                                   messages=[{"role": "user", "content": "x"}])
    stats = httpx.get(server.url + "/kvlab/stats", headers={"x-api-key": "s3cret"}, timeout=30)
    assert stats.status_code == 200 and stats.json()["requests"] == 2
