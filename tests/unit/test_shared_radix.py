"""SharedRadixStore against a model of what it must hold, whatever the requests and the policy:
a hypothesis state machine with synthetic snapshots (no model), and deterministic cases.

The model keeps the set of resident prefixes (every token a node holds is the prefix ending at
it), updated from the store's own events: an ``insert`` adds the node's tokens (checked equal to
the inserting key's), an ``evict`` removes them. Checked at every step: the bytes equal the sum of
the nodes' KV bytes and, at every event *during* an insert, never exceed the budget; every lookup
returns the longest reusable match the resident prefixes allow, with the KV of exactly those
tokens; a node evicted for room is a leaf (no resident prefix extends it) and not on the path of
the insert running. ``test_mutants_are_caught`` runs the machine on broken stores.
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

import kvlab as kv
from kvlab.errors import BudgetError, KvlabError, SnapshotError
from kvlab.keys import CacheKey
from kvlab.policies import ONLINE
from kvlab.experiments.replay import replay
from kvlab.stores import SharedRadixStore, make_store
from kvlab.stores.shared_radix import SPLIT

from test_store_budget import TOKEN_BYTES, TOKS, check_content, code, ids_strategy, lcp, synthetic

SALTS = st.sampled_from([None, None, "tenant-b"])


class SharedMachine(RuleBasedStateMachine):
    """SharedRadixStore (any online policy, any budget) against the set of resident prefixes."""

    def make_store(self, budget: int, policy: str):
        return SharedRadixStore(budget, policy=policy)

    @initialize(budget_tokens=st.integers(1, 60), policy=st.sampled_from(ONLINE))
    def setup(self, budget_tokens, policy):
        self.budget = budget_tokens * TOKEN_BYTES
        self.store = self.make_store(self.budget, policy)
        self.resident: set[tuple] = set()  # symbol prefixes whose last token's KV is held
        self.node_prefix: dict[str, tuple] = {}  # node id -> its path's symbols up to its end
        self.inserting: tuple | None = None
        self.prefix_at: list = []  # per event logged: an inserted node's path symbols
        log, add = self.store.log, self.store.log.add

        def checked_add(event, **kw):  # the store at the moment of each event
            add(event, **kw)
            assert self.store.nbytes <= self.budget, f"{self.store.nbytes} B held over {self.budget} B at {event}"
            node, edges = self.store._nodes.get(int(kw["entry"])) if event == "insert" else None, []
            while node is not None and node is not self.store.root:
                edges.append(node.edge)
                node = node.parent
            self.prefix_at.append(sum(reversed(edges), ()))
        log.add = checked_add

    def _apply_events(self, sym):
        rows, prefixes, self.prefix_at = self.store.drain_events(), self.prefix_at, []
        split = None  # the symbols of a node just split: its two halves come next
        for row, prefix in zip(rows, prefixes):
            if row.event == "insert":
                if split is not None:  # a half of the split node: the same tokens
                    assert prefix == split[: len(prefix)], "a split half holds other tokens"
                    split = None if prefix == split else split
                else:
                    assert prefix == sym[: len(prefix)] == sym, "a new node is not the key's tail"
                self.node_prefix[row.entry] = prefix
                self.resident |= {prefix[:k] for k in range(len(prefix) - row.tokens + 1, len(prefix) + 1)}
                continue
            assert row.event == "evict"
            prefix = self.node_prefix.pop(row.entry)
            start = len(prefix) - row.tokens
            if row.capacity:
                assert not any(len(p) > len(prefix) and p[: len(prefix)] == prefix for p in self.resident), \
                    "evicted a node that has children"
                assert sym[: len(prefix)] != prefix, "evicted a node on the path of the insert running"
            else:
                assert row.reason == SPLIT and split is None
                split = prefix
            self.resident -= {prefix[:k] for k in range(start + 1, len(prefix) + 1)}
        assert split is None

    @rule(ids=ids_strategy, salt=SALTS)
    def insert(self, ids, salt):
        key, snap = CacheKey(ids, salt=salt), synthetic(ids)
        sym = key.symbols()
        before = (self.store.nbytes, self.store.entries)
        # what the path would hold: every token of it, at TOKEN_BYTES each
        if len(ids) * TOKEN_BYTES > self.budget:
            with pytest.raises(BudgetError, match="budget"):
                self.store.insert(key, TOKS, snap)
            assert (self.store.nbytes, self.store.entries) == before and not self.store.drain_events()
            return
        self.store.insert(key, TOKS, snap)
        self._apply_events(sym)
        assert all(sym[:k] in self.resident for k in range(1, len(sym) + 1)), "an inserted token is missing"
        assert self.store.contains(key)

    @rule(ids=ids_strategy, salt=SALTS)
    def lookup(self, ids, salt):
        key = CacheKey(ids, salt=salt)
        sym, limit = key.symbols(), len(ids) - 1
        m = self.store.lookup(key, TOKS, limit=limit)
        shared = max((k for k in range(len(sym) + 1) if k == 0 or sym[:k] in self.resident), default=0)
        assert m.tokens == min(shared, limit), f"not the longest reusable match: {m} for {ids}"
        if m.tokens == 0:
            assert m.kind == "miss" and m.snapshot is None
            return
        assert m.snapshot.offset == m.tokens and m.snapshot.token_ids == ids[: m.tokens]
        got = m.snapshot.layers[0].state[0][0, 0, :, 0].tolist()
        assert got == [code(ids[: i + 1]) for i in range(m.tokens)], "the KV returned is not the prefix's"
        assert m.kind in (("exact", "supersequence") if shared == len(sym) else ("prefix", "lcp"))

    @invariant()
    def bytes_are_the_nodes_kv(self):
        nodes = [n for n in self.store.root.walk() if n is not self.store.root]
        assert self.store.nbytes == sum(n.kv.nbytes for n in nodes), "bytes are not the nodes' KV bytes"
        assert self.store.nbytes <= self.budget and self.store.entries == len(nodes)
        assert self.store.nbytes == TOKEN_BYTES * len(self.resident)  # each resident token once

    @invariant()
    def tree_is_well_formed(self):
        for node in self.store.root.walk():
            assert node.lock == 0
            for first, child in node.children.items():
                assert child.parent is node and child.edge and child.edge[0] == first
                assert child.depth == node.depth + len(child.edge) and child.kv.offset == len(child.edge)


SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestSharedRadix = SharedMachine.TestCase
TestSharedRadix.settings = SETTINGS


# -- mutants ------------------------------------------------------------------------------------

class EvictsInnerNodes(SharedRadixStore):
    def _evictable(self, key):
        return self._nodes[key].lock == 0


class IgnoresLocks(SharedRadixStore):
    def _evictable(self, key):
        return not self._nodes[key].children


class InsertsThenEvicts(SharedRadixStore):
    """RadixStore's order: the new KV first, room after (the budget is exceeded meanwhile)."""

    def _make_room(self, incoming, buffers=0):
        pass

    def _add(self, node):
        super()._add(node)
        while self._bytes > self.budget_bytes:
            self._evict(self._nodes[self.policy.victim(self._evictable)])


