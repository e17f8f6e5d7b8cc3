"""``kvlab proxy --users``: per-user upstream credentials, a per-user ``cache_salt`` injected for an
upstream that takes one (here kvlab serve with one key, whose clients' cache_salt subdivides it:
vLLM's deployment), and rows, diagnostics, /metrics and recordings scoped per user (issue 33).

Mutants caught (each checked by breaking the code): the salt not injected (bob reuses alice's
prompt upstream); the user's proxy key forwarded instead of its credential (the upstream answers
401 to alice, or accepts a key it should never see); rows compared across users (bob's row says it
extends alice's request); the diagnostics log read across users; the recording hashed unsalted."""

import httpx
import pytest

from kvlab.serving.record import read_records

pytestmark = [pytest.mark.serving, pytest.mark.model]

SYSTEM = "You are a careful assistant for a research lab. Answer in one short sentence. " * 2
USER = "Patient John Smith, SSN 123-45-6789, diagnosis: hepatitis B."
USERS = {"ka": ("alice", "sk-up"), "kb": ("bob", "sk-up"), "kd": "dave"}


def _chat(proxy, key, user=USER, **extra):
    return httpx.post(proxy.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "model": "m", "max_tokens": 2, "temperature": 0, **extra,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}, timeout=60)


def _cached(r) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_users_get_their_credentials_salts_and_rows(start, proxied, tiny, tmp_path):
    up = start("radix", api_key="sk-up")
    p = proxied(up.url, tokenizer=tiny, users=USERS, admin_key="root", cache_salt=True,
                tenant_secret=tmp_path / "secret", record=tmp_path / "proxy.jsonl")
    a1 = _chat(p, "ka")
    assert _cached(a1) == 0
    b1 = _chat(p, "kb", prompt_cache_options={"comparison_response_id": a1.json()["id"]})
    assert _cached(b1) == 0  # bob's salt: nothing of alice's upstream
    a2 = _chat(p, "ka")
    assert _cached(a2) == up.results[-1].prompt_tokens - 1  # alice's own, under her salt
    # dave has no upstream credential: his proxy key never goes upstream, so the upstream refuses
    assert _chat(p, "kd").status_code == 401
    assert _chat(p, "nope").status_code == 401 and httpx.get(p.url + "/kvlab/requests", timeout=30).status_code == 401
    assert _chat(p, "ka", cache_salt=5).status_code == 400
    p.wait(4)

    rows = lambda key: httpx.get(p.url + "/kvlab/requests", headers={"Authorization": f"Bearer {key}"},  # noqa: E731
                                 timeout=30).json()
    bob, alice, admin = rows("kb"), rows("ka"), rows("root")
    assert [r["response_id"] for r in bob] == [b1.json()["id"]] and bob[0]["user"] == "bob"
    assert bob[0]["extends"] is None and bob[0]["common_prefix"] is None  # never compared with alice's
    assert [r["response_id"] for r in alice] == [a1.json()["id"], a2.json()["id"]]
    assert alice[1]["extends"] == alice[0]["id"] and alice[1]["common_prefix"] == alice[1]["prompt_tokens"]
    assert [r["user"] for r in admin] == ["alice", "bob", "alice", "dave"]
    assert b1.json()["prompt_cache_diagnostics"]["type"] == "comparison_response_not_found"
    assert "123-45" not in b1.text

    bob_metrics = httpx.get(p.url + "/metrics", headers={"Authorization": "Bearer kb"}, timeout=30).text
    admin_metrics = httpx.get(p.url + "/metrics", headers={"x-api-key": "root"}, timeout=30).text
    assert "kvlab_tenant_" not in bob_metrics and 'kvlab_tenant_requests_total{tenant="alice"} 2.0' in admin_metrics

    p.stop()
    lines = read_records(tmp_path / "proxy.jsonl")
    assert [ln["user"] for ln in lines] == ["alice", "bob", "alice"]  # dave's 401 did not run
    assert lines[0]["kvlab_hash_ids"] == lines[2]["kvlab_hash_ids"]
    assert not set(lines[0]["kvlab_hash_ids"]) & set(lines[1]["kvlab_hash_ids"])


def test_without_the_salt_users_share_the_upstream_cache(start, proxied, tmp_path):
    """The control: the same users without --cache-salt share an upstream that does not tell them apart."""
    up = start("radix")
    p = proxied(up.url, users={"ka": "alice", "kb": "bob"}, tenant_secret=tmp_path / "secret")
    assert _cached(_chat(p, "ka")) == 0
    assert _cached(_chat(p, "kb")) == up.results[-1].prompt_tokens - 1
