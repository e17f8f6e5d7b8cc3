"""Bad input and faults: each gets a clear HTTP error or is served, the server keeps serving, and
afterwards the store's invariants hold (bytes == sum of entries, budget never exceeded, nothing
registered for a request that is over). Loopback only, bounded in time and count."""

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import polars as pl
import pytest

pytestmark = [pytest.mark.serving, pytest.mark.model]


def _post(server, body, route="/v1/chat/completions", raw=None):
    return httpx.post(server.url + route, json=body if raw is None else None, content=raw, timeout=60)


def _still_serves(server):
    r = _post(server, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_bad_requests_get_clear_errors(start):
    server = start("radix")
    cases = [
        (dict(raw=b'{"messages": [oops'), 400, "JSON"),
        (dict(body={"messages": []}), 400, "non-empty"),
        (dict(body={"messages": "hello"}), 400, "non-empty"),
        (dict(body={"messages": [{"content": "no role"}]}), 400, "role"),
        (dict(body={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), 400, "max_tokens"),
        (dict(body={"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}), 400, "max_tokens"),
        (dict(body={"messages": [{"role": "user", "content": "word " * 4200}], "max_tokens": 8}), 400,
         "context of 4096"),
        (dict(body={}, route="/v1/nope"), 404, "unknown route"),
    ]
    for kw, status, words in cases:
        r = _post(server, kw.get("body"), kw.get("route", "/v1/chat/completions"), kw.get("raw"))
        assert r.status_code == status, (kw, r.text)
        assert words in r.text, (words, r.text)
        _still_serves(server)
    assert httpx.get(server.url + "/v1/nope", timeout=30).status_code == 404
    inv = server.invariants()
    assert inv["ok"], inv
    # the over-long prompt was refused after tokenising: its request ended as an error
    errors = server.events.filter((pl.col("event") == "finish") & pl.col("detail").str.starts_with("error"))
    assert errors.height == 1 and "context" in errors["detail"][0]


def test_client_leaving_mid_stream(start, no_eos):
    server = start("radix")
    body = ('{"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000, '
            f'"stream": true, "logit_bias": {str(no_eos).replace(chr(39), chr(34))}}}').encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += s.recv(4096)
    # the client is gone: mlx-lm stops generating for it and the request ends as disconnected
    deadline = time.time() + 60
    while time.time() < deadline and server.stats()["running"]:
        time.sleep(0.05)
    assert server.stats()["running"] == 0
    finish = server.events.filter((pl.col("request") == 1) & (pl.col("event") == "finish"))
    assert finish["detail"].to_list() == ["disconnected"]
    assert 3 <= finish["tokens"][0] < 3000
    _still_serves(server)
    time.sleep(0.2)  # the generation loop drops the removed request between steps
    inv = server.invariants()
    assert inv["ok"], inv


@pytest.mark.parametrize("store", ["radix", "paged", "system", "mlx-lru"])
def test_64_simultaneous_connections(start, store, system_prompt):
    budget = 256 << 10  # small enough that 64 requests force evictions
    server = start(store, budget=budget)

    def ask(i):
        msgs = [{"role": "system", "content": system_prompt if i % 2 else "Be brief."},
                {"role": "user", "content": f"Question number {i}: what is {i} squared?"}]
        return _post(server, {"messages": msgs, "max_tokens": 4})

    with ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(ask, range(64)))
    assert [r.status_code for r in responses] == [200] * 64
    _still_serves(server)
    s = server.stats()
    assert s["requests"] == 65 and s["adapter_errors"] == 0
    inv = server.invariants()
    assert inv["ok"], inv
    assert inv["bytes_match"] and inv["within_budget"] and not inv["inflight"]
    if store in ("radix", "paged"):
        assert inv["peak_bytes"] <= budget
        assert server.events.filter(pl.col("detail") == "lru").height > 0  # evictions happened
