"""kv.cluster.route in front of real `kvlab serve` instances on the tiny model (in this process,
publishing KV events), one plain mlx_lm.server, and `kvlab cluster up` as processes driven by the
load generator. Order is explicit: send, wait for the instance's final insert (an event) and for
the router's view to hold its events, send the next. Every server and router a test starts is
stopped (by the fixture that started it, or by process id)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from kv_helpers import finished_inserts
from sse_events import sse_events

import kvlab as kv
from kvlab.cluster.realrun import prefix_texts
from kvlab.errors import BlockSizeError, KvlabError
from kvlab.primitives import timing
from kvlab.primitives.kv_events import external_hash
from kvlab.serving import peers
from kvlab.serving.peers import free_port

pytestmark = [pytest.mark.serving, pytest.mark.model]
ROOT = Path(__file__).resolve().parents[2]
CHAT, COMP, HEADER = "/v1/chat/completions", "/v1/completions", "x-kvlab-upstream"
OPENERS = ("Tell me about the long history of green tea in", "Describe how an old steam engine turns",
           "Explain why the sky appears so blue at")


@pytest.fixture
def routed(start, tiny):
    """routed(n, policy, view, **kw) -> (router, servers): n paged `kvlab serve` instances that
    publish KV events, behind a started router; all stopped after the test."""
    made = []

    def _routed(n, policy, view="precise", **kw):
        servers = [start("paged", kv_events="tcp://127.0.0.1:0") for _ in range(n)]
        r = kv.cluster.route([s.url for s in servers], policy, view, tokenizer=tiny, **kw)
        made.append(r)
        return r, servers

    yield _routed
    for r in made:
        r.stop()
        assert not r.running and r.feed is None


def send(r, servers, path, body, served):
    """One request through the router; then wait for its instance's final insert and for the
    router's view to hold the events it caused."""
    resp = httpx.post(r.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    k = [s.url for s in servers].index(resp.headers[HEADER])
    served[k] += 1
    finished_inserts(servers[k], served[k])
    assert r.sync()
    return resp


def converse(r, servers, turns=3):
    """Three conversations, their turns interleaved: where each turn went and what it reused."""
    msgs = {c: [{"role": "user", "content": f"{o} three short sentences, please."}] for c, o in enumerate(OPENERS)}
    where, reused, served = {c: [] for c in msgs}, {c: [] for c in msgs}, [0] * len(servers)
    for t in range(turns):
        for c in msgs:
            resp = send(r, servers, CHAT, {"model": "tiny", "messages": msgs[c], "max_tokens": 4}, served)
            out = resp.json()
            where[c].append(resp.headers[HEADER])
            reused[c].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            msgs[c] = msgs[c] + [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                                 {"role": "user", "content": f"Go on about point {t + 1}."}]
    return where, reused


def test_a_cache_aware_rule_keeps_each_conversation_on_one_instance_round_robin_does_not(routed):
    r, servers = routed(2, "llmd_weighted", capacity_tokens=4096)
    where, reused = converse(r, servers)
    # mutant "decide reads a view without the events": turns scatter and reuse nothing
    assert all(len(set(w)) == 1 for w in where.values()), where
    assert len({w[0] for w in where.values()}) == 2  # the KV-usage term spread the conversations
    assert all(x > 0 for rs in reused.values() for x in rs[1:]), reused
    rows = r.listing()
    # the precise view is the store: the match the router saw is what the instance reused
    # (mutant: a publisher that misses a block, or a router hashing other ids than the server)
    assert [row["view_match_tokens"] for row in rows] == [row["reused_tokens"] for row in rows]
    for i, s in enumerate(servers):  # the events match what each store holds
        assert r.live.blocks(i, timing.now()) == {external_hash(h) for h in s.kv_events.published}
    assert all(row["view_behind"] is False and row["view_agrees"] and row["refused_by"] == [] for row in rows)

    rr, servers2 = routed(2, "round_robin")
    where2, reused2 = converse(rr, servers2)
    assert all(len(set(w)) == 2 for w in where2.values())  # three conversations over two instances
    # a second turn lands on the instance that never saw its conversation: nothing to reuse
    assert [rs[1] for rs in reused2.values()] == [0, 0, 0]
    assert sum(map(sum, reused2.values())) < sum(map(sum, reused.values()))


@pytest.mark.parametrize("policy, view", [("llmd_weighted", "precise"), ("sglang_cache_aware", "approximate"),
                                          ("round_robin", "precise")])
def test_the_simulator_routes_and_reuses_as_the_real_cluster(routed, tiny, policy, view):
    texts = prefix_texts(tiny.tokenizer, groups=3, per_group=4, base_words=24, step_words=8)
    r, servers = routed(2, policy, view, capacity_tokens=4096)
    served = [0, 0]
    for t in texts:
        send(r, servers, COMP, {"model": "tiny", "prompt": t, "max_tokens": 1}, served)
    rows = r.listing()
    ids = [tiny.tokenizer.encode(t) for t in texts]
    assert [row["prompt_tokens"] for row in rows] == [len(x) for x in ids]  # the router hashed the server's ids
    # one request at a time, a second apart: nothing queues in the model either
    trace = kv.traces.from_requests(ids, 1, 16, timestamps=[1000 * i for i in range(len(ids))])
    sim = kv.simulate(trace, instances=2, router=policy, view=view, capacity_tokens=4096).requests
    # mutant checked: an approximate view that records all but the last full block parts sglang's choices
    assert [row["instance"] for row in rows] == sim["instance"].to_list()
    assert [row["reused_tokens"] for row in rows] == sim["hit_tokens"].to_list()
    assert [row["view_match_tokens"] for row in rows] == sim["view_match_tokens"].to_list()
    assert sum(sim["hit_tokens"]) > 0 and len(set(sim["instance"])) == 2


def test_routes_pass_through_streamed_and_not_with_usage_and_the_upstreams_own_diagnostics(routed):
    r, servers = routed(2, "sglang_cache_aware", "approximate")
    msgs = [{"role": "user", "content": OPENERS[0] + " one sentence."}]
    first = httpx.post(r.url + CHAT, json={"model": "tiny", "messages": msgs, "max_tokens": 3}, timeout=120)
    finished_inserts(next(s for s in servers if s.url == first.headers[HEADER]), 1)
    msgs += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Shorter."}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True},
            "prompt_cache_options": {"comparison_response_id": first.json()["id"]}}
    with httpx.stream("POST", r.url + CHAT, json=body, timeout=120) as resp:
        assert resp.headers[HEADER] == first.headers[HEADER]  # the same instance, named
        events = sse_events(resp.read())
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    # the instance answered the diagnostics itself (the router does not, unlike kvlab proxy:
    # mutant answers_diagnostics=True replaces it with the proxy's own, which has no store detail)
    diag = events[0]["prompt_cache_diagnostics"]
    assert diag["type"] == "cache_hit" and "store" in diag["kvlab"]
    msg = httpx.post(r.url + "/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Hello there."}]}, timeout=120)
    assert msg.status_code == 200 and msg.headers[HEADER] in [s.url for s in servers]
    assert {"input_tokens", "cache_read_input_tokens"} <= set(msg.json()["usage"])
    assert [row["reused_tokens"] for row in r.wait(3)] == [0, usage["prompt_tokens_details"]["cached_tokens"],
                                                          msg.json()["usage"]["cache_read_input_tokens"]]


