"""RadixStore and PagedStore evicting through kvlab.policies: the budget invariants hold under every
online policy (the hypothesis state machines of test_store_budget), and the policies change what
stays (scan resistance, priorities by insert kind) with the reason named in the events."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_store_budget import TOKEN_BYTES, TOKS, PagedMachine, RadixMachine, synthetic

import kvlab as kv
from kvlab.keys import CacheKey
from kvlab.policies import ONLINE, make_policy

MACHINE = settings(max_examples=15, stateful_step_count=20, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])


def radix_machine(policy):
    class M(RadixMachine):
        @initialize(budget_tokens=st.integers(1, 60))
        def setup(self, budget_tokens):
            self.budget = budget_tokens * TOKEN_BYTES
            self.store = kv.RadixStore(budget_bytes=self.budget, policy=policy)
            self.evicted = set()
    M.__name__ = f"Radix_{policy}"
    return M


def paged_machine(policy):
    class M(PagedMachine):
        @initialize(num_blocks=st.integers(1, 12))
        def setup(self, num_blocks):
            self.num_blocks = num_blocks
            self.store = kv.PagedStore(block_size=4, num_blocks=num_blocks, policy=policy)
            self.resident, self.removed = set(), set()
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
