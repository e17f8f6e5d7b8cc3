"""kv.proxy / `kvlab proxy` in front of an in-process `kvlab serve` on the tiny model, and in front
of a scripted upstream on loopback (a few lines of http.server) where an exact order of events is
needed: a stream relayed as it arrives, a client that leaves mid-stream, the headers forwarded.
Every server and proxy a test starts is stopped by the fixture that started it."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import kvlab as kv
from kvlab.primitives.tokens import common_prefix_len
from kvlab.serving.peers import free_port
from kvlab.serving.record import read_records
from sse_events import sse_events

pytestmark = [pytest.mark.serving, pytest.mark.model]
ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
WAIT = 10.0  # the longest any scripted upstream waits for the test before it gives up


# -- a scripted upstream ----------------------------------------------------------------------------
class Script:
    """What the scripted upstream saw and the events the test and it order each other with."""

    def __init__(self):
        self.requests: list[tuple[dict, bytes]] = []
        self.paths: list[str] = []
        self.go = threading.Event()           # the test read the first event: send the rest
        self.closed = threading.Event()       # the upstream saw the proxy close its connection
        self.sent = 0                         # events sent by the endless stream


def _event(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i


class ScriptedHandler(BaseHTTPRequestHandler):
    script: Script = None  # set per fixture

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.script.requests.append((dict(self.headers.items()), body))
        self.script.paths.append(self.path)
        mode = json.loads(body).get("mode")
        if mode == "echo":
            data = json.dumps({"echo": True}).encode()
            self.send_response(418)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Upstream", "scripted")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if mode == "broken":  # a chunked stream whose connection drops before its last chunk
            e = _event(0)
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(e), e))
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes, as mlx-lm's does
        self.wfile.write(_event(0))
        if mode == "lockstep":
            self.script.go.wait(WAIT)
            self.wfile.write(_event(1) + b"data: [DONE]\n\n")
        elif mode == "endless":
            self._until_closed()

    def _until_closed(self):
        # sends one event at a time until the proxy closes the connection (or WAIT s pass)
        s = self.script
        s.go.wait(WAIT)
        for i in range(1, 10_000):
            try:
                self.wfile.write(_event(i))
            except OSError:
                s.closed.set()
                return
            s.sent = i
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable and not self.connection.recv(1):
                s.closed.set()
                return
            if i * 0.05 > WAIT:
                return

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    script = Script()
    handler = type("Handler", (ScriptedHandler,), {"script": script})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    script.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield script
    script.go.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _text(events) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))


# -- against kvlab serve on tiny --------------------------------------------------------------------
def test_chat_through_the_proxy_equals_the_chat_sent_directly(start, proxied, tiny):
    up = start("radix")
    p = proxied(up.url, tokenizer=tiny)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 12, "temperature": 0}
    direct = httpx.post(up.url + CHAT, json=body, timeout=60)
    keep = httpx.Client(timeout=60)  # one keep-alive connection to the proxy for every request below
    via = keep.post(p.url + CHAT, json=body)
    assert direct.status_code == via.status_code == 200
    assert via.json()["choices"] == direct.json()["choices"]
    assert via.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]

    sbody = dict(body, stream=True, stream_options={"include_usage": True})
    direct_chunks, via_chunks = [], []
    for client, url, chunks in ((httpx, up.url, direct_chunks), (keep, p.url, via_chunks)):
        with client.stream("POST", url + CHAT, json=sbody, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks.extend(r.iter_raw())
    # mutant: a stream framed without its end (or a body without its length) breaks the next request
    assert keep.post(p.url + CHAT, json=body).json()["choices"] == direct.json()["choices"]
    keep.close()
    d, v = sse_events(b"".join(direct_chunks)), sse_events(b"".join(via_chunks))
    # mutant: a proxy that drops or merges events (or buffers then rewrites them) changes the count
    assert len(v) == len(d) > 1
    assert _text(v) == _text(d) == direct.json()["choices"][0]["message"]["content"]
    assert len(via_chunks) > 1
    rows = p.wait(3)
    # mutant: a watcher that misses the stream's final usage chunk leaves reused_tokens None
    assert rows[1]["reused_tokens"] == v[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert rows[1]["prompt_tokens"] == rows[1]["upstream_prompt_tokens"] == v[-1]["usage"]["prompt_tokens"]
    assert rows[1]["ttft_s"] <= rows[1]["e2e_s"]


def test_upstream_errors_pass_through_unchanged(start, proxied):
    up = start("radix", api_key="sesame")
    p = proxied(up.url)
    empty = {"model": "tiny", "messages": [], "max_tokens": 4}
    for headers in ({"Authorization": "Bearer sesame"}, {}):  # 400 for the body; 401 without the key
        direct = httpx.post(up.url + CHAT, json=empty, headers=headers, timeout=60)
        via = httpx.post(p.url + CHAT, json=empty, headers=headers, timeout=60)
        assert direct.status_code in (400, 401)
        # mutant: a proxy that rewrites error statuses to 502, or drops the auth header (then both 401)
        assert (via.status_code, via.content) == (direct.status_code, direct.content)
    assert [r["http_status"] for r in p.wait(2)] == [400, 401]
    assert {r["status"] for r in p.requests} == {"error"}


def test_an_upstream_that_is_down_is_a_502_naming_it(proxied):
    url = f"http://127.0.0.1:{free_port()}"
    p = proxied(url)
    r = httpx.post(p.url + CHAT, json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert r.status_code == 502
    assert url in r.json()["error"]["message"] and "connection refused" in r.json()["error"]["message"]
    # Anthropic's clients read Anthropic's error shape on /v1/messages
    m = httpx.post(p.url + "/v1/messages", json={"max_tokens": 4, "messages": []}, timeout=30)
    assert m.status_code == 502 and m.json()["type"] == "error" and url in m.json()["error"]["message"]
    # no wait: the row is made before the 502 goes out (mutant: the 502 first -> a client that
    # has its answer may not find the row yet; it failed this line once under load)
    assert [r["status"] for r in p.requests] == ["upstream_unreachable"] * 2
    nf = httpx.post(p.url + "/v1/embeddings", json={}, timeout=30)
    assert nf.status_code == 404 and "/v1/embeddings" in nf.json()["error"]["message"]
    assert httpx.get(p.url + "/v1/nothing", timeout=30).status_code == 404


def test_a_three_turn_conversation_extends_turn_by_turn_and_records(start, proxied, tiny, tmp_path,
                                                                    system_prompt):
    up = start("radix")
    path = tmp_path / "proxy.jsonl"
    p = proxied(up.url, tokenizer=tiny, record=path, record_text=True)
    msgs = [{"role": "system", "content": system_prompt}]
    usages, prompts = [], []
    for turn, question in enumerate(["What is a prime?", "And a composite?", "Give one of each."]):
        msgs.append({"role": "user", "content": question})
        body = {"model": "tiny", "messages": list(msgs), "max_tokens": 6, "temperature": 0}
        if turn == 2:  # the last turn streams: usage comes in the final chunk
            body.update(stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", p.url + CHAT, json=body, timeout=60) as r:
                events = sse_events(r.read())
            reply, usage = _text(events), events[-1]["usage"]
        else:
            r = httpx.post(p.url + CHAT, json=body, timeout=60).json()
            reply, usage = r["choices"][0]["message"]["content"], r["usage"]
        usages.append(usage)
        prompts.append(kv.tokenise(tiny, list(msgs)).ids)
        msgs.append({"role": "assistant", "content": reply})
    # no wait: a row is made before its response ends (mutant: the stream's end sent first)
    rows = p.requests
    assert [r["id"] for r in rows] == [1, 2, 3]
    # mutant: extends = the first request ever, or the earliest of a tie, instead of the longest prefix
    assert [r["extends"] for r in rows] == [None, 1, 2]
    assert [r["reused_tokens"] for r in rows] == [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert rows[1]["reused_tokens"] > 0 and rows[2]["reused_tokens"] > 0
    assert [r["prompt_tokens"] for r in rows] == [u["prompt_tokens"] for u in usages] == [len(x) for x in prompts]
    for k in (1, 2):  # the shared prefix and where it ends, as kv.diverge computes them independently
        common = common_prefix_len(prompts[k - 1], prompts[k])
        d = kv.diverge(kv.tokenise(tiny, msgs[:2 * k]), kv.tokenise(tiny, msgs[:2 * k + 2]))
        assert rows[k]["common_prefix"] == common == d.common
        assert (rows[k]["diverged_at"], rows[k]["message_index"], rows[k]["role"]) == (
            d.token_index, d.message_index, d.role)
    frame = p.requests_frame()
    assert frame["extends"].to_list() == [None, 1, 2] and frame.height == 3
    assert httpx.get(p.url + "/kvlab/requests", timeout=30).json() == json.loads(json.dumps(p.requests))
    assert [r["id"] for r in httpx.get(p.url + "/kvlab/requests?since=2", timeout=30).json()] == [3]
    assert httpx.get(p.url + "/kvlab/requests?since=x", timeout=30).status_code == 400
    # a client's previous_message_id / comparison_response_id names a request by its response's id
    assert all(r["response_id"].startswith("chatcmpl-") for r in rows)
    assert p.tracker.find(rows[1]["response_id"]).id == 2 and p.tracker.find("chatcmpl-none") is None

    p.stop()
    trace = kv.traces.read(path)
    assert trace.frame["input_length"].to_list() == [u["prompt_tokens"] for u in usages]
    assert trace.frame["output_length"].to_list() == [u["completion_tokens"] for u in usages]
    assert trace.frame["hash_ids"].list.len().to_list() == [-(-len(x) // 512) for x in prompts]
    fine = kv.traces.read(path, block_size=16, hash_field="kvlab_hash_ids")
    assert fine.frame["hash_ids"].list.len().to_list() == [-(-len(x) // 16) for x in prompts]
    recs = read_records(path)
    # chained hashes: turn k repeats turn k-1's full blocks of the shared prefix
    assert recs[1]["kvlab_hash_ids"][: rows[1]["common_prefix"] // 16] == \
        recs[0]["kvlab_hash_ids"][: rows[1]["common_prefix"] // 16]
    assert [r["status"] for r in recs] == ["ok"] * 3 and recs[2]["extends"] == 2
    assert [r["prompt_ids"] for r in recs] == [list(x) for x in prompts]  # record_text: ids and messages
    assert recs[2]["messages"] == msgs[:6]


def test_anthropic_prompts_with_tools_tokenise_as_the_upstream_counts_them(start, proxied, tiny):
    up = start("radix")
    p = proxied(up.url, tokenizer=tiny)
    tools = [{"name": "get_weather", "description": "The weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    body = {"model": "m", "max_tokens": 3, "system": [{"type": "text", "text": "Be brief."}], "tools": tools,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]}
    usage = httpx.post(p.url + "/v1/messages", json=body, timeout=60).json()["usage"]
    row = p.wait(1)[0]
    # mutant: tokenising without the tools (the template renders them into the system block)
    assert row["prompt_tokens"] == row["upstream_prompt_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


def _diagnose(previous, current):
    if current.id == 3:
        raise ValueError("a bug in a diagnosis")
    return {"previous": previous.id, "kind": previous.prompt.kind, "system": current.prompt.body["system"]}


def test_anthropic_turns_without_a_tokenizer_compare_message_by_message(start, proxied):
    up = start("radix")
    p = proxied(up.url, diagnose=_diagnose)
    base = {"model": "claude-x", "max_tokens": 4, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}]}
    first = httpx.post(p.url + "/v1/messages", json=base, timeout=60).json()
    second = dict(base, stream=True, messages=base["messages"] + [
        {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "Again"}])
    with httpx.stream("POST", p.url + "/v1/messages", json=second, timeout=60) as r:
        raw = r.read()
    start_event = next(e for e in sse_events(raw) if e["type"] == "message_start")
    third = dict(second, system="Be verbose.", stream=False)
    httpx.post(p.url + "/v1/messages", json=third, timeout=60)
    rows = p.wait(3)
    assert all(r["unit"] == "messages" for r in rows)
    assert rows[0]["reused_tokens"] == first["usage"]["cache_read_input_tokens"]
    assert rows[0]["response_id"] == first["id"] and rows[1]["response_id"] == start_event["message"]["id"]
    assert rows[1]["reused_tokens"] == start_event["message"]["usage"]["cache_read_input_tokens"] > 0
    # turn 2 extends turn 1 whole (system + user); turn 3 changed the system prompt: message 0
    assert (rows[1]["extends"], rows[1]["common_prefix"], rows[1]["diverged_at"]) == (1, 2, None)
    # mutant: structural hashes that ignore the system prompt would put no divergence here
    assert (rows[2]["extends"], rows[2]["diverged_at"], rows[2]["role"]) == (2, 0, "system")
    # the diagnosis hook sees both requests; its failure costs the diagnosis, not the row
    assert rows[0]["diagnosis"] is None
    assert rows[1]["diagnosis"] == {"previous": 1, "kind": "anthropic", "system": "Be brief."}
    assert json.loads(p.requests_frame()["diagnosis"][1]) == rows[1]["diagnosis"]
    assert rows[2]["diagnosis"] == "diagnose failed: a bug in a diagnosis"


# -- against a scripted upstream --------------------------------------------------------------------
def test_headers_and_body_bytes_reach_the_upstream_unchanged(scripted, proxied):
    p = proxied(scripted.url)
    raw = b'{"mode": "echo",   "messages": [{"role": "user", "content": "Hi \\u00e9"}]}'
    headers = {"Authorization": "Bearer k1", "x-api-key": "k2", "anthropic-version": "2023-06-01",
               "anthropic-beta": "cache-diagnosis-2026-04-07", "Content-Type": "application/json"}
    r = httpx.post(p.url + "/v1/messages", content=raw, headers=headers, timeout=30)
    seen, body = scripted.requests[0]
    assert body == raw  # mutant: re-serialising the JSON changes the bytes (spacing, escapes)
    seen = {k.lower(): v for k, v in seen.items()}
    assert {k.lower(): v for k, v in headers.items()}.items() <= seen.items()
    assert seen["accept-encoding"] == "identity"  # not the client's gzip: the proxy reads the body
    assert r.status_code == 418 and r.json() == {"echo": True} and r.headers["x-upstream"] == "scripted"
    for route in ("/v1/messages?beta=true", CHAT, "/v1/completions", "/v1/responses"):
        assert httpx.post(p.url + route, content=b'{"mode":"echo"}', timeout=30).status_code == 418
    # mutant: a proxy that drops the query string (Anthropic's SDK sends ?beta=true) or a route
    assert scripted.paths == ["/v1/messages", "/v1/messages?beta=true", CHAT, "/v1/completions", "/v1/responses"]


class BrokenTokenizer:
    tokenizer = None  # a kvlab Tokeniser: kv.tokenise hands it the messages

    def tokenise(self, *args, **kw):
        raise RuntimeError("a tokenizer bug")


def test_a_bug_in_tracking_never_costs_the_client_its_response(scripted, proxied):
    p = proxied(scripted.url, tokenizer=BrokenTokenizer())
    # mutant: finishing the row outside a guard drops the connection without a response
    r = httpx.post(p.url + CHAT, json={"mode": "echo", "messages": [{"role": "user", "content": "Hi"}]},
                   timeout=30)
    assert r.status_code == 418 and r.json() == {"echo": True} and p.requests == []


def test_a_stream_is_relayed_as_it_arrives(scripted, proxied):
    p = proxied(scripted.url)
    with httpx.stream("POST", p.url + CHAT, json={"mode": "lockstep", "stream": True}, timeout=30) as r:
        chunks = r.iter_raw()
        # the upstream sends its second event only after the client holds the first: a proxy that
        # buffers the stream (mutant) delivers both at once, WAIT s later
        got = b""
        while len(got) < len(_event(0)):
            got += next(chunks)
        assert got == _event(0)
        scripted.go.set()
        rest = b"".join(chunks)
    assert rest == _event(1) + b"data: [DONE]\n\n"
    assert p.wait(1)[0]["status"] == "ok" and p.requests[0]["output_tokens"] == 2


def test_a_client_that_leaves_mid_stream_closes_the_upstream_and_is_recorded_whole(scripted, proxied,
                                                                                    tmp_path):
    path = tmp_path / "rec.jsonl"
    p = proxied(scripted.url, record=path)
    body = json.dumps({"mode": "endless", "stream": True,
                       "messages": [{"role": "user", "content": "Go on"}]}).encode()
    with socket.create_connection(("127.0.0.1", p.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while _event(0) not in got:
            got += s.recv(4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    scripted.go.set()
    # mutant: a proxy that keeps reading the upstream after its client left never closes it
    assert scripted.closed.wait(WAIT + 5)
    row = p.wait(1)[0]
    assert row["status"] == "disconnected" and row["error"]
    p.stop()
    recs = read_records(path)
    assert len(recs) == 1 and recs[0]["status"] == "disconnected" and recs[0]["request"] == 1
    assert path.read_bytes().endswith(b"\n")


def test_a_broken_upstream_stream_is_cut_and_an_http10_client_reads_to_the_close(scripted, proxied):
    p = proxied(scripted.url)
    with pytest.raises(httpx.RemoteProtocolError):
        # mutant: ending the relayed stream cleanly would pass the break off as a finished answer
        with httpx.stream("POST", p.url + CHAT, json={"mode": "broken", "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            r.read()
    assert p.wait(1)[0]["status"] == "upstream_error"
    scripted.go.set()
    body = json.dumps({"mode": "lockstep", "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", p.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    # an HTTP/1.0 client knows no chunked framing: the bytes as the upstream sent them, then the close
    assert b"chunked" not in head.lower() and rest == _event(0) + _event(1) + b"data: [DONE]\n\n"
    assert p.wait(2)[1]["status"] == "ok"


def test_stopping_the_proxy_mid_stream_cuts_the_upstream_and_records_nothing(scripted, proxied, tmp_path):
    path = tmp_path / "rec.jsonl"
    p = proxied(scripted.url, record=path)
    body = json.dumps({"mode": "lockstep", "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", p.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        got = b""
        while _event(0) not in got:
            got += s.recv(4096)
        p.stop()  # returns once every handler thread has ended
    # mutant: a stop that leaves upstream connections open waits for the upstream (WAIT s), then
    # the stream ends and its row says ok or disconnected
    assert [r["status"] for r in p.requests] == ["stopped"] and not scripted.go.is_set()
    assert path.read_bytes() == b""  # not a finished request: nothing recorded


def test_cli_proxy_runs_in_the_foreground_and_stops_on_sigterm(scripted, tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "proxy", "--upstream", scripted.url,
                             "--port", str(port), "--record", str(tmp_path / "cli.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = proc.stdout.readline()  # printed once the port is bound
        assert f"http://127.0.0.1:{port} -> {scripted.url}" in banner
        scripted.go.set()
        r = httpx.post(f"http://127.0.0.1:{port}{CHAT}", json={"mode": "lockstep", "stream": True}, timeout=30)
        assert r.status_code == 200 and len(sse_events(r.content)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "stopped after 1 requests" in proc.stderr.read()
    assert [r["status"] for r in read_records(tmp_path / "cli.jsonl")] == ["ok"]


# -- pieces -----------------------------------------------------------------------------------------
ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","usage":'
    b'{"input_tokens":3,"cache_read_input_tokens":7,"cache_creation_input_tokens":0,"output_tokens":0}}}\n\n'
    b'event: ping\ndata: {"type":"ping"}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":4}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
RESPONSES_STREAM = (
    b'event: response.output_text.delta\r\ndata: {"type":"response.output_text.delta","delta":"Hi"}\r\n\r\n'
    b'event: response.completed\r\ndata: {"type":"response.completed","response":{"id":"resp_1","status":'
    b'"completed","usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":16},"output_tokens":2,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":22}}}\r\n\r\n')


@pytest.mark.parametrize("stream, expected", [
    (ANTHROPIC_STREAM, ("msg_1", 10, 7, 4, "end_turn")),
    (RESPONSES_STREAM, ("resp_1", 20, 16, 2, "completed"))])
def test_watch_reads_usage_wherever_the_chunks_split(stream, expected):
    from kvlab.proxying.usage import Watch

    whole, byte = Watch(), Watch()
    assert whole.feed(stream)
    firsts = [i for i in range(len(stream)) if byte.feed(stream[i:i + 1])]
    # mutant: a watcher that drops the partial event at a chunk's end reads nothing byte by byte
    for w in (whole, byte):
        assert (w.id, w.prompt_tokens, w.cached_tokens, w.output_tokens, w.finish_reason) == expected
    assert len(firsts) == 1 and stream[:firsts[0] + 1].endswith(b"}\n\n" if b"\r" not in stream else b"}\r\n\r\n")


def test_prompts_of_each_route_and_the_reprs(tmp_path):
    from kvlab.proxying.prompt import prompt_of

    r = prompt_of("/v1/responses", {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}], "tools": [{"name": "f"}]})
    assert [m["content"] for m in r.messages] == ["Be brief.", "Hi"] and r.template_kwargs == {"tools": [{"name": "f"}]}
    assert prompt_of("/v1/completions", {"prompt": [1, 2, 3]}).ids == (1, 2, 3)
    bad = prompt_of("/v1/chat/completions", {"messages": []})
    assert not bad.readable and "non-empty" in bad.problem and bad.structure() == ()
    port = free_port()
    with kv.proxy(f"http://127.0.0.1:{port}/v1/", record=tmp_path / "r.jsonl") as p:
        assert p.upstream == f"http://127.0.0.1:{port}"  # the routes carry /v1
        assert repr(p).startswith(f"Proxy({p.url} -> {p.upstream} running, 0 requests")
        for obj in (p, p.tracker, p.recorder, r, p.tracker.open(CHAT, b"{}")):
            assert "<" in obj._repr_html_() and repr(obj)
    assert "stopped" in repr(p)
    with pytest.raises(kv.KvlabError, match="base URL"):
        kv.proxy("localhost:8080")
