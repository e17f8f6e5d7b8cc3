"""Every route of ``kvlab serve`` that reports on the cache answers from what the caller's tenant
may see (issue 33), one test per route on one scenario, run once per worker.

The server keeps one system prompt (the system store: a tenant's insert replaces another's entry,
the store's removals and its "differs from the cached one (N tokens)" happen across tenants). In
order: alice caches S+U (response a1); bob sends the same, naming a1 for a comparison (his insert
replaces alice's entry); alice's second key sends S+U again (a miss: evicted, by bob's request);
bob asks Anthropic's diagnostics about a1; the admin compares with a1. Each test names the mutant
it catches; each was checked by breaking the code."""

import json
import time

import httpx
import pytest

import kvlab as kv
from kvlab.serving.record import read_records
from tenant_helpers import ADMIN, KEYS

pytestmark = [pytest.mark.serving, pytest.mark.model]

SYSTEM = "You are a careful assistant for a research lab. Answer in one short sentence. " * 2
USER = "Patient John Smith, SSN 123-45-6789, diagnosis: hepatitis B."


def _h(key):
    return {"Authorization": f"Bearer {key}"}


def _post(server, key, route, body):
    r = httpx.post(server.url + route, headers=_h(key), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(server, key, **extra):
    return _post(server, key, "/v1/chat/completions", {
        "model": "m", "max_tokens": 2, "temperature": 0, **extra,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]})


