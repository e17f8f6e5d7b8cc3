"""kv.Inspector(server) updates live while concurrent load runs against the server: it reads the
Server's results, events, stats() and store, as it reads an Engine's."""

import threading
import time

import httpx
import polars as pl
import pytest

import kvlab as kv

pytestmark = [pytest.mark.serving, pytest.mark.model]


@pytest.mark.parametrize("store", ["radix", "paged"])
def test_inspector_follows_a_live_server(start, store, system_prompt):
    server = start(store)
    ins = kv.Inspector(server)
    assert ins.state()["requests"] == 0

    def ask(i):
        httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "system", "content": system_prompt},
                         {"role": "user", "content": f"Question {i}?"}], "max_tokens": 3})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    deadline = time.time() + 60
    while time.time() < deadline and ins.state()["table_rows"] < 6:
        time.sleep(0.05)  # the Inspector redraws on the server's listener thread
    state = ins.state()
    assert state["error"] is None
    assert state["requests"] == state["table_rows"] == 6
    assert state["live"]["requests"] == 6 and state["live"]["token_hit_rate"] > 0
    # mlx-lm caches a request's prompt + output just after its response is sent: once all six
    # are stored, a redraw shows exactly the store's bytes
    while time.time() < deadline and server.events.filter(
            (pl.col("event") == "offer") & (pl.col("segment") == "assistant")).height < 6:
        time.sleep(0.05)
    ins.refresh()
    assert ins.state()["memory"]["bytes"] == server.store.nbytes
    assert state["simulated"] is not None and state["simulated"]["token_hit_rate"] > 0