def test_hashes_the_instance_does_not_share_are_said_not_hidden(start, tiny, caplog):
    # the instance strips the billing header before it keys (--normalise); the router hashes the
    # prompt as sent: its precise view can never match, though the instance reuses almost everything
    server = start("paged", kv_events="tcp://127.0.0.1:0", normalise=True)
    with kv.cluster.route([server.url], "llmd_weighted", tokenizer=tiny) as r:
        for n, cch in enumerate(("eb6c6", "91f02"), start=1):
            system = f"x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={cch};\n" + (
                "You are a careful assistant for a research lab. " * 4)
            body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                                  {"role": "user", "content": "Fix the test."}]}
            send(r, [server], CHAT, body, [n - 1])
        rows = r.listing()
    assert rows[1]["view_match_tokens"] == 0 and rows[1]["reused_tokens"] > 16
    # mutant: view_agrees always True (the silent zero the issue names)
    assert [row["view_agrees"] for row in rows] == [True, False]
    assert "block hashes are not the router's" in caplog.text


def test_a_dead_instance_is_marked_down_its_requests_go_elsewhere_then_a_502_names_them(start):
    a, b = start("paged"), start("paged")
    with kv.cluster.route([a.url, b.url], "round_robin", "approximate") as r:
        def post():
            return httpx.post(r.url + COMP, json={"model": "tiny", "prompt": "Hi there.", "max_tokens": 1},
                              timeout=120)

        assert post().headers[HEADER] == a.url
        b.stop()
        second = post()  # round robin's turn for b, which is gone: a takes it
        assert second.status_code == 200 and second.headers[HEADER] == a.url  # mutant: no retry, a 502
        rows = r.listing()
        assert rows[1]["refused_by"] == [b.url] and rows[1]["instance"] == 0
        state = r.describe()["instances"]
        assert state[1]["up"] is False and "connection refused" in state[1]["down_because"]
        a.stop()
        third = post()
        assert third.status_code == 502
        message = third.json()["error"]["message"]
        assert a.url in message and b.url in message and "connection refused" in message
        assert r.listing()[2]["status"] == "upstream_unreachable"  # never lost silently


