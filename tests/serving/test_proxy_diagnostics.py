"""Cache diagnostics through kv.proxy in front of kvlab serve on the tiny model: the providers'
objects put where each provider puts them when the client asks, computed from the client side,
and a structural diagnosis on every row (kvlab.proxying.diagnosing).

Each test names the mutants (broken implementations) it catches; each was checked by breaking
the code by hand."""

from __future__ import annotations


import httpx
import pytest

import kvlab as kv
from kvlab.workloads import BILLING_HEADER
from sse_events import sse_events

pytestmark = [pytest.mark.serving, pytest.mark.model]
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a file",
                                           "parameters": {"type": "object", "properties": {}}}}
         for n in ("Read", "Grep", "Edit")]


@pytest.fixture
def proxy_on_tiny(start, tiny):
    up = start("radix")
    p = kv.proxy(up.url, tokenizer=tiny)
    yield p
    p.stop()


def _anthropic(cch: str, turns: list[str], previous, **extra) -> dict:
    messages = []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
    return {"model": "tiny", "max_tokens": 4, "temperature": 0, "system": BILLING_HEADER.format(cch=cch) +
            "\nYou are a careful assistant.", "messages": messages,
            "diagnostics": {"previous_message_id": previous}, **extra}


def test_anthropic_diagnostics_where_anthropic_puts_them(proxy_on_tiny):
    # mutants: the object left out of message_start (streamed turn 3 has no diagnostics); the
    # opt-in (null id) answered as not found; an appended turn reported as messages_changed; the
    # kvlab token index taken from the end of the prompt; no remembering of response ids (turn 2
    # answers previous_message_not_found)
    p = proxy_on_tiny
    http = httpx.Client(base_url=p.url, timeout=60)
    first = http.post(MESSAGES, json=_anthropic("aaaa1", ["List two colours."], None)).json()
    assert first["diagnostics"] is None and "kvlab_diagnostics" not in first
    second = http.post(MESSAGES, json=_anthropic("aaaa1", ["List two colours.", "And two more?"], first["id"])).json()
    assert second["diagnostics"] is None  # an appended turn: nothing diverged
    beside = second["kvlab_diagnostics"]
    assert beside["comparison"]["type"] is None and beside["comparison"]["messages"] == "appended"
    assert beside["cached_tokens"] == second["usage"]["cache_read_input_tokens"] > 0
    body = _anthropic("bbbb2", ["List two colours.", "And two more?"], second["id"], stream=True)
    with http.stream("POST", MESSAGES, json=body) as r:
        events = sse_events(b"".join(r.iter_raw()))
    start = next(e for e in events if e["type"] == "message_start")["message"]
    reason = start["diagnostics"]["cache_miss_reason"]
    assert reason["type"] == "system_changed" and reason["cache_missed_input_tokens"] > 0
    rows = p.wait(3)
    ext = start["diagnostics"]["kvlab"]
    assert ext["token_index"] == rows[2]["diverged_at"] is not None  # where the cch= value differs
    assert ext["token_index"] < rows[1]["prompt_tokens"]
    assert ext["cached_tokens"] == start["usage"]["cache_read_input_tokens"]
    # every row is diagnosed, asked or not; the billing header's cch is named
    assert rows[2]["diagnosis"]["type"] == "system_changed" and rows[2]["diagnosis"]["volatile_fields"] == ["cch"]
    assert rows[1]["diagnosis"]["type"] is None
    unknown = http.post(MESSAGES, json=_anthropic("aaaa1", ["List two colours."], "msg_nobody")).json()
    assert unknown["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}


def test_openai_diagnostics_on_chat_completions(proxy_on_tiny):
    # mutants: reordered tools not a miss (cache_hit); the object put in the last chunk, not the
    # first; comparison_response_not_found answered as a 500 or as a hit
    p = proxy_on_tiny
    http = httpx.Client(base_url=p.url, timeout=60)
    base = {"model": "tiny", "max_tokens": 4, "temperature": 0, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Find the bug."}]}
    first = http.post(CHAT, json=base).json()
    assert "prompt_cache_diagnostics" not in first  # nobody asked
    asked = {"prompt_cache_options": {"comparison_response_id": first["id"]}}
    same = http.post(CHAT, json={**base, **asked}).json()
    assert same["prompt_cache_diagnostics"]["type"] == "cache_hit"
    reordered = {**base, **asked, "tools": TOOLS[::-1], "stream": True}
    with http.stream("POST", CHAT, json=reordered) as r:
        chunks = sse_events(b"".join(r.iter_raw()))
    d = chunks[0]["prompt_cache_diagnostics"]
    assert d["type"] == "cache_miss" and d["reason"] == "tools_changed" and d["cache_missed_tokens"] > 0
    assert d["kvlab"]["comparison"]["tools"]["reordered"] is True and d["kvlab"]["cached_tokens"] is None
    assert all("prompt_cache_diagnostics" not in c for c in chunks[1:])
    gone = http.post(CHAT, json={**base, "prompt_cache_options": {"comparison_response_id": "chatcmpl-x"}})
    assert gone.status_code == 200 and gone.json()["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}


def test_malformed_diagnostics_are_refused_before_forwarding(proxy_on_tiny):
    # mutant: forwarding it anyway (the upstream runs the request: a row appears)
    p = proxy_on_tiny
    r = httpx.post(p.url + MESSAGES, json=_anthropic("aaaa1", ["Hi"], 5), timeout=60)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "previous_message_id" in r.json()["error"]["message"]
    r = httpx.post(p.url + CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                       "prompt_cache_options": "resp_1"}, timeout=60)
    assert r.status_code == 400 and "prompt_cache_options" in r.json()["error"]["message"]
    assert p.requests == []


def test_inspector_follows_the_proxy_live(proxy_on_tiny):
    # mutants: results not built from rows (the Inspector shows 0 requests); reused taken from the
    # proxy's own prefix comparison instead of what the upstream reported; listeners never called
    # (the Inspector stays at 1 request)
    import threading

    pytest.importorskip("ipywidgets")
    p = proxy_on_tiny
    http = httpx.Client(base_url=p.url, timeout=60)
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Name two rivers, please."}]}
    first = http.post(CHAT, json=body).json()
    p.wait(1)
    ins = kv.Inspector(p)
    assert ins.state()["requests"] == 1
    seen = threading.Event()
    p.on_result(lambda source, result: seen.set())  # called after the Inspector's own listener
    second = http.post(CHAT, json=body).json()
    assert seen.wait(30)
    state = ins.state()
    assert state["requests"] == 2
    reported = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in (first, second)]
    assert [r.reused_tokens for r in p.results] == reported and reported[1] > 0
    assert state["live"]["reused_tokens"] == sum(reported)
    assert p.results[1].prompt_ids[:5] == p.results[0].prompt_ids[:5] and p.results[1].prompt_tokens > 0
