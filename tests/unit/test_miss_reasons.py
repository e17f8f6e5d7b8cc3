"""kvlab.miss_reasons without a model: every reason on hand-made store events with exact token
counts, and the simulator's own definitions reproduced from its eviction log on random workloads
(hypothesis) for several policies: the Engine explains misses as kv.simulate does."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.keys import CacheKey
from kvlab.miss_reasons import Explained, MissIndex
from kvlab.policies import ALL_REASONS, MISS_REASONS
from kvlab.sim.prepare import prepare_replay
from kvlab.sim.reference import run_python
from kvlab.stores.base import StoreEvent
from kvlab.workloads import Request


def nonzero(e: Explained) -> dict:
    return {k: v for k, v in e.reasons.items() if v}


def insert(entry, tokens, **kw):
    return StoreEvent("insert", tokens, 100, str(entry), kind=kw.pop("kind", "prompt"), **kw)


def evict(entry, tokens, reason="lru", **kw):
    return StoreEvent("evict", tokens, 100, str(entry), reason=reason, capacity=reason == "lru", **kw)


A = CacheKey(tuple(range(10, 30)))                         # 20 tokens
B = CacheKey(tuple(range(10, 20)) + tuple(range(90, 100)))  # shares A's first 10


def test_first_seen_then_partial_last_token():
    idx = MissIndex()
    e = idx.explain(A, 0)
    assert nonzero(e) == {"first_seen": 19, "partial_block": 1} and e.missed == 20
    assert list(e.reasons) == list(ALL_REASONS) and e.diverged_at is None and e.evicted_by is None
    assert repr(e) == "Explained(20 missed: first_seen 19, partial_block 1)"


def test_diverged_reports_the_first_differing_token():
    idx = MissIndex()
    idx.record(1, A, [insert(1, 20)])
    e = idx.explain(B, 10)
    assert nonzero(e) == {"diverged": 9, "partial_block": 1} and e.diverged_at == 10
    # an extension of a cached prompt is new, not diverged
    longer = CacheKey(A.ids + (1, 2, 3))
    e = idx.explain(longer, 20)
    assert nonzero(e) == {"first_seen": 2, "partial_block": 1} and e.diverged_at is None
    # a prompt whose first token differs from everything cached: first_seen (as the simulator)
    assert nonzero(idx.explain(CacheKey((5,) + A.ids[1:]), 0)) == {"first_seen": 19, "partial_block": 1}


def test_evicted_names_the_evicting_request_and_subsumed_is_not_a_loss():
    idx = MissIndex()
    idx.record(1, A, [insert(1, 20)])
    idx.record(2, B, [insert(2, 20)])
    # request 3 extends A: A's entry is subsumed (still covered by the new one), B's evicted
    ext = CacheKey(A.ids + (7, 8))
    idx.record(3, ext, [insert(3, 22), evict(1, 20, "subsumed"), evict(2, 20)])
    e = idx.explain(B, 10)  # B shares A's first 10 tokens, still cached
    assert nonzero(e) == {"evicted": 9, "partial_block": 1} and e.evicted_by == 3
    assert nonzero(idx.explain(A, 19)) == {"partial_block": 1}


def test_lost_by_the_request_that_cached_it_is_over_capacity():
    idx = MissIndex(4)
    blocks = [h.hex() for h in A.block_hashes(4)]
    # a disk tier holding 2 blocks: writing the request's blocks pushes its own first ones out
    events = [StoreEvent("insert", 4, 10, h, kind="prompt", tier="disk") for h in blocks]
    events += [StoreEvent("evict", 4, 10, h, reason="lru", capacity=True, tier="disk") for h in blocks[:3]]
    idx.record(1, A, events)
    e = idx.explain(A, 0)
    # blocks 0-2 lost by their own request; 3-4 resident behind them inherit the reason
    assert nonzero(e) == {"over_capacity": 16, "partial_block": 4} and e.evicted_by is None


def test_salt_and_images_are_salt_or_extra_keys():
    idx = MissIndex()
    idx.record(1, A, [insert(1, 20)])
    salted = CacheKey(A.ids, (), "bob")
    assert nonzero(idx.explain(salted, 0)) == {"salt_or_extra_keys": 19, "partial_block": 1}
    image = CacheKey(A.ids, ((5, 9, "img-1"),))
    idx.record(2, image, [insert(2, 20)])
    other = CacheKey(A.ids, ((5, 9, "img-2"),))
    assert nonzero(idx.explain(other, 5)) == {"salt_or_extra_keys": 14, "partial_block": 1}
    # the same ids under the plain namespace again: cached, so reused by a real store
    assert nonzero(idx.explain(A, 19)) == {"partial_block": 1}


def test_cached_but_not_served_is_not_trimmable_or_granularity():
    idx = MissIndex()
    idx.record(1, A, [insert(1, 20)])
    # a hybrid model's entry at 20 cannot be cut at 10: B reused nothing
    assert nonzero(idx.explain(B, 0, untrimmable=True)) == {"not_trimmable": 10, "diverged": 9,
                                                           "partial_block": 1}
    # a trimmable cache the store still would not cut (whole entries only): granularity
    assert nonzero(idx.explain(B, 0)) == {"partial_block": 11, "diverged": 9}


def test_unstorable_caches_offered_again_are_not_trimmable():
    idx = MissIndex(4, unstorable=True)
    idx.record(1, A, [], offered=A)  # a paged store stored nothing of a hybrid model's cache
    assert nonzero(idx.explain(A, 0)) == {"not_trimmable": 16, "partial_block": 4}
    assert nonzero(idx.explain(B, 0)) == {"not_trimmable": 8, "first_seen": 8, "partial_block": 4}


def test_block_granularity_and_the_leading_run():
    idx = MissIndex(4)
    hashes = [h.hex() for h in A.block_hashes(4)]
    idx.record(1, A, [StoreEvent("block_stored", 4, 10, h, kind="prompt") for h in hashes])
    idx.record(2, B, [StoreEvent("block_removed", 4, 10, hashes[1], reason="lru", capacity=True)])
    e = idx.explain(A, 4)
    # block 1 evicted; blocks 2-3 still cached but behind it: evicted too; 16..19 partial
    assert nonzero(e) == {"evicted": 12, "partial_block": 4} and e.evicted_by == 2
    e = idx.explain(B, 8)
    assert nonzero(e) == {"diverged": 8, "partial_block": 4} and e.diverged_at == 10


def test_a_tiered_demotion_keeps_the_tokens_cached_until_the_disk_drops_them():
    idx = MissIndex()
    idx.record(1, A, [StoreEvent("insert", 20, 100, "1", kind="prompt", tier="ram")])
    idx.record(2, B, [StoreEvent("insert", 20, 100, "2", kind="prompt", tier="ram"),
                      StoreEvent("demote", 20, 100, "d-a", tier="disk"),
                      StoreEvent("evict", 20, 100, "1", reason="lru", capacity=True, tier="ram")])
    # still cached (on disk): a store that did not serve it did not lose it
    assert nonzero(idx.explain(A, 0)) == {"partial_block": 20}
    idx.record(3, B, [StoreEvent("evict", 20, 100, "d-a", reason="lru", capacity=True, tier="disk")])
    e = idx.explain(A, 10)
    assert nonzero(e) == {"evicted": 9, "partial_block": 1} and e.evicted_by == 3
    # a skipped demotion (the disk refused it) is a loss at once
    idx = MissIndex()
    idx.record(1, A, [StoreEvent("insert", 20, 100, "1", kind="prompt", tier="ram")])
    idx.record(2, B, [StoreEvent("demote", 20, 0, "d-a", reason="skipped: larger than the disk budget",
                                 tier="disk"),
                      StoreEvent("evict", 20, 100, "1", reason="lru", capacity=True, tier="ram")])
    assert idx.explain(A, 0).evicted_by == 2


# -- the simulator's definitions, from its own eviction log ---------------------------------------

def explain_like_the_simulator(requests, block_size, policy, cap):
    """Per request: (hit tokens, reasons in MISS_REASONS order, evictor) from kv.simulate's
    reference replay, and the same from a MissIndex fed with that replay's blocks and evictions
    as a paged store reports them (block_stored / block_removed named by chained hash)."""
    rep = prepare_replay(list(requests), block_size, 1, None)
    out = run_python(rep, policy, cap)
    idx, names, resident = MissIndex(block_size), {}, set()
    evictions = {}
    for b, r in zip(out.evicted.tolist(), out.evicted_at.tolist()):
        evictions.setdefault(r, []).append(b)
    ours, theirs = [], []
    for r, req in enumerate(requests):
        key = CacheKey(req.ids, (), req.salt)
        reused = int(out.hits[r]) * block_size
        e = idx.explain(key, reused)
        ours.append((reused, [e.reasons[k] for k in MISS_REASONS], e.evicted_by, e.reasons["not_trimmable"]))
        theirs.append((reused, out.reasons[r].tolist(), None if out.evicted_by[r] < 0 else int(out.evicted_by[r]), 0))
        s = int(rep.offsets[r])
        events = []
        for j, h in enumerate(key.block_hashes(block_size)):
            b = int(rep.flat[s + j])
            names[b] = h.hex()
            if b not in resident:
                resident.add(b)
                events.append(StoreEvent("block_stored", block_size, 1, h.hex(), kind="prompt"))
        for b in evictions.get(r, []):
            resident.discard(b)
            events.append(StoreEvent("block_removed", block_size, 1, names[b], reason=policy, capacity=True))
        idx.record(r, key, events)
    return ours, theirs


def workloads(max_requests=14):
    prefix = st.lists(st.integers(1, 6), min_size=1, max_size=14)
    request = st.tuples(st.integers(0, 2), st.integers(0, 14), st.lists(st.integers(1, 6), max_size=6),
                        st.sampled_from([None, None, None, "s"]))

    def build(args):
        prefixes, rows = args
        out = []
        for p, k, tail, salt in rows:
            ids = tuple(prefixes[p % len(prefixes)][:k]) + tuple(tail)
            out.append(Request(ids=ids or (1,), salt=salt, max_tokens=1))
        return out

    return st.tuples(st.lists(prefix, min_size=1, max_size=3),
                     st.lists(request, min_size=1, max_size=max_requests)).map(build)


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "arc", "s3fifo", "belady"])
@settings(max_examples=60, deadline=None)
@given(requests=workloads(), block_size=st.sampled_from([1, 2, 3]), room=st.integers(0, 6))
def test_the_engine_index_explains_misses_as_the_simulator(policy, requests, block_size, room):
    # capacity at least every request's blocks: beyond that the simulator's over_capacity is
    # positional (blocks past the capacity), the Engine's a loss by the request itself
    need = max(len(r.ids) // block_size for r in requests)
    ours, theirs = explain_like_the_simulator(requests, block_size, policy, need + room)
    assert ours == theirs
    for (reused, reasons, _, other), req in zip(ours, requests):
        assert reused + sum(reasons) + other == len(req.ids)
