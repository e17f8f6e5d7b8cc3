"""RadixStore and PagedStore evicting through kvlab.policies: the budget invariants hold under every
online policy (the hypothesis state machines of test_store_budget), and the policies change what
stays (scan resistance, priorities by insert kind) with the reason named in the events."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from test_store_budget import TOKEN_BYTES, TOKS, PagedMachine, RadixMachine, ids_strategy, synthetic

import kvlab as kv
from kvlab.errors import BudgetError
from kvlab.keys import CacheKey
from kvlab.policies import ONLINE, make_policy

MACHINE = settings(max_examples=15, stateful_step_count=20, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])


def radix_machine(policy):
    """RadixMachine whose model follows the store's own choice of victims: the policy decides
    what leaves, so the machine checks what holds under any policy (budget, bytes, evictions
    only when the budget demands, complete and correct lookups over what is resident)."""

    class M(RadixMachine):
        def make_store(self, budget):
            return kv.RadixStore(budget_bytes=budget, policy=policy)

        @rule(ids=ids_strategy, recurrent=st.booleans())
        def insert(self, ids, recurrent):
            snap = synthetic(ids, recurrent=recurrent)
            if snap.nbytes > self.budget:
                with pytest.raises(BudgetError, match="budget"):
                    self.store.insert(CacheKey(ids), TOKS, snap)
                return
            self.store.insert(CacheKey(ids), TOKS, snap)
            events = self.store.drain_events()
            room = [e for e in events if e.capacity]
            assert all(e.reason == policy for e in room)
            if room:  # it stopped as soon as everything fitted: the last victim had to go
                assert self.store.nbytes + room[-1].nbytes > self.budget
            self.evicted |= {e.entry for e in events if e.event == "evict"}
            entries = sorted((e for e, _ in self.store._entries.values()), key=lambda e: e.last_used)
            m = self.model
            m.order = [e.snapshot.token_ids for e in entries]
            m.trimmable = {e.snapshot.token_ids: e.snapshot.trimmable for e in entries}
            m.nbytes = {e.snapshot.token_ids: e.snapshot.nbytes for e in entries}
            self.ids_of = {str(e.id): e.snapshot.token_ids for e in entries}
            assert self.store.contains(CacheKey(ids))

    M.__name__ = f"Radix_{policy}"
    return M


def paged_machine(policy):
    """PagedMachine's reference and budget checks under any policy (the victims are the
    policy's): resident blocks, references during an insert, lookups over resident blocks."""

    class M(PagedMachine):
        def make_store(self, num_blocks, budget_bytes):
            return kv.PagedStore(block_size=4, num_blocks=num_blocks, budget_bytes=budget_bytes,
                                 policy=policy)

        @rule(ids=ids_strategy)
        def insert(self, ids):
            key, snap = CacheKey(ids), synthetic(ids)
            hashes = self.store.hashes(key)
            if self.model.refuses(hashes):
                with pytest.raises(BudgetError):
                    self.store.insert(key, TOKS, snap)
                return
            self.request = hashes
            self.store.insert(key, TOKS, snap)
            self.request = []
            events = self.store.drain_events()
            assert all(e.reason == policy for e in events if e.event == "block_removed")
            assert set(hashes) <= set(self.store._blocks)
            self.model.resident = set(self.store._blocks)
            self.model.free = list(self.store._free)
            assert all(b.ref_cnt == 0 for b in self.store._blocks.values())

    M.__name__ = f"Paged_{policy}"
    return M


@pytest.mark.parametrize("policy", ONLINE)
def test_radix_budget_invariants_under_every_policy(policy):
    case = radix_machine(policy).TestCase
    case.settings = MACHINE
    case("runTest").runTest()


@pytest.mark.parametrize("policy", ONLINE)
def test_paged_budget_invariants_under_every_policy(policy):
    case = paged_machine(policy).TestCase
    case.settings = MACHINE
    case("runTest").runTest()


def ids(start, n):
    return tuple(range(start, start + n))


HOT = ids(500, 16)


def paged_scan(policy) -> int:
    """A hot 16-token prefix (4 blocks) used twice, then 10 one-off 20-token prompts through a
    16-block pool: hot tokens a later prompt still reuses."""
    store = kv.PagedStore(block_size=4, num_blocks=16, policy=policy)
    for k, prompt in enumerate([HOT + ids(900, 4), HOT + ids(910, 4)]
                               + [ids(1000 + 100 * i, 20) for i in range(10)]):
        store.insert(CacheKey(prompt), TOKS, synthetic(prompt))
    reasons = {e.reason for e in store.drain_events() if e.event == "block_removed"}
    assert reasons == {policy}
    probe = HOT + ids(990, 4)
    return store.lookup(CacheKey(probe), TOKS, limit=len(probe) - 1).tokens


