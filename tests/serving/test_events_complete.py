"""kvlab serve's promise: when a response has ended (a plain body received whole; a stream's last
event received), every event row of its request (arrive, lookup, miss, offer and insert of its
prompt + output, first_token, finish) is in ``server.events``, and its Result in
``server.results``. mlx-lm inserts prompt + output on its generation thread right after it ends
a request; kvlab holds that end back from the client until the insert's rows are in.

Tested by order, not by timing: the store's prompt + output insert waits (up to WAIT_S) for the
test to have read ``server.events`` once after its response ended. Mutant caught (checked by
hand): the end passed on to the client at once (ObservedQueue without the hold), where a client
that has its response reads the events before its request's insert rows: every case here fails.
With the promise kept, the insert times out its wait before the response can end (WAIT_S per
request).
"""

import threading

import httpx
import pytest

import kvlab as kv

from sse_events import sse_events

pytestmark = [pytest.mark.serving, pytest.mark.model]

WAIT_S = 1.0
PROMPT = "Name one prime number."
ROWS = {"arrive", "lookup", "miss", "offer", "insert", "first_token", "finish"}


class FinalInsertAfterTheRead(kv.RadixStore):
    """A radix store whose prompt + output insert waits until the test has read the events (or
    WAIT_S has passed)."""

    def __init__(self):
        super().__init__(64 << 20)
        self.read = threading.Event()

    def insert(self, key, tokens, snap, *, kind="prompt"):
        if kind == "prompt+output":
            self.read.wait(WAIT_S)
        super().insert(key, tokens, snap, kind=kind)


def _bodies():
    chat = {"model": "t", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0}
    return {
        "chat": ("/v1/chat/completions", chat),
        "chat-stream": ("/v1/chat/completions", {**chat, "stream": True}),
        "responses-stream": ("/v1/responses", {"model": "t", "input": PROMPT, "max_output_tokens": 3,
                                               "temperature": 0, "stream": True}),
        "messages-stream": ("/v1/messages", {**chat, "model": "claude", "stream": True}),
    }


@pytest.mark.parametrize("case", list(_bodies()))
def test_a_response_ends_after_every_row_of_its_request(start, case):
    store = FinalInsertAfterTheRead()
    server = start(store)
    route, body = _bodies()[case]
    r = httpx.post(server.url + route, json=body, timeout=120)  # returns once the body has ended
    events, results = server.events, server.results  # one read each, after the end
    store.read.set()
    assert r.status_code == 200, r.text
    if body.get("stream"):  # the stream was whole: its last event is the API's closing one
        last = sse_events(r.content)[-1]
        assert last.get("type") in ("message_stop", "response.completed", "response.incomplete") \
            or last.get("usage") is not None or last["choices"][0]["finish_reason"], last
    (rid,) = set(events["request"].drop_nulls().to_list())
    mine = events.filter(events["request"] == rid)
    assert ROWS <= set(mine["event"].to_list()), mine["event"].to_list()
    final = mine.filter((mine["event"] == "offer") & (mine["segment"] == "assistant"))
    assert final.height == 1
    prompt_output = final["tokens"].item()
    # the insert of prompt + output (less the last token, which its cache has not run)
    assert mine.filter((mine["event"] == "insert") & (mine["tokens"] >= prompt_output - 1)).height == 1
    assert [x.request_id for x in results] == [rid]
