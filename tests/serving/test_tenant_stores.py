"""Tenants cannot share KV on ``kvlab serve``, whatever the store and whatever the API (issue 33).

One server per store (radix, shared-radix, paged, system, mlx-lru; a DiskStore and a tiered
paged+disk store each across a restart), three tenants (alice has two keys). In order: alice
caches a conversation, alice's second key reuses all the store can reuse of it, bob reuses 0 (the
chat template's first tokens included: every prompt starts ``<|im_start|>system``), bob then reuses
his own, and alice's requests under a ``cache_salt`` reuse 0 of alice's unsalted ones. After a
restart with the same secret a disk tier still serves alice and bob their own KV, and a new tenant
nothing. Per API (chat, Responses, Anthropic; streamed and not) on a radix server, the cached tokens
each API reports are 0 across tenants and the full reuse within one. On a server with one key, an
unsalted and a ``cache_salt``-ed request share nothing.

Mutants caught (each checked by breaking the code, then restored): the adapter's fetch keyed
without the request's namespace (bob reuses alice's everywhere); its insert keyed without it
(bob reuses alice's, alice's second key reuses 0); the salter ignoring the client's cache_salt;
a tenant salt that is not stable across restarts (a disk tier serves nothing after one)."""

import pytest

import kvlab as kv
from tenant_helpers import ADMIN, APIS, KEYS, ask

pytestmark = [pytest.mark.serving, pytest.mark.model]

SYSTEM = "You are a terse assistant for a research lab. Answer in one short sentence. " * 2
USER = "Which city is the capital of France?"
BLOCK = 16


def full(server, name) -> int:
    """What the store reuses of an identical request (its last token is always recomputed)."""
    n = server.results[-1].prompt_tokens
    if name in ("paged", "tiered"):
        return (n - 1) // BLOCK * BLOCK
    if name == "system":
        toks = server.model.tokenise([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
        return kv.split_at_boundary(toks, at="system").index
    return n - 1


def tenant_server(start, name, model, disk, secret):
    kw = dict(api_keys=KEYS, admin_key=ADMIN, tenant_secret=secret, block_size=BLOCK)
    if name == "disk":
        return start(kv.DiskStore(disk, model=model), **kw)
    if name == "tiered":
        return start("paged", disk=disk, **kw)
    return start(name, **kw)


@pytest.mark.parametrize("name", ["radix", "shared-radix", "paged", "system", "mlx-lru", "disk", "tiered"])
def test_each_store_keeps_tenants_apart(start, tiny, tmp_path, name):
    secret, disk = tmp_path / "secret", tmp_path / "kv"
    server = tenant_server(start, name, tiny, disk, secret)
    assert ask(server, "ka", SYSTEM, USER) == 0
    assert ask(server, "ka2", SYSTEM, USER) == full(server, name) > 0  # alice's other key: her tenant
    assert ask(server, "kb", SYSTEM, USER) == 0  # bob: nothing of alice's, not even the template's start
    assert ask(server, "kb", SYSTEM, USER) == full(server, name)
    assert ask(server, "ka", SYSTEM, USER, cache_salt="project-x") == 0
    assert [r.prompt_tokens > 0 for r in server.results] == [True] * 5
    if name not in ("disk", "tiered"):
        return
    server.stop()
    again = tenant_server(start, name, tiny, disk, secret)
    assert ask(again, "ka", SYSTEM, USER) == full(again, name)  # the same salt: served from disk
    assert ask(again, "kb", SYSTEM, USER) == full(again, name)
    assert ask(again, "kc", SYSTEM, USER) == 0


@pytest.mark.parametrize("api", APIS)
def test_each_api_reports_no_reuse_across_tenants(start, tmp_path, api):
    # a bob per case: each bob's first request is his first ever (nothing of his own cached)
    keys = {"ka": "alice", "ka2": "alice", "kb0": "bob0", "kb1": "bob1"}
    server = start("radix", api_keys=keys, tenant_secret=tmp_path / "secret")
    for stream in (False, True):
        user = f"{USER} ({api}, {'streamed' if stream else 'whole'})"  # a conversation per case
        ask(server, "ka", SYSTEM, user, api=api, stream=stream)
        assert ask(server, f"kb{int(stream)}", SYSTEM, user, api=api, stream=stream) == 0
        reported = ask(server, "ka2", SYSTEM, user, api=api, stream=stream)
        assert reported == server.results[-1].prompt_tokens - 1 == server.results[-1].reused_tokens


def test_unsalted_and_salted_share_nothing(start):
    server = start("radix", api_key="k")
    assert ask(server, "k", SYSTEM, USER) == 0
    assert ask(server, "k", SYSTEM, USER, cache_salt="a") == 0  # salted after unsalted
    assert ask(server, "k", SYSTEM, USER + " Again.") > 0  # unsalted still reuses unsalted
    assert ask(server, "k", SYSTEM, USER + " Once more.", cache_salt="b") == 0
    assert ask(server, "k", SYSTEM, USER, cache_salt="a") == server.results[-1].prompt_tokens - 1
