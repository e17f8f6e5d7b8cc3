"""GET /metrics on kvlab serve and kvlab proxy (kvlab.serving.prometheus): exact counter values
after a known sequence of requests, read the way Prometheus reads them (the text format, parsed
with prometheus_client's own parser). Histogram counts are asserted, never where a time falls.
Every server and proxy a test starts is stopped by the fixture that started it."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import polars as pl
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import kvlab as kv
from kvlab.policies.reasons import ALL_REASONS
from kvlab.result import Result
from kvlab.serving.events import ServerEvents
from kvlab.serving.prometheus import ProxyMetrics, ServerMetrics

CHAT = "/v1/chat/completions"


def scrape(url: str, **headers) -> dict:
    """``{(sample name, frozenset of labels): value}`` of one scrape of ``url``/metrics."""
    r = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST  # Prometheus' text format
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def named(samples: dict, name: str) -> dict:
    """``{((label, value), ...): value}`` of the samples called ``name``."""
    return {tuple(sorted(k[1])): v for k, v in samples.items() if k[0] == name}


def conversation(system_prompt):
    """A request, the same request again, and an extension of it (the next turn)."""
    first = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "What is a prefix cache?"}]
    turn = first + [{"role": "assistant", "content": "A cache of prompt prefixes."},
                    {"role": "user", "content": "And why does it miss?"}]
    return [first, first, turn]


@pytest.mark.serving
@pytest.mark.model
def test_serve_metrics_count_a_known_sequence(start, client, system_prompt, no_eos):
    server = start("radix")
    c = client(server)
    usages = [c.chat.completions.create(model="tiny", messages=m, max_tokens=4, temperature=0,
                                        logit_bias=no_eos).usage for m in conversation(system_prompt)]
    # the responses have ended: each request's prompt + output is in the store (kvlab serve's promise)
    m = scrape(server.url)
    stats = httpx.get(server.url + "/kvlab/stats", timeout=30).json()

    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    # mutant: requests counted from arrivals, or counted again on every scrape
    assert named(m, "kvlab_requests_total") == {(("api", "chat"), ("status", "ok")): 3.0}
    # mutant: prompt or cached tokens from another source than what the responses reported
    assert value(m, "kvlab_prompt_tokens_total") == prompt
    assert value(m, "kvlab_cached_tokens_total") == cached > 0  # the repeat and the extension hit
    assert value(m, "kvlab_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 12
    # mutant: a miss reason dropped or counted twice (every missed token has exactly one reason)
    missed = {dict(k[1])["reason"]: v for k, v in m.items() if k[0] == "kvlab_missed_tokens_total"}
    assert set(missed) == set(ALL_REASONS) and sum(missed.values()) == prompt - cached
    # mutant: the per-request hit rate under the per-token name (pitfall 10)
    assert value(m, "kvlab_token_hit_ratio") == pytest.approx(cached / prompt, rel=1e-12)
    assert value(m, "kvlab_request_hit_ratio") == pytest.approx(2 / 3, rel=1e-12)
    # mutant: ITL observing every token (12) instead of the gaps between them (3 x 3)
    assert value(m, "kvlab_time_to_first_token_seconds_count") == 3
    assert value(m, "kvlab_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert value(m, "kvlab_inter_token_latency_seconds_count") == 3 * (4 - 1)
    # mutant: the budget reported as the bytes held (peak bytes: the fold test below)
    assert value(m, "kvlab_store_bytes") == stats["bytes"] > 0
    assert value(m, "kvlab_store_entries") == stats["entries"]
    # mutant: a longer entry subsuming a shorter one counted as an eviction (nothing was evicted)
    assert named(m, "kvlab_evictions_total") == {}
    assert value(m, "kvlab_store_removals_total", reason="subsumed") > 0
    # mutant: the scrape-time fold not remembering where it stopped (a second scrape doubles)
    assert scrape(server.url) == m


@pytest.mark.serving
@pytest.mark.model
def test_metrics_follow_the_api_key_rule(start):
    """/metrics is behind the API key like every route (a scraper sends it as a bearer token).
    Mutant: the route answered before the key is checked."""
    server = start("radix", api_key="s3cret")
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    m = scrape(server.url, Authorization="Bearer s3cret")
    assert value(m, "kvlab_store_bytes") == 0 and named(m, "kvlab_requests_total") == {}


@pytest.mark.serving
@pytest.mark.model
@pytest.mark.parametrize("store", ["radix", "paged"])
def test_a_tiny_budget_shows_evictions_by_policy(start, client, store, no_eos):
    """Mutants: evictions read from another event than the store's removals for room (radix's
    ``evict``, paged's ``block_removed``), or labelled by something else than the policy."""
    budget = 40_000  # holds a request's KV (~17 KB) but not three
    server = start(store, budget=budget)
    c = client(server)
    for q in ("the first question about caches", "a second different question entirely",
              "third thing to ask now"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=4,
                                  temperature=0, logit_bias=no_eos)
    m = scrape(server.url)  # the responses have ended: so have their inserts and evictions
    ev = server.events.filter(pl.col("event").is_in(["evict", "block_removed"]) & (pl.col("detail") == "lru"))
    assert ev.height > 0
    assert named(m, "kvlab_evictions_total") == {(("policy", "lru"),): ev.height}
    assert value(m, "kvlab_evicted_bytes_total", policy="lru") == ev["bytes"].sum() > 0
    assert value(m, "kvlab_store_budget_bytes") == budget
    assert 0 < value(m, "kvlab_store_bytes") == server.stats()["bytes"] <= budget


