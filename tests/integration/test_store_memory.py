"""A store's byte counter is the memory it keeps alive, and its budget bounds that memory.

Real prefill caches on the tiny model go through ``Engine.run`` into each of the five stores; the
allocator's active memory (``mx.get_active_memory()`` after ``gc`` and ``mx.clear_cache()``) must
grow by ``store.nbytes`` within 10%, for short conversations and for 1-3k-token prompts, and drop
back when the store is deleted. Shapes are warmed up first (a cold-store run of every prompt), so
the delta is the store's alone.

Mutant caught: no compaction (an entry that keeps the snapshot's views holds mlx-lm's whole
256-token buffer: 8.7x its counter on short prompts); ``test_missing_compaction_is_seen`` keeps it,
and ``test_shared_radix_slices_without_copies_are_seen`` for SharedRadixStore's edge slices.
"""

import gc
import random

import mlx.core as mx
import pytest

import kvlab as kv
from kvlab.stores import make_store

pytestmark = pytest.mark.model

TOL = 0.10  # allocator delta / store.nbytes - 1
STORES = ("radix", "shared-radix", "paged", "system", "mlx-lru")


def short_conversations(n=20):
    return [[{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}] for i in range(n)]


def long_prompts():
    """Three prompts of about 1.1k, 2k and 2.9k tokens sharing nothing past the template."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
    return [[{"role": "system", "content": f"Policy {i}. " + "Follow the rules carefully. " * (100 + 180 * i)},
             {"role": "user", "content": " ".join(rng.choice(words) for _ in range(600))}] for i in range(3)]


PROMPTS = {"short": short_conversations, "long": long_prompts}


def active() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def store_of(name, budget_bytes=None):
    return make_store(name, budget_bytes=budget_bytes, max_size=100)


def measure(model, name, prompts, *, budget_bytes=None):
    """(store.nbytes, allocator delta while the store lives, delta after deleting it, store)."""
    warm = kv.Engine(model, None)
    for p in prompts:
        warm.run(p, max_tokens=1)
    store = store_of(name, budget_bytes)
    engine = kv.Engine(model, store)
    base = active()
    for p in prompts:
        engine.run(p, max_tokens=1)
    held = active() - base
    nbytes = store.nbytes
    entries = store.entries
    del engine, store
    return nbytes, held, active() - base, entries


@pytest.mark.parametrize("size", ["short", "long"])
@pytest.mark.parametrize("name", STORES)
def test_counter_is_the_memory_held(tiny, name, size):
    prompts = PROMPTS[size]()
    if size == "long":
        assert all(1000 <= len(tiny.tokenise(p).ids) <= 3000 for p in prompts)
    nbytes, held, after, entries = measure(tiny, name, prompts)
    assert nbytes > 0 and entries > 0
    assert abs(held - nbytes) <= TOL * nbytes, f"{name}: counter {nbytes} B, allocator {held} B"
    assert after == 0, f"{name}: {after} B still held after the store was deleted"


@pytest.mark.parametrize("name", ["radix", "shared-radix", "paged", "mlx-lru"])
def test_budget_bounds_the_memory_held(tiny, name):
    prompts = short_conversations()
    full, _, _, _ = measure(tiny, name, prompts)
    budget = full * 2 // 5
    nbytes, held, after, _ = measure(tiny, name, prompts, budget_bytes=budget)
    assert 0 < nbytes <= budget < full
    assert held <= budget * (1 + TOL), f"{name}: budget {budget} B, allocator {held} B"
    assert abs(held - nbytes) <= TOL * nbytes and after == 0


def test_system_store_holds_one_exact_prefix(tiny):
    prompts = short_conversations()
    nbytes, held, _, entries = measure(tiny, "system", prompts)
    cut = kv.split_at_boundary(tiny.tokenise(prompts[0]), at="system").index
    per_token = kv.snapshot(kv.prefill(tiny, tiny.tokenise(prompts[0]).ids)[1]).nbytes // len(
        tiny.tokenise(prompts[0]).ids)
    assert entries == 1 and nbytes == cut * per_token and held == nbytes


@pytest.mark.parametrize("name, module", [("radix", "kvlab.stores.radix"),
                                          ("mlx-lru", "kvlab.stores.mlx_lm_lru"),
                                          ("system", "kvlab.stores.system_prompt")])
def test_missing_compaction_is_seen(tiny, name, module, monkeypatch):
    """The mutant: the store keeps the snapshot as handed over (views into mlx-lm's buffers)."""
    import importlib

    monkeypatch.setattr(importlib.import_module(module), "compact", lambda snap: snap)
    nbytes, held, after, _ = measure(tiny, name, short_conversations())
    assert held > 2 * nbytes, f"{name} without compaction: counter {nbytes} B, allocator {held} B"
    assert after == 0


def test_shared_radix_slices_without_copies_are_seen(tiny, monkeypatch):
    """The mutant: SharedRadixStore keeps each edge as views of the request's cache (no copy), so
    every node holds mlx-lm's whole 256-token buffer alive."""
    from kvlab.stores import shared_radix

    def view_cut(snap, start, end):
        n = end - start
        layers = tuple(kv.snapshots.LayerState(layer.kind, (layer.state[0][..., start:end, :],
                                                             layer.state[1][..., start:end, :], n), n,
                                               layer.state[0][..., start:end, :].nbytes * 2)
                       for layer in snap.layers)
        return kv.Snapshot(layers, n, None, snap.fingerprint)

    monkeypatch.setattr(shared_radix, "cut", view_cut)
    nbytes, held, after, _ = measure(tiny, "shared-radix", short_conversations())
    assert held > 2 * nbytes, f"shared-radix without copies: counter {nbytes} B, allocator {held} B"
    assert after == 0


def test_compact_copies_exactly_the_valid_tokens(tiny):
    """compact() keeps values and nbytes, drops the buffer, and copies a one-KV-head view too
    (mx.contiguous would return such a view as it is)."""
    ids = tiny.tokenise(short_conversations(1)[0]).ids
    logits, cache = kv.prefill(tiny, ids)
    snap = kv.snapshot(cache, tokens=ids, model=tiny)
    kept = kv.compact(snap)
    assert (kept.offset, kept.token_ids, kept.fingerprint, kept.nbytes) == (
        snap.offset, snap.token_ids, snap.fingerprint, snap.nbytes)
    for a, b in zip(snap.layers, kept.layers):
        assert a.state[0].shape == b.state[0].shape and mx.array_equal(a.state[0], b.state[0]).item()
    # the restored compact snapshot continues exactly like the view
    nxt = [ids[-1]]
    la, _ = kv.prefill(tiny, nxt, kv.restore(snap))
    lb, _ = kv.prefill(tiny, nxt, kv.restore(kept))
    assert mx.array_equal(la, lb).item()
    del cache, logits, snap, kept, la, lb
    base = active()
    buf = mx.arange(256 * 16, dtype=mx.float32).reshape(1, 1, 256, 16)
    mx.eval(buf)
    one_head = kv.snapshot([_kv_cache(buf, 10)])
    del buf
    small = kv.compact(one_head)
    del one_head
    assert active() - base == small.nbytes == 2 * 10 * 16 * 4


def _kv_cache(buf, n):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.state = (buf, buf * 2, n)
    return c