def test_paged_store_scan_resistance():
    assert paged_scan("lru") == 0
    assert paged_scan("arc") == 16
    assert paged_scan("s3fifo") == 16


def radix_scan(policy) -> int:
    store = kv.RadixStore(budget_bytes=100 * TOKEN_BYTES, policy=policy)  # five 20-token entries
    hot = HOT + ids(900, 4)
    store.insert(CacheKey(hot), TOKS, synthetic(hot))
    assert store.lookup(CacheKey(hot + (1,)), TOKS, limit=len(hot)).tokens == 20
    for i in range(10):
        p = ids(1000 + 100 * i, 20)
        store.insert(CacheKey(p), TOKS, synthetic(p))
    evicted = [e for e in store.drain_events() if e.event == "evict"]
    assert {e.reason for e in evicted} == {policy} and all(e.capacity for e in evicted)
    return store.lookup(CacheKey(hot + (1,)), TOKS, limit=len(hot)).tokens


def test_radix_store_scan_resistance():
    assert radix_scan("lru") == 0
    assert radix_scan("arc") == 20
    assert radix_scan("slru") == 20


def test_radix_priority_keeps_system_entries():
    def run(policy):
        store = kv.RadixStore(budget_bytes=60 * TOKEN_BYTES, policy=policy)
        system = ids(0, 20)
        store.insert(CacheKey(system), TOKS, synthetic(system), kind="system")
        for i in range(6):
            p = ids(1000 + 100 * i, 20)
            store.insert(CacheKey(p), TOKS, synthetic(p))
        return store.contains(CacheKey(system))

    assert run("priority") and not run("lru")


def test_store_policy_arguments():
    p = make_policy("s3fifo", 16)
    store = kv.PagedStore(block_size=4, num_blocks=16, policy=p)
    assert store.policy is p
    with pytest.raises(kv.KvlabError, match="policy_params apply to a policy name"):
        kv.PagedStore(block_size=4, policy=p, policy_params={"small_percent": 5})
    with pytest.raises(kv.KvlabError, match="unknown policy 'clock'"):
        kv.RadixStore(budget_bytes=1 << 20, policy="clock")
    assert kv.RadixStore(budget_bytes=1 << 20, policy="slru", policy_params={"protected_percent": 50}
                         ).policy.protected_cap == 1 << 19
    # without num_blocks the pool is the budget in blocks, known once the first snapshot arrives
    paged = kv.PagedStore(block_size=4, budget_bytes=10 * 4 * TOKEN_BYTES, policy="arc")
    assert paged.policy.capacity is None
    paged.insert(CacheKey(ids(0, 8)), TOKS, synthetic(ids(0, 8)))
    assert paged.policy.capacity == 10 and len(paged.policy) == 2


def test_a_store_declares_its_eviction_policy_and_the_diagnostics_read_it(tmp_path):
    """A store says which policy evicts from it (``Capabilities.eviction_policy``); the served
    diagnostics read that declaration, never a probe of the store's attributes. Mutant caught:
    ServedDiagnostics reading ``getattr(store, "policy")`` (the store below declares "fifo" but has
    no ``policy`` attribute: None)."""
    from kvlab.serving.diagnosing import ServedDiagnostics
    from kvlab.stores.base import Capabilities, EventLog, StoreBase

    assert kv.RadixStore(1 << 20, policy="arc").capabilities.eviction_policy == "arc"
    assert kv.PagedStore(4, num_blocks=8, policy="s3fifo").capabilities.eviction_policy == "s3fifo"
    assert kv.stores.SharedRadixStore(1 << 20, policy="lfu").capabilities.eviction_policy == "lfu"
    tiered = kv.stores.TieredStore(kv.RadixStore(1 << 20, policy="slru"), kv.DiskStore(tmp_path, model="f" * 64))
    assert tiered.capabilities.eviction_policy == "slru"  # what leaves RAM for room (to the disk)
    assert kv.SystemPromptStore().capabilities.eviction_policy is None  # it only replaces its one entry

    class Declared(StoreBase):
        name = "declared"
        log = EventLog()

        @property
        def capabilities(self):
            return Capabilities(eviction_policy="fifo")

    assert ServedDiagnostics(None, "declared", store=Declared()).policy == "fifo"
    assert ServedDiagnostics(None, "radix", store=kv.RadixStore(1 << 20)).policy == "lru"
    assert ServedDiagnostics(None, "none", store=None).policy is None