@pytest.mark.serving
@pytest.mark.model
def test_proxy_metrics_count_what_the_upstream_reported(start, client, proxied, system_prompt, no_eos):
    server = start("radix")
    p = proxied(server.url)
    c = client(p)
    usages = []
    for i, msgs in enumerate(conversation(system_prompt)):
        kw = dict(model="tiny", messages=msgs, max_tokens=4, temperature=0, logit_bias=no_eos)
        if i == 1:  # one streamed: its usage comes in the last chunk
            chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            usages.append(chunks[-1].usage)
        else:
            usages.append(c.chat.completions.create(**kw).usage)
    bad = httpx.post(p.url + CHAT, json={"model": "tiny", "messages": []}, timeout=30)
    assert bad.status_code == 400  # kvlab serve refuses it before generation
    m, up = scrape(p.url), scrape(server.url)

    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    # mutant: only the requests that ran counted (the refused one has a row too)
    assert named(m, "kvlab_requests_total") == {(("route", CHAT), ("status", "ok")): 3.0,
                                                (("route", CHAT), ("status", "error")): 1.0}
    assert named(up, "kvlab_requests_total") == {(("api", "chat"), ("status", "ok")): 3.0}
    # mutant: the proxy's own token count in place of the upstream's report
    assert value(m, "kvlab_upstream_prompt_tokens_total") == prompt == value(up, "kvlab_prompt_tokens_total")
    assert value(m, "kvlab_upstream_cached_tokens_total") == cached == value(up, "kvlab_cached_tokens_total")
    assert cached > 0 and value(m, "kvlab_upstream_cache_unreported_requests_total") == 0
    assert value(m, "kvlab_upstream_token_hit_ratio") == pytest.approx(cached / prompt, rel=1e-12)
    assert value(m, "kvlab_generation_tokens_total") == 12
    assert value(m, "kvlab_time_to_first_token_seconds_count") == 3
    assert value(m, "kvlab_e2e_request_latency_seconds_count") == 3
    # only the streamed request has gaps at the proxy: at most one per token after the first
    # (fewer when one read brings several tokens, so the exact count is the network's)
    assert value(m, "kvlab_inter_token_latency_seconds_count") <= 3
    assert scrape(p.url) == m


# -- without a model: the fold itself -----------------------------------------------------------
class Adapter:
    nbytes, peak_bytes, budget_bytes = 123, 456, None

    def __len__(self):
        return 1


def fake_server(results, inflight=()):
    return SimpleNamespace(ledger=SimpleNamespace(finished=lambda: list(results), on_token=None, tenant_of={},
                                                  inflight=inflight), events_log=ServerEvents(), adapter=Adapter())


def result(rid, prompt, reused, out, reasons):
    return Result(request_id=rid, prompt_tokens=prompt, reused_tokens=reused, prefilled_tokens=prompt - reused,
                  match="prefix" if reused else "miss", ttft_s=0.1, lookup_s=0.0, restore_s=0.0, prefill_s=0.1,
                  decode_s=0.1, output_ids=tuple(range(out)), text="", store_bytes=0, evictions=0,
                  miss_reasons=reasons)


