"""Tenants are isolated in every store: a request never reuses KV cached under another salt.

Through ``Engine.run(request, salt=...)`` on the tiny model, for each store by its make_store name:
"alice" then "bob" reuses 0 tokens; "alice" then "alice" reuses fully (what the store can reuse of
an identical request: all but the last token for radix and mlx-lru, the leading full blocks of those
for paged, the system prefix for the system-prompt store). The system-prompt store keeps one entry,
the last tenant's prefix, by design: in alice, bob, alice the third request is a miss.

Mutant caught: a CacheKey that ignores its salt (``test_salt_ignored_in_cache_key_is_caught``).
"""

import pytest

import kvlab as kv
from kvlab.keys import CacheKey
from kvlab.stores import make_store

pytestmark = pytest.mark.model

STORES = ("radix", "paged", "system", "mlx-lru")
BLOCK = 16
CONVERSATION = [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]


def full_reuse(model, name) -> int:
    toks = model.tokenise(CONVERSATION)
    n = len(toks.ids)
    return {"radix": n - 1, "mlx-lru": n - 1, "paged": (n - 1) // BLOCK * BLOCK,
            "system": kv.split_at_boundary(toks, at="system").index}[name]


def reused(model, name, salts) -> list[int]:
    engine = kv.Engine(model, make_store(name, block_size=BLOCK))
    return [engine.run(CONVERSATION, max_tokens=2, salt=s).reused_tokens for s in salts]


@pytest.mark.parametrize("name", STORES)
def test_other_tenant_reuses_nothing(tiny, name):
    assert full_reuse(tiny, name) > 0
    assert reused(tiny, name, ["alice", "bob"]) == [0, 0]


@pytest.mark.parametrize("name", STORES)
def test_same_tenant_reuses_fully(tiny, name):
    assert reused(tiny, name, ["alice", "alice"]) == [0, full_reuse(tiny, name)]
    assert reused(tiny, name, [None, None]) == [0, full_reuse(tiny, name)]


@pytest.mark.parametrize("name", STORES)
def test_alice_bob_alice(tiny, name):
    third = 0 if name == "system" else full_reuse(tiny, name)  # one entry: bob's replaced alice's
    assert reused(tiny, name, ["alice", "bob", "alice"]) == [0, 0, third]


def test_system_store_says_why_alice_missed(tiny):
    engine = kv.Engine(tiny, make_store("system"))
    results = [engine.run(CONVERSATION, max_tokens=2, salt=s) for s in ("alice", "bob", "alice")]
    assert [r.match for r in results] == ["miss", "miss", "miss"]
    assert "differs from the cached one" in results[2].why
    evicted = engine.events.filter(engine.events["event"] == "evict")
    assert evicted["detail"].to_list() == ["invalidated", "invalidated"]


def test_salt_ignored_in_cache_key_is_caught(tiny, monkeypatch):
    """The mutant: CacheKey drops its salt. Then bob reuses alice's KV in every store."""
    init = CacheKey.__init__

    def salt_ignored(self, ids, extra_keys=(), salt=None):
        init(self, ids, extra_keys, None)

    monkeypatch.setattr(CacheKey, "__init__", salt_ignored)
    for name in STORES:
        assert reused(tiny, name, ["alice", "bob"]) == [0, full_reuse(tiny, name)], name