class LoseSplitBytes(SharedRadixStore):
    def _split(self, node, m):
        head = super()._split(node, m)
        self._bytes -= 1
        return head


class StopsAtNodeBoundary(SharedRadixStore):
    """Reuses only whole nodes: the partly matched last node is left out."""

    def lookup(self, key, tokens, *, limit):
        path, shared = self._walk(key.symbols())
        if path and path[-1].depth > shared:
            limit = min(limit, path[-1].start)
        return super().lookup(key, tokens, limit=limit)


class JoinsInReverse(SharedRadixStore):
    def lookup(self, key, tokens, *, limit):
        m = super().lookup(key, tokens, limit=limit)
        if m.snapshot is None or len([n for n in self._walk(key.symbols())[0] if n.start < m.tokens]) < 2:
            return m
        from kvlab.stores import edge_kv
        used = [n for n in self._walk(key.symbols())[0] if n.start < m.tokens][::-1]
        snap = edge_kv.join([(n.kv, min(n.depth, m.tokens) - n.start) for n in used], key.ids[: m.tokens])
        return type(m)(m.kind, m.tokens, snap, m.entry_tokens, m.entry_id)


CATCH = settings(max_examples=300, stateful_step_count=30, deadline=None, derandomize=True,
                 database=None, phases=(Phase.explicit, Phase.generate),
                 suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("mutant, check", [
    (EvictsInnerNodes, "evicted a node that has children"),
    (IgnoresLocks, "evicted a node on the path of the insert running"),
    (InsertsThenEvicts, "held over"),
    (LoseSplitBytes, "bytes are not the nodes' KV bytes"),
    (StopsAtNodeBoundary, "not the longest reusable match"),
    (JoinsInReverse, "the KV returned is not the prefix's")])
def test_mutants_are_caught(mutant, check):
    class Broken(SharedMachine):
        def make_store(self, budget, policy):
            return mutant(budget, policy=policy)

    with pytest.raises(AssertionError, match=check):
        run_state_machine_as_test(Broken, settings=CATCH)


# -- deterministic semantics --------------------------------------------------------------------

P = tuple(range(100, 112))  # a 12-token shared prefix


def test_siblings_store_the_shared_prefix_once():
    store = SharedRadixStore(1 << 20)
    for s in range(5):
        ids = P + tuple(range(200 + 10 * s, 204 + 10 * s))
        store.insert(CacheKey(ids), TOKS, synthetic(ids))
    assert store.nbytes == (12 + 5 * 4) * TOKEN_BYTES and store.entries == 1 + 5
    radix = kv.RadixStore(1 << 20)
    for s in range(5):
        ids = P + tuple(range(200 + 10 * s, 204 + 10 * s))
        radix.insert(CacheKey(ids), TOKS, synthetic(ids))
    assert radix.nbytes == 5 * 16 * TOKEN_BYTES  # the prefix five times


def test_split_replaces_the_node_and_keeps_the_bytes():
    store = SharedRadixStore(1 << 20)
    a, b = P + (1, 2, 3), P[:5] + (9, 9)
    store.insert(CacheKey(a), TOKS, synthetic(a))
    store.drain_events()
    store.insert(CacheKey(b), TOKS, synthetic(b))
    ev = [(r.event, r.reason, r.tokens, r.capacity) for r in store.drain_events()]
    assert ev == [("evict", SPLIT, 15, False), ("insert", None, 5, False), ("insert", None, 10, False),
                  ("insert", None, 2, False)]
    assert store.nbytes == (15 + 2) * TOKEN_BYTES
    frame = store.tree_frame().sort("start")
    assert frame["tokens"].to_list() == [0, 5, 10, 2] or frame["tokens"].to_list() == [0, 5, 2, 10]
    m = store.lookup(CacheKey(a), TOKS, limit=len(a) - 1)
    assert (m.kind, m.tokens) == ("exact", 14)
    check_content(m.snapshot, a, 14)


def test_lru_evicts_leaves_first_and_keeps_the_shared_prefix():
    a, b, c = P + (1, 2, 3, 4), P + (5, 6, 7, 8), tuple(range(300, 308))
    store = SharedRadixStore((12 + 4 + 4 + 8) * TOKEN_BYTES - 1, policy="lru")
    for ids in (a, b):
        store.insert(CacheKey(ids), TOKS, synthetic(ids))
    store.drain_events()
    store.insert(CacheKey(c), TOKS, synthetic(c))  # needs 8 tokens: a's leaf (least recent) goes
    gone = [r for r in store.drain_events() if r.capacity]
    assert [(r.tokens, r.reason) for r in gone] == [(4, "lru")]
    assert store.lookup(CacheKey(a + (0,)), TOKS, limit=len(a)).tokens == 12  # the prefix stayed
    assert store.lookup(CacheKey(b + (0,)), TOKS, limit=len(b)).tokens == 16


def test_match_kinds_follow_radix_store():
    """Kinds as RadixStore names them, on fresh stores (where RadixStore holds several entries
    below the match, its kind depends on which one it used last; this store has no entries to pick)."""
    a = P + (1, 2, 3)
    expected = {(a, 14): "exact", (P, 11): "exact", (P + (1, 2, 3, 4), 15): "prefix", (P + (7,), 12): "prefix",
                (P[:6] + (8, 8), 7): "lcp", (P + (1, 9), 13): "lcp", (P + (1,), 13): "supersequence", (P[:10], 9): "supersequence"}
    for (q, limit), kind in expected.items():
        store, radix = SharedRadixStore(1 << 20), kv.RadixStore(1 << 20)
        for s in (store, radix):
            s.insert(CacheKey(a), TOKS, synthetic(a))
            s.insert(CacheKey(P), TOKS, synthetic(P))
        m, r = store.lookup(CacheKey(q), TOKS, limit=limit), radix.lookup(CacheKey(q), TOKS, limit=limit)
        assert (m.kind, m.tokens) == (r.kind, r.tokens) == (kind, min(lcp(q, a), limit)), q


def test_salt_and_extra_keys_part_the_tree():
    store = SharedRadixStore(1 << 20)
    ids = P + (1, 2)
    store.insert(CacheKey(ids, ((5, 7, "imgA"),)), TOKS, synthetic(ids))
    assert store.lookup(CacheKey(ids, ((5, 7, "imgA"),)), TOKS, limit=13).tokens == 13
    assert store.lookup(CacheKey(ids, ((5, 7, "imgB"),)), TOKS, limit=13).tokens == 5
    assert store.lookup(CacheKey(ids), TOKS, limit=13).tokens == 5
    assert store.lookup(CacheKey(ids, salt="tenant-2"), TOKS, limit=13).tokens == 0


def test_refuses_other_models():  # recurrent layers: test_shared_radix_hybrid.py
    ids = tuple(range(8))
    store = SharedRadixStore(1 << 20)
    store.insert(CacheKey(ids), TOKS, synthetic(ids, fingerprint="model-a"))
    with pytest.raises(SnapshotError, match="one store per model"):
        store.insert(CacheKey(ids), TOKS, synthetic(ids, fingerprint="model-b"))


def test_too_big_changes_nothing_and_offline_policies_are_refused():
    store = SharedRadixStore(10 * TOKEN_BYTES)
    a = tuple(range(8))
    store.insert(CacheKey(a), TOKS, synthetic(a))
    store.drain_events()
    with pytest.raises(BudgetError, match="raise budget_bytes"):
        store.insert(CacheKey(a[:4] + tuple(range(50, 57))), TOKS, synthetic(a[:4] + tuple(range(50, 57))))
    assert store.nbytes == 8 * TOKEN_BYTES and store.entries == 1 and not store.drain_events()
    with pytest.raises(KvlabError, match="offline"):
        SharedRadixStore(1 << 20, policy="belady")


def test_on_evict_receives_the_whole_path():
    got = []
    a, b = P + (1, 2, 3, 4), tuple(range(300, 312))
    store = SharedRadixStore(20 * TOKEN_BYTES, on_evict=lambda name, snap: got.append((name, snap)))
    store.insert(CacheKey(a), TOKS, synthetic(a))
    store.insert(CacheKey(b), TOKS, synthetic(b))
    assert len(got) == 1 and got[0][1].offset == 16
    check_content(got[0][1], a, 16)


def test_made_by_name_and_replayed():
    store = make_store("shared-radix", budget_bytes=1 << 20)
    assert isinstance(store, SharedRadixStore) and "shared-radix" in kv.stores.STORE_NAMES
    assert repr(store).startswith("SharedRadixStore(0 nodes") and "<b>SharedRadixStore</b>" in store._repr_html_()
    prompts = [P + (1, 2, 3), P + (4, 5, 6), P + (1, 2, 3)]
    r, s = replay(prompts, "shared-radix"), replay(prompts, "radix")
    assert r.reused == s.reused == (0, 12, 14)
    assert r.store.nbytes == (12 + 3 + 3) * 8 and s.store.nbytes == 2 * 15 * 8
    assert lcp(P, P + (1,)) == 12