class Dropper(BaseHTTPRequestHandler):
    """An upstream that answers /health and then drops every request it receives, unanswered."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.close_connection = True  # no response: the client sees the connection close

    def log_message(self, *args):
        pass


def test_a_request_an_instance_received_and_dropped_gets_a_502_not_a_second_run(start):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dropper)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    dropper, a = f"http://127.0.0.1:{httpd.server_address[1]}", start("paged")
    try:
        with kv.cluster.route([dropper, a.url], "round_robin", "approximate") as r:
            resp = httpx.post(r.url + COMP, json={"model": "tiny", "prompt": "Hi.", "max_tokens": 1}, timeout=60)
            # mutant "retry whatever failed": a runs it too (200), a request run twice
            assert resp.status_code == 502 and dropper in resp.json()["error"]["message"]
            assert a.stats()["requests"] == 0 and r.listing()[0]["refused_by"] == [dropper]
            assert r.describe()["instances"][0]["up"] is False
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_the_router_refuses_at_start_what_would_fail_silently(start, tiny):
    plain = start("paged")
    with pytest.raises(KvlabError, match=f"the upstream {plain.url} publishes no KV events.*--view approximate"):
        kv.cluster.route([plain.url], "llmd_weighted", "precise", tokenizer=tiny)
    events = start("paged", kv_events="tcp://127.0.0.1:0")
    with pytest.raises(BlockSizeError, match="publishes 16-token blocks and the router hashes 32-token blocks"
                                             ".*--block-size 16"):
        kv.cluster.route([events.url], "llmd_weighted", tokenizer=tiny, block_size=32)
    port = free_port()
    with pytest.raises(KvlabError, match=f"the upstream http://127.0.0.1:{port} does not answer GET /health"):
        kv.cluster.route([events.url, f"http://127.0.0.1:{port}"], "round_robin", "approximate")
    with pytest.raises(KvlabError, match="llmd_weighted reads each request's blocks: give the router the"):
        kv.cluster.route([events.url], "llmd_weighted")
    with pytest.raises(KvlabError, match="unknown router 'nope'; use one of random, round_robin"):
        kv.cluster.route([events.url], "nope")
    with pytest.raises(KvlabError, match="'shared' is a ceiling of the simulator"):
        kv.cluster.route([events.url], "shared")


def test_it_fronts_plain_mlx_lm_servers_with_the_approximate_view(start, tiny):
    with peers.start_mlx_lm(tiny) as srv:
        other = start("paged")
        with pytest.raises(KvlabError, match=f"the upstream {srv.url} publishes no KV events"):
            kv.cluster.route([srv.url, other.url], "llmd_weighted", "precise", tokenizer=tiny)
        with kv.cluster.route([srv.url, other.url], "sglang_cache_aware", "approximate", tokenizer=tiny) as r:
            msgs = [{"role": "user", "content": OPENERS[1] + " in one sentence."}]
            for _ in range(2):
                resp = httpx.post(r.url + CHAT, json={"model": "default_model", "messages": msgs, "max_tokens": 3},
                                  timeout=120)
                assert resp.status_code == 200 and resp.headers[HEADER] == srv.url
                msgs += [{"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And then?"}]
            rows = r.listing()
    assert rows[1]["view_match_tokens"] > 0 and rows[1]["instance"] == 0
    assert rows[1]["reused_tokens"] == resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cluster_up_is_driven_by_the_load_generator_and_stops_every_process_by_its_id():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "cluster", "up", "--instances", "2", "--model",
                             "tiny", "--port", str(port), "--policy", "sglang_cache_aware", "--view", "approximate"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = proc.stdout.readline()  # printed once the instances and the router answer
        pids = [int(p) for p in re.findall(r"pid (\d+)", banner)]
        assert len(pids) == 3, banner + proc.stderr.read()
        url = f"http://127.0.0.1:{port}"
        load = kv.generate_load(url, "multi_turn", concurrency=1, num_requests=6, warmup=False, progress=False,
                                model="tiny")
        frame = load.frame.sort("request")
        assert frame["ok"].to_list() == [True] * 6
        route = httpx.get(url + "/kvlab/route?sync=1", timeout=60).json()
        rows, sessions = route["rows"], frame["session"].to_list()
        by_session = {}
        for s, row in zip(sessions, rows):
            by_session.setdefault(s, []).append(row)
        # every turn of a session on one instance, reusing on every later turn
        assert all(len({row["instance"] for row in rs}) == 1 for rs in by_session.values()), rows
        assert all(row["reused_tokens"] > 0 for rs in by_session.values() for row in rs[1:]), rows
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "stopped 3 processes" in proc.stderr.read()
    for pid in pids:  # mutant: a stop that leaves an instance running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
