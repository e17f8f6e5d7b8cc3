"""Budgets are never exceeded, byte counts are exact and evicted entries are unreachable, whatever
the sequence of requests: hypothesis state machines over RadixStore and PagedStore with synthetic
snapshots (no model)."""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mlx_lm.models.cache import ArraysCache, KVCache

import kvlab as kv
from kvlab.errors import BudgetError
from kvlab.keys import CacheKey
from kvlab.tokens import from_ids

TOKS = from_ids([0])  # radix and paged stores read the key, not the rendered tokens

LAYERS, DIM = 2, 2
TOKEN_BYTES = LAYERS * 2 * DIM * 4  # k and v, float32: 32 bytes a token
BLOCK = 4
ids_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=20).map(tuple)


def code(prefix) -> float:
    """The synthetic KV of a token depends on the whole prefix before it, as real KV does."""
    h = 0
    for t in prefix:
        h = (h * 31 + t + 1) % 1_000_003
    return float(h)


def synthetic(ids, *, recurrent: bool = False, fingerprint: str = "synthetic"):
    """A snapshot of LAYERS KVCache layers (plus an ArraysCache layer if ``recurrent``)."""
    n = len(ids)
    col = mx.array([code(ids[: i + 1]) for i in range(n)], dtype=mx.float32).reshape(1, 1, n, 1)
    cache = []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.broadcast_to(col + layer, (1, 1, n, DIM)) * 1
        c.state = (k, k + 0.5, n)
        cache.append(c)
    if recurrent:
        a = ArraysCache(1)
        a[0] = mx.full((1, 3), code(ids))
        cache.append(a)
    snap = kv.snapshot(cache, tokens=ids)
    return type(snap)(snap.layers, snap.offset, snap.token_ids, fingerprint)


def check_content(snap, ids, tokens):
    """The first ``tokens`` positions of a returned snapshot hold the KV of ``ids``' prefix."""
    keys = snap.layers[0].state[0]
    got = keys[0, 0, :tokens, 0].tolist()
    assert got == [code(ids[: i + 1]) for i in range(tokens)]


class RadixMachine(RuleBasedStateMachine):
    @initialize(budget_tokens=st.integers(1, 60))
    def setup(self, budget_tokens):
        self.budget = budget_tokens * TOKEN_BYTES
        self.store = kv.RadixStore(budget_bytes=self.budget)
        self.evicted: set[str] = set()

    def _drain(self):
        for row in self.store.drain_events():
            if row.event == "evict":
                self.evicted.add(row.entry)

    @rule(ids=ids_strategy, recurrent=st.booleans())
    def insert(self, ids, recurrent):
        snap = synthetic(ids, recurrent=recurrent)
        before = (self.store.nbytes, self.store.entries)
        if snap.nbytes > self.budget:
            with pytest.raises(BudgetError, match="budget"):
                self.store.insert(CacheKey(ids), TOKS, snap)
            assert (self.store.nbytes, self.store.entries) == before
            return
        self.store.insert(CacheKey(ids), TOKS, snap)
        self._drain()
        assert self.store.contains(CacheKey(ids))

    @rule(ids=ids_strategy)
    def lookup(self, ids):
        limit = len(ids) - 1
        m = self.store.lookup(CacheKey(ids), TOKS, limit=limit)
        assert 0 <= m.tokens <= limit
        if m.snapshot is not None:
            assert str(m.entry_id) not in self.evicted
            assert m.entry_id in self.store._entries
            assert m.snapshot.offset >= m.tokens
            check_content(m.snapshot, ids, m.tokens)

    @invariant()
    def within_budget(self):
        assert self.store.nbytes <= self.budget

    @invariant()
    def bytes_are_exact(self):
        entries = [e for e, _ in self.store._entries.values()]
        assert self.store.nbytes == sum(e.snapshot.nbytes for e in entries)
        assert self.store.entries == len(entries)

    @invariant()
    def evicted_are_unreachable(self):
        in_tree = {str(n.entry.id) for n in self.store.root.walk() if n.entry is not None}
        assert in_tree == {str(i) for i in self.store._entries}
        assert not in_tree & self.evicted

    @invariant()
    def tree_is_well_formed(self):
        for node in self.store.root.walk():
            for first, child in node.children.items():
                assert child.parent is node and child.edge and child.edge[0] == first
                assert child.depth == node.depth + len(child.edge)
                # pruned: no dangling leaf without an entry
                assert child.entry is not None or child.children


class PagedMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12))
    def setup(self, num_blocks):
        self.num_blocks = num_blocks
        self.store = kv.PagedStore(block_size=BLOCK, num_blocks=num_blocks)
        self.resident: set[str] = set()  # replayed from block_stored / block_removed events
        self.removed: set[str] = set()

    def _drain(self):
        for row in self.store.drain_events():
            if row.event == "block_stored":
                assert row.entry not in self.resident
                self.resident.add(row.entry)
                self.removed.discard(row.entry)
                assert row.nbytes == BLOCK * TOKEN_BYTES and row.tokens == BLOCK
            elif row.event == "block_removed":
                self.resident.remove(row.entry)
                self.removed.add(row.entry)

    @rule(ids=ids_strategy)
    def insert(self, ids):
        key, snap = CacheKey(ids), synthetic(ids)
        need = len(ids) // BLOCK
        if need > self.num_blocks:
            with pytest.raises(BudgetError, match="num_blocks"):
                self.store.insert(key, TOKS, snap)
            self._drain()
            return
        self.store.insert(key, TOKS, snap)
        self._drain()
        # a request that fits keeps every one of its blocks: they were referenced while it ran
        assert all(h in self.store._blocks for h in self.store.hashes(key))

    @rule(ids=ids_strategy)
    def lookup(self, ids):
        key, limit = CacheKey(ids), len(ids) - 1
        m = self.store.lookup(key, TOKS, limit=limit)
        hashes = self.store.hashes(key, limit)
        assert m.tokens % BLOCK == 0 and m.tokens <= limit
        hit = m.tokens // BLOCK
        assert all(h in self.store._blocks for h in hashes[:hit])
        assert hit == len(hashes) or hashes[hit] not in self.store._blocks  # leading blocks, all
        if hit:
            assert m.kind == "prefix" and m.snapshot.offset == m.tokens
            assert not {h.hex() for h in hashes[:hit]} & self.removed
            check_content(m.snapshot, ids, m.tokens)
        else:
            assert m.kind == "miss" and m.snapshot is None

    @invariant()
    def within_pool(self):
        assert self.store.entries <= self.num_blocks
        assert self.store.nbytes <= self.num_blocks * BLOCK * TOKEN_BYTES

    @invariant()
    def bytes_are_exact(self):
        assert self.store.nbytes == sum(b.nbytes for b in self.store._blocks.values())
        assert self.store.nbytes == len(self.store._blocks) * BLOCK * TOKEN_BYTES

    @invariant()
    def reference_counts(self):
        # between requests nothing is referenced: every resident block is free but cached
        assert all(b.ref_cnt == 0 for b in self.store._blocks.values())
        assert set(self.store._free) == set(self.store._blocks)

    @invariant()
    def events_match_residency(self):
        assert {h.hex() for h in self.store._blocks} == self.resident
        assert not self.resident & self.removed


SETTINGS = settings(max_examples=60, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestRadixBudget = RadixMachine.TestCase
TestRadixBudget.settings = SETTINGS
TestPagedBudget = PagedMachine.TestCase
TestPagedBudget.settings = SETTINGS


# -- deterministic paged semantics ----------------------------------------------------------------

def test_paged_evicts_tail_before_head():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=4)
    a = tuple(range(10, 22))            # 3 blocks
    b = tuple(range(50, 58))            # 2 blocks: one must go
    store.insert(CacheKey(a), TOKS, synthetic(a))
    store.insert(CacheKey(b), TOKS, synthetic(b))
    removed = [r for r in store.drain_events() if r.event == "block_removed"]
    assert [r.entry for r in removed] == [kv.block_hashes(a, BLOCK)[2].hex()]  # a's tail
    assert store.lookup(CacheKey(a + (1,)), TOKS, limit=len(a)).tokens == 2 * BLOCK


