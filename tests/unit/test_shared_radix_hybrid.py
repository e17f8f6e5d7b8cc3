"""SharedRadixStore holding recurrent state as checkpoints, on synthetic snapshots (no model): two
KVCache layers of 2 float32 dims (32 bytes a token) and one ArraysCache layer whose state is 3
float32 (12 bytes) equal to the code of the whole prefix it was taken after, so a restored state
says exactly which prefix it came from.

Each test names the mutant it catches; each was checked by breaking the code by hand.
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

from kvlab.keys import CacheKey
from kvlab.primitives.cache_parts import arrays_of
from kvlab.stores import SharedRadixStore

from test_store_budget import TOKEN_BYTES, TOKS, check_content, code, synthetic

STATE_BYTES = 3 * 4


def state_code(snap) -> float:
    layer = snap.layers[2]
    assert layer.kind == "ArraysCache"
    return arrays_of(layer.state)[0][0, 0].item()


SIGN = {"insert": 1, "checkpoint_stored": 1, "evict": -1, "checkpoint_removed": -1}


def hybrid_store(budget=1 << 20):
    return SharedRadixStore(budget)


def event_bytes(events) -> int:
    """The bytes held as the events account them (what the server's StoreAdapter sums)."""
    return sum(SIGN.get(e.event, 0) * e.nbytes for e in events)


def test_hit_is_the_deepest_checkpoint_at_or_below_the_limit_and_the_divergence():
    # mutants: the deepest checkpoint on the path whatever the limit (p <= shared: the state
    # after 8 tokens for a limit of 7)
    a = tuple(range(10, 18))
    store = hybrid_store()
    store.insert(CacheKey(a[:5]), TOKS, synthetic(a[:5], recurrent=True))
    store.insert(CacheKey(a), TOKS, synthetic(a, recurrent=True))
    for limit, want in ((7, 5), (8, 8), (4, 0)):
        m = store.lookup(CacheKey(a), TOKS, limit=limit)
        assert m.tokens == want, (limit, m)
        if want:
            assert state_code(m.snapshot) == code(a[:want])
            check_content(m.snapshot, a, want)
    # a prompt that parts from a after 6 tokens: the state at 8 belongs to another prefix
    b = a[:6] + (90, 91, 92)
    m = store.lookup(CacheKey(b), TOKS, limit=8)
    assert m.tokens == 5 and state_code(m.snapshot) == code(a[:5])
    miss = store.lookup(CacheKey(a), TOKS, limit=4)
    assert miss.kind == "miss" and "no checkpoint of the recurrent state of layer 2 (ArraysCache)" in miss.why


def test_a_split_keeps_each_checkpoint_on_the_half_that_holds_it():
    # mutants: a split that drops the node's checkpoints (the hit on a after c split it misses),
    # a split whose evict event leaves out the moved checkpoint's bytes (events 12 bytes over)
    a = tuple(range(10, 18))
    c = a[:4] + (70, 71, 72, 73)
    store = hybrid_store()
    store.insert(CacheKey(a[:3]), TOKS, synthetic(a[:3], recurrent=True))
    store.insert(CacheKey(a), TOKS, synthetic(a, recurrent=True))
    store.insert(CacheKey(c), TOKS, synthetic(c, recurrent=True))
    assert event_bytes(store.drain_events()) == store.nbytes
    frame = store.tree_frame().sort("start")
    assert frame["checkpoints"].to_list() == [[], [3], [], [8], [8]]  # root, [0,4), [4,8) twice
    for key, want in ((a, 8), (c, 8), (a[:3] + (99,), 3)):
        m = store.lookup(CacheKey(key), TOKS, limit=8)
        assert m.tokens == want and state_code(m.snapshot) == code(key[:want])


def test_bytes_per_component_and_eviction_frees_the_checkpoints():
    # mutants: an evicted node's checkpoint bytes still counted (nbytes 12 too high), the
    # checkpoint's bytes counted as full KV
    a, b = tuple(range(10, 18)), tuple(range(30, 38))
    store = hybrid_store(budget=16 * TOKEN_BYTES + 2 * STATE_BYTES)
    store.insert(CacheKey(a), TOKS, synthetic(a, recurrent=True))
    store.insert(CacheKey(b), TOKS, synthetic(b, recurrent=True))
    c = store.components()
    assert (c["full"], c["window"], c["recurrent"], c["checkpoints"]) == (16 * TOKEN_BYTES, 0, 2 * STATE_BYTES, 2)
    assert store.nbytes == c["full"] + c["recurrent"]
    store.insert(CacheKey(a[:2]), TOKS, synthetic(a[:2], recurrent=True))  # no room: b goes
    c = store.components()
    assert (c["full"], c["recurrent"], c["checkpoints"]) == (8 * TOKEN_BYTES, 2 * STATE_BYTES, 2)
    assert store.nbytes == c["full"] + c["recurrent"]
    events = store.drain_events()
    removed = [(e.tokens, e.nbytes) for e in events if e.event == "checkpoint_removed"]
    assert removed == [(8, STATE_BYTES)] and event_bytes(events) == store.nbytes