def test_server_metrics_fold_statuses_evictions_and_token_gaps():
    """Mutants: a failed request missing from requests_total (counted from results only), the
    token gaps of a failed request counted in ITL or never dropped, subsumed removals counted as evictions, and
    metrics registered in prometheus_client's process-wide registry (two servers collide), the
    store's peak bytes reported as the bytes it holds."""
    results, inflight = [], [1, 2]
    server = fake_server(results, inflight)
    metrics = ServerMetrics(server)
    other = ServerMetrics(fake_server([]))  # a second server in the same process
    assert server.ledger.on_token == metrics.token
    log = server.events_log
    log.add("arrive", request=1, detail="chat")
    log.add("arrive", request=2, detail="messages")
    for rid, reasons in ((1, (None, None)), (2, (None, None))):
        for finish_reason in reasons:
            metrics.token(rid, SimpleNamespace(finish_reason=finish_reason))
    log.add("finish", request=1, detail="error: generation failed")
    inflight.remove(1)
    metrics.token(2, SimpleNamespace(finish_reason="length"))  # request 2's last token
    assert metrics._times == {}  # nothing left behind by the failed request
    log.add("evict", request=2, tokens=16, nbytes=1000, entry="1", detail="subsumed")
    log.add("evict", request=2, tokens=32, nbytes=2000, entry="2", detail="lru")
    log.add("finish", request=2, detail="ok")
    results.append(result(2, 10, 4, 3, {"first_seen": 5, "partial_block": 1}))
    v = metrics.values()
    k = lambda name, **labels: (name, tuple(sorted(labels.items())))  # noqa: E731
    assert v[k("kvlab_requests_total", api="chat", status="error")] == 1
    assert v[k("kvlab_requests_total", api="messages", status="ok")] == 1
    assert v["kvlab_prompt_tokens_total"] == 10 and v["kvlab_cached_tokens_total"] == 4
    assert v["kvlab_token_hit_ratio"] == 0.4 and v["kvlab_request_hit_ratio"] == 1.0
    assert v[k("kvlab_missed_tokens_total", reason="first_seen")] == 5
    assert v[k("kvlab_missed_tokens_total", reason="evicted")] == 0
    assert v["kvlab_inter_token_latency_seconds_count"] == 2  # request 2's three tokens; not request 1's
    assert v[k("kvlab_evictions_total", policy="lru")] == 1
    assert v[k("kvlab_evicted_bytes_total", policy="lru")] == 2000
    assert v[k("kvlab_store_removals_total", reason="subsumed")] == 1
    assert ("kvlab_evictions_total", (("policy", "subsumed"),)) not in v
    assert v["kvlab_store_bytes"] == 123 and "kvlab_store_budget_bytes" not in v
    assert metrics.values() == v  # folding is idempotent
    assert metrics.registry is not other.registry and other.values()["kvlab_prompt_tokens_total"] == 0
    assert not [f.name for f in REGISTRY.collect() if f.name.startswith("kvlab_")]
    assert repr(metrics) == "ServerMetrics(2 requests)" and "kvlab_store_bytes" in metrics._repr_html_()


def test_proxy_hit_ratio_leaves_out_unreported_requests():
    """Mutants: a request whose upstream reported no cached count taken as 0 cached, which drags
    the ratio down (4 / 30 instead of 4 / 10); the gaps of a stream cut short counted in ITL."""
    rows = [{"route": CHAT, "status": "ok", "upstream_prompt_tokens": 10, "reused_tokens": 4,
             "output_tokens": 2, "ttft_s": 0.1, "e2e_s": 0.2},
            {"route": CHAT, "status": "ok", "upstream_prompt_tokens": 20, "reused_tokens": None,
             "output_tokens": 2, "ttft_s": 0.1, "e2e_s": 0.2},
            {"route": "/v1/messages", "status": "upstream_unreachable", "upstream_prompt_tokens": None,
             "reused_tokens": None, "output_tokens": None, "ttft_s": None, "e2e_s": 0.01}]
    metrics = ProxyMetrics(SimpleNamespace(listing=lambda since=0: rows[since:]))
    for rid, chunks, status in ((1, 3, "ok"), (2, 4, "disconnected")):
        for _ in range(chunks):
            metrics.output(rid)
        metrics.finished(rid, status)
    v = metrics.values()
    assert v["kvlab_inter_token_latency_seconds_count"] == 2  # request 1's gaps; not the cut stream's
    assert v[("kvlab_requests_total", (("route", CHAT), ("status", "ok")))] == 2
    assert v[("kvlab_requests_total", (("route", "/v1/messages"), ("status", "upstream_unreachable")))] == 1
    assert v["kvlab_upstream_prompt_tokens_total"] == 30 and v["kvlab_upstream_cached_tokens_total"] == 4
    assert v["kvlab_upstream_cache_unreported_requests_total"] == 1
    assert v["kvlab_upstream_token_hit_ratio"] == 0.4
    assert v["kvlab_e2e_request_latency_seconds_count"] == 2  # the unreachable one ran nowhere
    assert metrics.values() == v and "kvlab proxy" in metrics._repr_html_()