def test_paged_hit_refreshes_blocks():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=4)
    a, b, c = tuple(range(10, 18)), tuple(range(50, 58)), tuple(range(90, 98))
    store.insert(CacheKey(a), TOKS, synthetic(a))
    store.insert(CacheKey(b), TOKS, synthetic(b))
    store.insert(CacheKey(a), TOKS, synthetic(a))   # a is used again: b is now least recent
    store.insert(CacheKey(c), TOKS, synthetic(c))
    assert store.lookup(CacheKey(a + (1,)), TOKS, limit=len(a)).tokens == 8
    assert store.lookup(CacheKey(b + (1,)), TOKS, limit=len(b)).tokens == 0


def test_paged_shared_prefix_stored_once():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=64)
    prefix = tuple(range(100, 112))     # 3 blocks
    for s in range(5):
        ids = prefix + tuple(range(200 + 10 * s, 208 + 10 * s))  # + 2 blocks each
        store.insert(CacheKey(ids), TOKS, synthetic(ids))
    assert store.entries == 3 + 5 * 2
    assert store.nbytes == (3 + 5 * 2) * BLOCK * TOKEN_BYTES


def test_paged_extra_keys_and_salt_change_blocks():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=64)
    ids = tuple(range(10, 22))
    store.insert(CacheKey(ids, ((5, 7, "imgA"),)), TOKS, synthetic(ids))
    assert store.lookup(CacheKey(ids, ((5, 7, "imgA"),)), TOKS, limit=11).tokens == 8
    assert store.lookup(CacheKey(ids, ((5, 7, "imgB"),)), TOKS, limit=11).tokens == 4  # block 0 has no image
    assert store.lookup(CacheKey(ids), TOKS, limit=11).tokens == 4
    assert store.lookup(CacheKey(ids, salt="tenant-2"), TOKS, limit=11).tokens == 0


def test_paged_budget_smaller_than_one_request():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=2)
    ids = tuple(range(12))
    with pytest.raises(BudgetError, match=r"needs 3 blocks .* num_blocks=2; raise num_blocks"):
        store.insert(CacheKey(ids), TOKS, synthetic(ids))
    small = kv.PagedStore(block_size=BLOCK, budget_bytes=TOKEN_BYTES * BLOCK)
    with pytest.raises(BudgetError, match="raise budget_bytes"):
        small.insert(CacheKey(ids), TOKS, synthetic(ids))


def test_paged_refuses_other_model_and_recurrent_layers():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=8)
    ids = tuple(range(8))
    store.insert(CacheKey(ids), TOKS, synthetic(ids, fingerprint="model-a"))
    with pytest.raises(kv.errors.SnapshotError, match="one PagedStore per model"):
        store.insert(CacheKey(ids), TOKS, synthetic(ids, fingerprint="model-b"))
    hybrid = kv.PagedStore(block_size=BLOCK, num_blocks=8)
    hybrid.insert(CacheKey(ids), TOKS, synthetic(ids, recurrent=True))
    assert hybrid.entries == 0
    m = hybrid.lookup(CacheKey(ids), TOKS, limit=7)
    assert m.kind == "miss" and "layer 2 is ArraysCache" in m.why


def test_radix_reinsert_refreshes_without_replacing():
    store = kv.RadixStore(budget_bytes=1 << 20)
    ids = tuple(range(8))
    store.insert(CacheKey(ids), TOKS, synthetic(ids))
    store.insert(CacheKey(ids), TOKS, synthetic(ids))
    events = [r.event for r in store.drain_events()]
    assert events == ["insert"] and store.entries == 1
