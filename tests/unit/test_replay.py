"""kvlab.experiments.replay runs the real stores' code without a model: the same reuse, request for request,
as RadixStore and PagedStore driven the way the Engine drives them (with snapshots of another size,
so the budget scaling is checked too), and the same as kv.simulate's block LRU for block-aligned
capacities. No model."""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

import kvlab as kv
from kvlab.errors import BudgetError, KvlabError
from kvlab.keys import CacheKey
from kvlab.experiments.replay import SYNTHETIC_BYTES_PER_TOKEN, replay, scaled_budget, synthetic_snapshot
from kvlab.primitives.tokens import from_ids

TOKS = from_ids([0])  # radix and paged stores read the key, not the rendered tokens
LAYERS, DIM = 2, 3
TOKEN_BYTES = LAYERS * 2 * DIM * 4  # k and v, float32: 48 bytes a token, not replay's 8
BLOCK = 4
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

prompt = st.lists(st.integers(0, 2), min_size=1, max_size=16).map(tuple)
prompts = st.lists(prompt, min_size=1, max_size=10)


def real_snapshot(ids):
    """A stand-in for a model's cache: LAYERS KVCache layers of DIM, TOKEN_BYTES a token."""
    cache = []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.full((1, 1, len(ids), DIM), float(layer))
        c.state = (k, k + 0.5, len(ids))
        cache.append(c)
    return kv.snapshot(cache, tokens=ids)


def drive(store, seqs, inserted=None):
    """What the Engine does with a store for each request, model aside: look up with limit n - 1,
    reuse the match's tokens, insert the prompt's KV (a too-big entry is not kept)."""
    reused, kinds, evictions = [], [], []
    for i, ids in enumerate(seqs):
        m = store.lookup(CacheKey(ids), TOKS, limit=len(ids) - 1)
        hit = m.tokens if m.snapshot is not None and m.tokens > 0 else 0
        reused.append(hit)
        kinds.append(m.kind if hit else "miss")
        entry = ids if inserted is None else inserted[i]
        try:
            store.insert(CacheKey(entry), TOKS, real_snapshot(entry))
        except BudgetError:
            pass
        evictions.append(sum(ev.capacity for ev in store.drain_events()))
    return reused, kinds, evictions


# ------------------------------------------------------------------------------ radix entries

def test_replay_follows_radix_store_semantics():
    p1 = tuple(range(1, 11))
    p2 = p1[:8] + (20, 21)

    def run(seqs, budget, store="radix"):
        return list(replay(seqs, store, budget_bytes=budget, bytes_per_token=1).reused)

    # everything fits: #2 shares 8 tokens, #3 is an exact repeat (reuse stops at n - 1)
    assert run([p1, p2, p1], 1e9) == [0, 8, 9]
    # room for one 10-token entry: #2's entry pushes #1's out, so #3 only shares #2's 8
    assert run([p1, p2, p1], 10) == [0, 8, 8]
    at_ten = replay([p1, p2, p1], "radix", budget_bytes=10, bytes_per_token=1)
    assert at_ten.evictions == (0, 1, 1) and at_ten.stored == (True, True, True)
    # no entry fits: nothing is reused
    assert run([p1, p2, p1], 9) == [0, 0, 0]
    # a longer entry subsumes (drops) its own prefix, which leaves room for the unrelated one
    other, short, longer = (9, 9, 9), (1, 2, 3), (1, 2, 3, 4, 5)
    seq = [other, short, longer, other]
    assert run(seq, 8) == [0, 0, 3, 2]
    assert run(seq, 8, lambda b: kv.RadixStore(b, subsume=False)) == [0, 0, 3, 0]


@SETTINGS
@given(prompts, st.integers(1, 60), st.booleans())
def test_radix_replay_equals_radix_store_under_eviction(seqs, budget_tokens, subsume):
    budget = budget_tokens * TOKEN_BYTES
    direct = kv.RadixStore(budget, subsume=subsume)
    reused, kinds, evictions = drive(direct, seqs)
    r = replay(seqs, lambda b: kv.RadixStore(b, subsume=subsume), budget_bytes=budget,
               bytes_per_token=TOKEN_BYTES)
    assert list(r.reused) == reused and list(r.matches) == kinds and list(r.evictions) == evictions
    # and the same tree afterwards: nodes, entries, hits and recency (bytes are scaled)
    assert r.store.tree_frame().drop("bytes").equals(direct.tree_frame().drop("bytes"))
    assert r.store.nbytes * TOKEN_BYTES == direct.nbytes * SYNTHETIC_BYTES_PER_TOKEN


