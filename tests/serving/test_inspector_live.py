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

    def offered(n):  # a request's prompt + output offer is in once its response has ended
        return server.events.filter((pl.col("event") == "offer") & (pl.col("segment") == "assistant")).height >= n

    def wait_for(done, what):
        deadline = time.time() + 60
        while not done():
            assert time.time() < deadline, f"still waiting for {what}"
            time.sleep(0.05)

    # the first request is answered and stored before the others are sent, so they can hit its
    # system prompt however busy the machine is (sent all at once, all six could miss)
    ask(0)
    assert offered(1)  # kvlab serve's promise: the response has ended, so has its insert
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(1, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # the Inspector redraws on the server's listener thread
    wait_for(lambda: ins.state()["table_rows"] >= 6, "six table rows")
    state = ins.state()
    assert state["error"] is None
    assert state["requests"] == state["table_rows"] == 6
    assert state["live"]["requests"] == 6 and state["live"]["token_hit_rate"] > 0
    # all six are stored (their responses ended): a redraw shows exactly the store's bytes
    assert offered(6)
    ins.refresh()
    assert ins.state()["memory"]["bytes"] == server.store.nbytes
    assert state["simulated"] is not None and state["simulated"]["token_hit_rate"] > 0


def test_a_served_request_says_why_its_tokens_missed(start, client, system_prompt, no_eos):
    """The server's Results carry the Engine's miss reasons (kvlab.miss_reasons), summing to the
    missed tokens; the Inspector's misses tab draws them. Mutants caught: reasons left empty
    (the sums fail), the insert events not recorded (the other question would be first_seen, not
    diverged)."""
    server = start("radix")
    c = client(server)

    def ask(user):
        c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, logit_bias=no_eos,
                                  messages=[{"role": "system", "content": system_prompt},
                                            {"role": "user", "content": user}])

    for user in ("What is a prefix cache?", "What is a prefix cache?", "Why do caches miss?"):
        ask(user)
    first, repeat, other = server.results  # each response has ended: its Result is in
    for r in server.results:
        assert sum(r.miss_reasons.values()) == r.prompt_tokens - r.reused_tokens, r
    assert first.miss_reasons["first_seen"] == first.prompt_tokens - 1
    assert first.miss_reasons["partial_block"] == 1  # the last prompt token is always prefilled
    # the repeat reuses all but the last token, which is the last-token rule's
    assert repeat.reused_tokens == repeat.prompt_tokens - 1
    assert {k: n for k, n in repeat.miss_reasons.items() if n} == {"partial_block": 1}
    # the other question parts ways after the system prompt and the user turn's opening tokens
    assert other.miss_reasons["diverged"] == other.prompt_tokens - other.reused_tokens - 1
    assert other.diverged_at == other.reused_tokens
    ins = kv.Inspector(server)
    drawn = {t.name: [int(v) for v in t.y] for t in ins.figs["misses"].data}
    assert drawn["diverged"] == [0, 0, other.miss_reasons["diverged"]]
    assert drawn["first_seen"][0] == first.prompt_tokens - 1