def _get(server, key, route, **params):
    r = httpx.get(server.url + route, headers=_h(key), params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json() if route != "/metrics" else r.text


def _settle(server):
    """Wait until mlx-lm's insert of the last prompt + output has run (it follows the response's
    end on the generation thread), so every event row is in."""
    deadline = time.monotonic() + 30
    while server.adapter.finishing_rid is not None or server.ledger.inflight:
        assert time.monotonic() < deadline, "the server never settled"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def seen(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenant-routes")
    server = kv.serve(tiny, "system", api_keys=KEYS, admin_key=ADMIN, tenant_secret=tmp / "secret",
                      record=tmp / "rec.jsonl")
    fed = []
    server.tenant("bob").on_result(lambda _, r: fed.append(r.request_id))
    try:
        a1 = _chat(server, "ka")
        b1 = _chat(server, "kb", prompt_cache_options={"comparison_response_id": a1["id"]})
        a2 = _chat(server, "ka2")
        b2 = _post(server, "kb", "/v1/messages", {
            "model": "c", "max_tokens": 2, "system": SYSTEM, "messages": [{"role": "user", "content": USER}],
            "diagnostics": {"previous_message_id": a1["id"]}})
        root = _chat(server, ADMIN, prompt_cache_options={"comparison_response_id": a1["id"]})
        _settle(server)
        server.ledger.close()  # the listener thread has delivered everything
        yield {"server": server, "a1": a1, "b1": b1, "a2": a2, "b2": b2, "root": root, "fed": fed,
               "record": tmp / "rec.jsonl"}
    finally:
        server.stop()


def test_requests_route_lists_only_the_tenants_own(seen):
    s = seen["server"]
    bob = _get(s, "kb", "/kvlab/requests")
    alice = _get(s, "ka2", "/kvlab/requests")
    admin = _get(s, ADMIN, "/kvlab/requests")
    # mutant "rows unfiltered": bob would list a1's response id (issue 33's transcript)
    assert [r["response_id"] for r in bob["requests"]] == [seen["b1"]["id"], seen["b2"]["id"]]
    assert [r["seq"] for r in bob["requests"]] == [0, 1] and bob["next"] == 2  # numbered for bob alone
    assert {r["tenant"] for r in bob["requests"]} == {"bob"}
    assert [r["response_id"] for r in alice["requests"]] == [seen["a1"]["id"], seen["a2"]["id"]]
    assert len(admin["requests"]) == 5 and admin["next"] == 5
    assert [r["tenant"] for r in admin["requests"]] == ["alice", "bob", "alice", "bob", "*admin"]
    assert _get(s, "kb", "/kvlab/requests", since=1)["requests"][0]["response_id"] == seen["b2"]["id"]


def test_miss_reasons_never_say_another_tenant_holds_the_tokens(seen):
    bob_first = _get(seen["server"], "kb", "/kvlab/requests")["requests"][0]
    # mutant "one miss memory for every tenant": the same ids cached under alice's salt made
    # this salt_or_extra_keys, telling bob that someone sent exactly his prompt
    assert "salt_or_extra_keys" not in bob_first["miss_reasons"]
    assert bob_first["main_reason"] == "first_seen" and bob_first["reused_tokens"] == 0


def test_evicted_by_and_the_stores_word_stay_with_their_tenant(seen):
    s = seen["server"]
    alice_second = _get(s, "ka", "/kvlab/requests")["requests"][1]
    admin_row = _get(s, ADMIN, "/kvlab/requests")["requests"][2]
    bob_rid = _get(s, ADMIN, "/kvlab/requests")["requests"][1]["request_id"]
    # the operator sees why: bob's request evicted alice's entry, and the store said so
    assert admin_row["evicted_by"] == bob_rid and "differs from the cached one" in admin_row["why"]
    assert admin_row["miss_reasons"].get("evicted", 0) > 0
    # mutant "evicted_by unredacted": alice would learn bob's request id; mutant "the store's
    # why unscoped": she would read the length of the system prompt bob cached
    assert alice_second["evicted_by"] is None and alice_second["why"] == ""
    assert alice_second["miss_reasons"] == admin_row["miss_reasons"]  # her own tokens' reasons stay


def test_events_route_shows_only_the_tenants_rows(seen):
    s = seen["server"]
    rids = {t: {r["request_id"] for r in _get(s, ADMIN, "/kvlab/requests")["requests"] if r["tenant"] == t}
            for t in ("alice", "bob")}
    bob = _get(s, "kb", "/kvlab/events")["events"]
    alice = _get(s, "ka", "/kvlab/events")["events"]
    everything = _get(s, ADMIN, "/kvlab/events")["events"]
    # mutant "events unfiltered": bob reads alice's rows
    assert bob and {e["tenant"] for e in bob} == {"bob"} and not {e["request"] for e in bob} & rids["alice"]
    # alice's second and the admin's request evicted bob's entry: his rows, without their numbers
    assert [e["request"] for e in bob if e["event"] == "evict"] == [None, None]
    # mutant "a removal belongs to the request that caused it": bob's insert evicted alice's
    # entry, and that row (with her entry's token count) would be his
    evictions = [e for e in everything if e["event"] == "evict" and e["request"] in rids["bob"]]
    assert evictions and all(e["tenant"] == "alice" for e in evictions)
    assert not [e for e in bob if e["event"] == "evict" and e["request"] in rids["bob"]]
    assert [e["seq"] for e in alice if e["event"] == "evict"] == [e["seq"] for e in everything
                                                                  if e["event"] == "evict" and e["tenant"] == "alice"]
    assert len(everything) > len(alice) + len(bob)  # the admin's own rows too


def test_stats_route_counts_only_the_tenants_requests(seen):
    s = seen["server"]
    bob, admin = _get(s, "kb", "/kvlab/stats"), _get(s, ADMIN, "/kvlab/stats")
    # mutant "stats unscoped": bob counts 5 requests and reads the store's bytes and entries
    assert bob["requests"] == 2 and bob["tenant"] == "bob" and admin["requests"] == 5
    assert not {"bytes", "entries", "lookups", "hits", "peak_bytes", "by_type", "events"} & set(bob)
    assert admin["entries"] == 1 and admin["bytes"] > 0


def test_diagnostics_never_compare_across_tenants(seen):
    # mutant "diagnostics log unscoped": bob's answer would carry a1's text (the transcript)
    assert seen["b1"]["prompt_cache_diagnostics"]["type"] == "comparison_response_not_found"
    assert "123-45" not in json.dumps(seen["b1"]) and "123-45" not in json.dumps(seen["b2"])
    assert seen["b2"]["diagnostics"]["cache_miss_reason"]["type"] == "previous_message_not_found"
    # the admin may compare with anyone's response
    assert seen["root"]["prompt_cache_diagnostics"]["type"] != "comparison_response_not_found"


def test_metrics_route_is_aggregates_unless_admin(seen):
    s = seen["server"]
    bob, admin = _get(s, "kb", "/metrics"), _get(s, ADMIN, "/metrics")
    assert "kvlab_requests_total" in bob and "kvlab_requests_total" in admin
    # mutant "per-tenant series for everyone": bob would read alice's traffic by name
    assert "kvlab_tenant_" not in bob and "alice" not in bob
    assert 'kvlab_tenant_requests_total{tenant="alice"} 2.0' in admin
    assert 'kvlab_tenant_requests_total{tenant="bob"} 2.0' in admin


def test_inspector_feed_is_the_tenants_own(seen):
    s = seen["server"]
    view = s.tenant("bob")
    mine = [r["request_id"] for r in _get(s, "kb", "/kvlab/requests")["requests"]]
    # mutant "the view reads the server's lists": alice's and the admin's results in bob's feed
    assert [r.request_id for r in view.results] == mine == seen["fed"]
    assert set(view.events["tenant"].to_list()) == {"bob"} and view.store is None
    assert view.stats()["requests"] == 2
    with pytest.raises(kv.KvlabError, match="no tenant 'mallory'"):
        s.tenant("mallory")


def test_recorded_trace_hashes_each_tenant_apart(seen):
    lines = read_records(seen["record"])
    assert [ln["tenant"] for ln in lines] == ["alice", "bob", "alice", "bob", "*admin"]
    a1, b1, a2 = lines[0], lines[1], lines[2]
    assert a1["input_length"] == b1["input_length"] == a2["input_length"]
    # mutant "hash ids of the ids alone": two tenants' equal prompts get equal hash ids, and the
    # file tells that bob sent exactly alice's prompt
    assert a1["kvlab_hash_ids"] == a2["kvlab_hash_ids"] and not set(a1["kvlab_hash_ids"]) & set(b1["kvlab_hash_ids"])
    assert a1["hash_ids"] != b1["hash_ids"] and "key" not in a1


def test_bad_input_is_refused(seen):
    s = seen["server"]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "cache_salt": 7}
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        b = dict(body, input="hi") if route == "/v1/responses" else body
        r = httpx.post(s.url + route, headers=_h("ka"), json=b, timeout=30)
        assert r.status_code == 400 and "cache_salt must be a non-empty string" in r.text, route
    r = httpx.post(s.url + "/v1/chat/completions", headers=_h("not-a-key"), json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(s.url + "/kvlab/requests", timeout=30).status_code == 401
