"""RadixStore and PagedStore against models of the right answer (LRU, the default policy), whatever
the sequence of requests: hypothesis state machines with synthetic snapshots (no model).

RadixModel keeps the resident entries and their recency: every lookup must return the longest
reusable match (complete, not only sound) and every eviction must be exactly the model's LRU victim,
only when the budget demands. PagedModel keeps vLLM's free queue: block_removed comes in its order,
and reference counts are checked at each event *during* an insert. tests/unit/test_store_mutants.py
runs these machines on broken stores and asserts each is caught."""

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
from kvlab.primitives.tokens import from_ids

TOKS = from_ids([0])  # radix and paged stores read the key, not the rendered tokens

LAYERS, DIM = 2, 2
TOKEN_BYTES = LAYERS * 2 * DIM * 4  # k and v, float32: 32 bytes a token
BLOCK = 4
BLOCK_BYTES = BLOCK * TOKEN_BYTES
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


class RadixModel:
    """What an LRU RadixStore must hold and answer: resident entries (ids -> trimmable) in recency
    order, front = least recently used (inserted, refreshed or hit)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.order: list[tuple] = []
        self.trimmable: dict[tuple, bool] = {}
        self.nbytes: dict[tuple, int] = {}

    def insert(self, ids, trimmable: bool, nbytes: int) -> list[tuple]:
        """The events the store must emit, as (event, reason, ids); updates the model."""
        if ids in self.trimmable and self.trimmable[ids] == trimmable:
            self._use(ids)  # the same KV again: refreshed, not replaced
            return []
        events = []
        if ids in self.trimmable:
            events.append(("evict", "replaced", self._drop(ids)))
        self.order.append(ids)
        self.trimmable[ids], self.nbytes[ids] = trimmable, nbytes
        events.append(("insert", None, ids))
        if trimmable:  # a trimmable entry serves every prefix of itself: trimmable ancestors go
            for old in sorted((o for o in self.order if o != ids and ids[: len(o)] == o
                               and self.trimmable[o]), key=len, reverse=True):
                events.append(("evict", "subsumed", self._drop(old)))
        while sum(self.nbytes.values()) > self.budget and len(self.order) > 1:
            victim = next(o for o in self.order if o != ids)  # least recently used, never the new one
            events.append(("evict", "lru", self._drop(victim)))
        return events

    def lookup(self, q) -> tuple[int, tuple | None, str]:
        """(reused tokens, entry used, kind): the longest reuse any resident entry allows; a prefix
        entry (no trim) wins a tie, then the entry sharing the most tokens, then the most recent."""
        limit = len(q) - 1
        best, entry, kind = 0, None, "miss"
        for e in self.order:  # prefix entries: usable as they are
            if 0 < len(e) <= limit and q[: len(e)] == e and len(e) > best:
                best, entry, kind = len(e), e, "prefix"
        trim = [(min(lcp(e, q), limit), lcp(e, q), rank, e) for rank, e in enumerate(self.order)
                if self.trimmable[e]]
        if trim and max(trim)[0] > best:
            best, shared, _, entry = max(trim)
            kind = "exact" if entry == q else "supersequence" if shared == len(q) else "lcp"
        if entry is not None:
            self._use(entry)
        return best, entry, kind

    def _use(self, ids):
        self.order.remove(ids)
        self.order.append(ids)

    def _drop(self, ids):
        self.order.remove(ids)
        del self.trimmable[ids], self.nbytes[ids]
        return ids


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixMachine(RuleBasedStateMachine):
    """RadixStore against RadixModel: every event, every lookup's reuse, entry and kind."""

    def make_store(self, budget: int):
        return kv.RadixStore(budget_bytes=budget)

    @initialize(budget_tokens=st.integers(1, 60))
    def setup(self, budget_tokens):
        self.budget = budget_tokens * TOKEN_BYTES
        self.store = self.make_store(self.budget)
        self.model = RadixModel(self.budget)
        self.ids_of: dict[str, tuple] = {}  # entry id -> token ids
        self.evicted: set[str] = set()

    def _events(self, ids) -> list[tuple]:
        out = []
        for row in self.store.drain_events():
            if row.event == "insert":
                new = next(str(e.id) for e, _ in self.store._entries.values() if e.snapshot.token_ids == ids)
                self.ids_of[new] = ids
                assert row.entry == new
            else:
                self.evicted.add(row.entry)
            out.append((row.event, row.reason, self.ids_of[row.entry]))
        return out

    @rule(ids=ids_strategy, recurrent=st.booleans())
    def insert(self, ids, recurrent):
        snap = synthetic(ids, recurrent=recurrent)
        before = (self.store.nbytes, self.store.entries)
        if snap.nbytes > self.budget:
            with pytest.raises(BudgetError, match="budget"):
                self.store.insert(CacheKey(ids), TOKS, snap)
            assert (self.store.nbytes, self.store.entries) == before and not self.store.drain_events()
            return
        self.store.insert(CacheKey(ids), TOKS, snap)
        expected = self.model.insert(ids, snap.trimmable, snap.nbytes)
        got = self._events(ids)
        assert [e for e in got if e[1] == "lru"] == [e for e in expected if e[1] == "lru"]  # LRU order
        assert sorted(got, key=str) == sorted(expected, key=str), (got, expected)
        assert self.store.contains(CacheKey(ids))

    @rule(ids=ids_strategy)
    def lookup(self, ids):
        limit = len(ids) - 1
        m = self.store.lookup(CacheKey(ids), TOKS, limit=limit)
        reuse, entry, kind = self.model.lookup(ids)
        assert (m.tokens, m.kind) == (reuse, kind), (ids, m, self.model.order)
        if entry is None:
            assert m.snapshot is None and m.entry_id is None
            return
        assert self.ids_of[str(m.entry_id)] == entry
        assert m.snapshot.offset >= m.tokens
        check_content(m.snapshot, ids, m.tokens)

    @invariant()
    def resident_as_modelled(self):
        entries = [e for e, _ in self.store._entries.values()]
        assert sorted(e.snapshot.token_ids for e in entries) == sorted(self.model.order)
        assert self.store.nbytes == sum(e.snapshot.nbytes for e in entries) <= self.budget
        assert self.store.entries == len(entries)

    @invariant()
    def evicted_are_unreachable(self):
        in_tree = {str(n.entry.id) for n in self.store.root.walk() if n.entry is not None}
        assert in_tree == {str(i) for i in self.store._entries} and not in_tree & self.evicted

    @invariant()
    def tree_is_well_formed(self):
        for node in self.store.root.walk():
            for first, child in node.children.items():
                assert child.parent is node and child.edge and child.edge[0] == first
                assert child.depth == node.depth + len(child.edge)
                assert child.entry is not None or child.children  # pruned: no empty leaf


