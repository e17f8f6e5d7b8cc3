"""PagedStore with sliding-window and recurrent parts, on synthetic caches (no model): keys hold
their own position, so what a restore returns is checked token by token.

Each test names the mutant it catches; each was checked by breaking the code by hand.
"""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

import kvlab as kv
from kvlab.keys import CacheKey
from kvlab.primitives.cache_parts import parts_of, window_kv
from kvlab.stores import PagedStore
from kvlab.stores.paged_parts import reach

BLOCK, DIM, WINDOW = 16, 4, 32
PER_TOKEN = 2 * DIM * 4  # keys + values, one head of DIM float32


def positions(n, start=0):
    return mx.broadcast_to(mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1), (1, 1, n, DIM)) * 1


def window_cache(n, single=5):
    """A window of WINDOW filled as mlx-lm fills it: one multi-token step, then ``single`` one-token
    steps (so the ring wraps and its oldest token is not at index 0)."""
    rot = RotatingKVCache(WINDOW)
    k = positions(n)
    rot.update_and_fetch(k[..., : n - single, :], k[..., : n - single, :] + 0.5)
    for i in range(n - single, n):
        rot.update_and_fetch(k[..., i:i + 1, :], k[..., i:i + 1, :] + 0.5)
    return rot


def hybrid_snapshot(n, *, recurrent=False, single=0):
    full = KVCache()
    full.state = (positions(n), positions(n) + 0.5, n)
    layers = [window_cache(n, single), full]
    if recurrent:
        a = ArraysCache(1)
        a[0] = mx.full((1, 3), float(n))
        layers.append(CacheList(a, KVCache()))
        layers[-1].caches[1].state = (positions(n), positions(n), n)
    return kv.snapshot(layers, tokens=range(n))


def test_window_kv_puts_a_wrapped_ring_in_temporal_order():
    # mutant: the ring read as stored (oldest token not first)
    snap = hybrid_snapshot(45, single=5)
    keys, values, first = window_kv(snap.layers[0].state)
    assert snap.layers[0].state[5] != WINDOW  # wrapped: the write index is inside the ring
    assert first == 45 - WINDOW
    assert keys[0, 0, :, 0].tolist() == list(range(13, 45))
    assert values[0, 0, :, 0].tolist() == [p + 0.5 for p in range(13, 45)]


def test_reach_is_the_blocks_inside_the_window():
    assert reach(288, 32, 16) == range(16, 18)
    assert reach(48, 40, 16) == range(0, 3)  # tokens 8..47
    assert reach(16, 32, 16) == range(0, 1)


def test_window_blocks_outside_every_window_are_released():
    # mutant: no release (all 18 blocks keep window KV: 288 tokens)
    store = PagedStore(BLOCK, budget_bytes=1 << 24)
    # a ring that holds tokens 268..299 cannot give the window before 288: no checkpoint, no hit
    store.insert(CacheKey(tuple(range(300))), None, hybrid_snapshot(300, single=5))
    m = store.lookup(CacheKey(tuple(range(300))), None, limit=299)
    assert m.kind == "miss" and "sliding window of 32 of layer 0" in m.why
    assert store.components()["window"] == 0
    store.drain_events()
    snap = hybrid_snapshot(300)  # as the Engine's prefill leaves it: every token of one step
    store.insert(CacheKey(tuple(range(300))), None, snap)
    c = store.components()
    assert c["window_tokens"] == {0: 32} and c["window"] == 32 * PER_TOKEN
    assert c["full"] == 288 * PER_TOKEN and store.nbytes == c["full"] + c["window"]
    events = store.drain_events()
    assert [e.event for e in events] == ["window_stored"] * 2 + ["checkpoint_stored"]
    m = store.lookup(CacheKey(tuple(range(300))), None, limit=299)
    assert m.tokens == 288
    rot, full = m.snapshot.layers
    assert tuple(rot.state[2:]) == (288, 0, WINDOW, WINDOW)
    assert rot.state[0][0, 0, :, 0].tolist() == list(range(256, 288))
    assert full.state[0][0, 0, :, 0].tolist() == list(range(288))


def test_a_later_checkpoint_releases_what_only_it_no_longer_needs():
    # a 300-token prompt then its 200-token prefix: the window blocks of both checkpoints stay,
    # the blocks between them hold none; mutant: release ignoring other checkpoints' references
    store = PagedStore(BLOCK, budget_bytes=1 << 24)
    store.insert(CacheKey(tuple(range(300))), None, hybrid_snapshot(300))
    store.insert(CacheKey(tuple(range(200))), None, hybrid_snapshot(200))
    assert store.components()["window_tokens"] == {0: 64}
    for limit, hit in ((299, 288), (250, 192), (199, 192)):
        assert store.lookup(CacheKey(tuple(range(300))), None, limit=limit).tokens == hit


def test_recurrent_checkpoint_only_at_block_ends_and_dropped_with_its_block():
    # mutants: a checkpoint taken at a position that is not a block end (its state would be
    # restored at the block end before it); an evicted block whose checkpoint bytes stay counted
    store = PagedStore(BLOCK, num_blocks=4, budget_bytes=1 << 24)
    store.insert(CacheKey(tuple(range(40))), None, hybrid_snapshot(40, recurrent=True))
    assert store.components()["checkpoints"] == 0
    store.insert(CacheKey(tuple(range(32))), None, hybrid_snapshot(32, recurrent=True))
    c = store.components()
    assert c["checkpoints"] == 1 and c["recurrent"] == 12
    m = store.lookup(CacheKey(tuple(range(40))), None, limit=39)
    assert m.tokens == 32
    layer = m.snapshot.layers[2]
    assert layer.kind == "CacheList" and layer.state[0][0][0][0].tolist() == [[32.0] * 3]
    assert isinstance(layer.state[0][0][0], list)  # mlx-lm writes into a CacheList part's list
    store.insert(CacheKey(tuple(range(100, 164))), None, hybrid_snapshot(64, recurrent=True))
    c = store.components()
    assert store.evictions == 2 and c["checkpoints"] == 1  # the new one at 64; the one at 32 left
    assert store.nbytes == c["full"] + c["window"] + c["recurrent"]


def test_parts_of_a_cache_list():
    parts = parts_of(hybrid_snapshot(20, recurrent=True))
    assert [(p.layer, p.sub, p.kind) for p in parts] == [(0, None, "window"), (1, None, "full"),
                                                        (2, 0, "recurrent"), (2, 1, "full")]