# The old EntryReplay (kvlab.viz.widgets, before kvlab.experiments.replay) modelled RadixStore instead of
# running it; kept here as the mutant these regression cases catch.
def old_entry_replay(prompts, budget, subsume=True):
    def lcp(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    prompts = [tuple(p) for p in prompts]
    resident, total, tick, reused = {}, 0, 0, []
    for j, p in enumerate(prompts):
        limit, best, best_i = len(p) - 1, 0, None
        for i, last in resident.items():
            r = min(lcp(prompts[i], p), limit)
            if r > best or (best_i is not None and r == best and r > 0 and last > resident[best_i]):
                best, best_i = r, i
        if best_i is not None and best > 0:
            tick += 1
            resident[best_i] = tick
        reused.append(best)
        exact = best == limit and any(prompts[i] == p for i in resident)
        if exact or len(p) > budget:
            continue
        for i in [i for i in resident if lcp(prompts[i], p) == len(prompts[i])
                  and (subsume or len(prompts[i]) == len(p))]:
            total -= len(prompts[i])
            del resident[i]
        tick += 1
        resident[j] = tick
        total += len(p)
        while total > budget and len(resident) > 1:
            victim = min((i for i in resident if i != j), key=resident.get)
            total -= len(prompts[victim])
            del resident[victim]
    return reused


# (prompts, budget in tokens, what RadixStore reuses, what the old model said)
REGRESSIONS = [
    # #4 repeats #1 exactly and ties with #3 (both serve 1 token): RadixStore reuses #3's entry and
    # re-inserting #1 refreshes it; the old replay skipped the refresh, so it evicted #1 and kept
    # #2, which the last request then found
    ([(0, 0), (1, 0), (0,), (0, 0), (0, 1), (1, 0)], 5, [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]),
    # #4 repeats #1: its exact entry and #2's tie at 1 token; RadixStore touches the exact entry,
    # the old replay the more recent #2, so #5's insert evicted #3 where RadixStore evicts #2
    ([(1, 0), (1, 1), (0,), (1, 0), (1, 0, 0), (0, 0)], 5, [0, 1, 0, 1, 2, 1], [0, 1, 0, 1, 2, 0]),
]


@pytest.mark.parametrize("seqs, budget, radix, old", REGRESSIONS)
def test_tied_prefixes_touch_the_entry_radix_store_touches(seqs, budget, radix, old):
    assert list(replay(seqs, "radix", budget_bytes=budget, bytes_per_token=1).reused) == radix
    assert drive(kv.RadixStore(budget * TOKEN_BYTES), seqs)[0] == radix
    assert old_entry_replay(seqs, budget) == old != radix  # the old replay fails this case


# ------------------------------------------------------------------------------ paged blocks

@SETTINGS
@given(prompts, st.integers(1, 15))
def test_paged_replay_equals_paged_store_under_eviction(seqs, budget_blocks):
    budget = budget_blocks * BLOCK * TOKEN_BYTES
    direct = kv.PagedStore(BLOCK, budget_bytes=budget)
    reused, kinds, evictions = drive(direct, seqs)
    r = replay(seqs, "paged", budget_bytes=budget, bytes_per_token=TOKEN_BYTES, block_size=BLOCK)
    assert list(r.reused) == reused and list(r.matches) == kinds and list(r.evictions) == evictions
    # the same resident blocks in the same free-queue order (what is evicted next)
    cols = ["block", "hash", "parent", "token_ids", "ref_cnt", "hits", "last_used", "free_position"]
    assert r.store.blocks_frame().select(cols).equals(direct.blocks_frame().select(cols))


@SETTINGS
@given(prompts, st.integers(0, 15), st.sampled_from(["python", "auto"]))
def test_simulator_lru_equals_paged_replay_for_block_aligned_capacities(seqs, cap_blocks, engine):
    # the corner where they differ is pinned below: a request longer than the whole capacity
    if any(len(s) // BLOCK > cap_blocks for s in seqs):
        cap_blocks = max(len(s) // BLOCK for s in seqs)
    cap = cap_blocks * BLOCK
    sim = kv.simulate([list(s) for s in seqs], "lru", capacity_tokens=cap, block_size=BLOCK,
                      engine=engine)
    r = replay(seqs, "paged", budget_bytes=cap * TOKEN_BYTES, bytes_per_token=TOKEN_BYTES,
               block_size=BLOCK)
    assert sim.requests["hit_tokens"].to_list() == list(r.reused)


def test_a_request_larger_than_the_capacity_is_where_simulator_and_paged_store_differ():
    # 3 full blocks into room for 2: kv.simulate caches them all, then evicts down to the 2 most
    # recent (the request's head, since its tail is freed first); PagedStore refuses the request
    # outright (BudgetError, nothing stored), as a vLLM pool that cannot hold one request would.
    seqs = [tuple(range(13)), tuple(range(13))]
    sim = kv.simulate([list(s) for s in seqs], "lru", capacity_tokens=2 * BLOCK, block_size=BLOCK)
    r = replay(seqs, "paged", budget_bytes=2 * BLOCK * TOKEN_BYTES, bytes_per_token=TOKEN_BYTES,
               block_size=BLOCK)
    assert sim.requests["hit_tokens"].to_list() == [0, 2 * BLOCK]
    assert list(r.reused) == [0, 0] and r.stored == (False, False)
    with pytest.raises(BudgetError, match="blocks need"):
        kv.PagedStore(BLOCK, budget_bytes=2 * BLOCK * TOKEN_BYTES).insert(
            CacheKey(seqs[0]), TOKS, real_snapshot(seqs[0]))


# ------------------------------------------------------------------------------ the rest

def test_scaled_budget_is_exact_at_the_boundary():
    bpt = 3 * 1024  # one token of a small model
    for n in (1, 7, 1000):
        assert scaled_budget(n * bpt, bpt) == 8 * n            # exactly n tokens fit
        assert scaled_budget(n * bpt - 1, bpt) == 8 * n - 1    # one byte less: n tokens do not
    assert scaled_budget(0, bpt) == 1 and scaled_budget(2.5 * bpt, float(bpt)) == 20
    with pytest.raises(BudgetError, match="bytes_per_token"):
        scaled_budget(100, 0)
    with pytest.raises(BudgetError, match="bytes_per_token too"):
        replay([[1, 2]], "radix", budget_bytes=100)
    with pytest.raises(KvlabError, match="store name"):
        replay([[1, 2]], "lfu")
    assert synthetic_snapshot(5).nbytes == 5 * SYNTHETIC_BYTES_PER_TOKEN


def test_prompt_plus_output_entries_and_salts():
    p1, p2 = (1, 2, 3, 4), (1, 2, 3, 4, 7, 8, 9)
    outs = [p1 + (7, 8), p2 + (5,)]  # what each request inserted (prompt + generated ids)
    r = replay([p1, p2], "radix", entries=outs)
    assert list(r.reused) == drive(kv.RadixStore(), [p1, p2], outs)[0] == [0, 6]
    assert r.store.entries_frame()["kind"].to_list() == ["prompt+output"]  # #2 subsumed #1
    alice, bob = CacheKey(p2, salt="alice"), CacheKey(p2, salt="bob")
    assert list(replay([alice, bob, alice], "radix").reused) == [0, 0, 6]
    assert list(replay([alice, bob, alice], "paged", block_size=2).reused) == [0, 0, 6]
    out = replay([p1, p1], "paged", block_size=2)
    assert repr(out).startswith("Replay(paged") and "\n" not in repr(out)
    assert "<table>" in out._repr_html_() and out.rates()["reused_tokens"] == [0, 2]
    assert out.token_hit_rate == 2 / 8 and out.request_hit_rate == 0.5
    assert isinstance(out.store.blocks_frame(), pl.DataFrame)