class PagedModel:
    """What an LRU PagedStore must hold: resident block hashes and vLLM's free queue (front =
    evicted first; a finished request frees its blocks tail first)."""

    def __init__(self, num_blocks, budget_blocks):
        self.num_blocks, self.budget_blocks = num_blocks, budget_blocks
        self.free: list[bytes] = []
        self.resident: set[bytes] = set()

    def refuses(self, hashes) -> str | None:
        if self.num_blocks is not None and len(hashes) > self.num_blocks:
            return "num_blocks"
        if self.budget_blocks is not None and len(hashes) > self.budget_blocks:
            return "budget_bytes"
        return None

    def insert(self, hashes) -> list[tuple[str, bytes]]:
        events = []
        cap = min(x for x in (self.num_blocks, self.budget_blocks) if x is not None)
        for h in hashes:  # the request references each block: a cached one leaves the free queue
            if h in self.resident:
                self.free.remove(h)
                continue
            while len(self.resident) >= cap:
                victim = self.free.pop(0)
                self.resident.remove(victim)
                events.append(("block_removed", victim))
            self.resident.add(h)
            events.append(("block_stored", h))
        self.free.extend(reversed(hashes))  # freed tail first: the tail is evicted before the head
        return events

    def lookup(self, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.resident:
            n += 1
        return n


class PagedMachine(RuleBasedStateMachine):
    """PagedStore against PagedModel: block_stored/block_removed in order, the free queue, lookups,
    and reference counts checked at every event *during* an insert (when blocks are referenced)."""

    def make_store(self, num_blocks, budget_bytes):
        return kv.PagedStore(block_size=BLOCK, num_blocks=num_blocks, budget_bytes=budget_bytes)

    @initialize(num_blocks=st.one_of(st.none(), st.integers(1, 12)),
                budget_blocks=st.one_of(st.none(), st.integers(1, 12)))
    def setup(self, num_blocks, budget_blocks):
        if num_blocks is None and budget_blocks is None:
            num_blocks = 12
        self.store = self.make_store(num_blocks, None if budget_blocks is None else budget_blocks * BLOCK_BYTES)
        self.model = PagedModel(num_blocks, budget_blocks)
        self.request: list[bytes] = []  # hashes of the request being inserted
        log, add = self.store.log, self.store.log.add

        def checked_add(event, **kw):  # the store's state at the moment of each event
            add(event, **kw)
            self._check_references(event, kw.get("entry"))
        log.add = checked_add

    def _check_references(self, event, entry):
        blocks = self.store._blocks
        referenced = [h for h, b in blocks.items() if b.ref_cnt > 0]
        assert all(blocks[h].ref_cnt == 1 for h in referenced)  # one request, one reference each
        unreferenced = {h for h, b in blocks.items() if b.ref_cnt == 0}
        if event == "block_stored":
            unreferenced.discard(bytes.fromhex(entry))  # just stored, about to be referenced
        assert set(self.store._free) == unreferenced
        k = len(referenced)
        assert set(referenced) == set(self.request[:k])  # the request's leading blocks, held
        if event == "block_stored":
            assert entry == self.request[k].hex()  # stored in order, before it is referenced
        elif event == "block_removed":
            assert bytes.fromhex(entry) not in self.request[:k]  # never a referenced block

    @rule(ids=ids_strategy)
    def insert(self, ids):
        key, snap = CacheKey(ids), synthetic(ids)
        hashes = self.store.hashes(key)
        refused = self.model.refuses(hashes)
        if refused:
            with pytest.raises(BudgetError, match=refused):
                self.store.insert(key, TOKS, snap)
            assert not self.store.drain_events()
            return
        self.request = hashes
        self.store.insert(key, TOKS, snap)
        self.request = []
        got = [(r.event, bytes.fromhex(r.entry)) for r in self.store.drain_events()]
        assert got == self.model.insert(hashes)
        assert all(r.ref_cnt == 0 for r in self.store._blocks.values())

    @rule(ids=ids_strategy)
    def lookup(self, ids):
        key, limit = CacheKey(ids), len(ids) - 1
        m = self.store.lookup(key, TOKS, limit=limit)
        hit = self.model.lookup(self.store.hashes(key, limit))
        assert m.tokens == hit * BLOCK
        if hit:
            assert m.kind == "prefix" and m.snapshot.offset == m.tokens
            check_content(m.snapshot, ids, m.tokens)
        else:
            assert m.kind == "miss" and m.snapshot is None

    @invariant()
    def free_queue_as_modelled(self):
        assert list(self.store._free) == self.model.free
        assert set(self.store._blocks) == self.model.resident
        assert self.store.nbytes == len(self.model.resident) * BLOCK_BYTES


SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None,
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


def test_paged_refuses_other_model_and_checkpoints_recurrent_layers():
    store = kv.PagedStore(block_size=BLOCK, num_blocks=8)
    ids = tuple(range(8))
    store.insert(CacheKey(ids), TOKS, synthetic(ids, fingerprint="model-a"))
    with pytest.raises(kv.errors.SnapshotError, match="one PagedStore per model"):
        store.insert(CacheKey(ids), TOKS, synthetic(ids, fingerprint="model-b"))
    # a recurrent state is kept as a checkpoint at the block end it was taken at (8), 12 bytes
    hybrid = kv.PagedStore(block_size=BLOCK, num_blocks=8)
    hybrid.insert(CacheKey(ids), TOKS, synthetic(ids, recurrent=True))
    assert hybrid.entries == 2 and hybrid.components()["recurrent"] == 12
    m = hybrid.lookup(CacheKey(ids), TOKS, limit=7)  # one block within 7 tokens, no checkpoint at 4
    assert m.kind == "miss" and "recurrent state of layer 2 (ArraysCache)" in m.why
    assert hybrid.lookup(CacheKey(ids + (9,)), TOKS, limit=8).tokens == 8


def test_radix_reinsert_refreshes_without_replacing():
    store = kv.RadixStore(budget_bytes=1 << 20)
    ids = tuple(range(8))
    store.insert(CacheKey(ids), TOKS, synthetic(ids))
    store.insert(CacheKey(ids), TOKS, synthetic(ids))
    events = [r.event for r in store.drain_events()]
    assert events == ["insert"] and store.entries == 1
