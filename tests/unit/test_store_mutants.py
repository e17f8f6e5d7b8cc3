"""The state machines of test_store_budget.py catch broken stores: each mutant below is the store
with one thing wrong, and the machine, run with fixed settings (derandomized), must fail on it.

A machine that passed every mutant would only check that stores do not crash."""

import builtins
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvlab as kv
from kvlab.policies.recency import LRU
from kvlab.stores import paged as paged_module
from kvlab.stores.base import MISS

from test_store_budget import PagedMachine, RadixMachine

CATCH = settings(max_examples=300, stateful_step_count=30, deadline=None, derandomize=True,
                 database=None, phases=(Phase.explicit, Phase.generate),
                 suppress_health_check=list(HealthCheck))


class AlwaysMiss(kv.RadixStore):
    def lookup(self, key, tokens, *, limit):
        return MISS


class EvictsEveryOtherEntry(kv.RadixStore):
    def _evict(self, protect):
        for entry, node in list(self._entries.values()):
            if entry.id != protect:
                self._drop(entry, node, "lru")


class EvictsMostRecent(kv.RadixStore):
    def _evict(self, protect):
        while self._bytes > self.budget_bytes:
            victims = [e for e, _ in self._entries.values() if e.id != protect]
            if not victims:
                break
            victim = max(victims, key=lambda e: e.last_used)
            self._drop(victim, self._entries[victim.id][1], "lru")


class HitsDoNotRefresh(kv.RadixStore):
    def _touch(self, entry_id, sym, reuse):
        pass


class PrefixOnly(kv.RadixStore):
    """Sound but incomplete: never trims an entry (no lcp, supersequence or exact-minus-one)."""

    def lookup(self, key, tokens, *, limit):
        m = super().lookup(key, tokens, limit=limit)
        return m if m.kind in ("prefix", "miss") else MISS


RADIX_MUTANTS = {
    "lookup always misses": lambda budget: AlwaysMiss(budget_bytes=budget),
    "every other entry evicted on each insert": lambda budget: EvictsEveryOtherEntry(budget_bytes=budget),
    "most recently used entry evicted": lambda budget: EvictsMostRecent(budget_bytes=budget),
    "subsumption off": lambda budget: kv.RadixStore(budget_bytes=budget, subsume=False),
    "hits do not refresh recency": lambda budget: HitsDoNotRefresh(budget_bytes=budget),
    "prefix matches only": lambda budget: PrefixOnly(budget_bytes=budget),
}


@pytest.mark.parametrize("mutant", RADIX_MUTANTS)
def test_radix_machine_catches(mutant):
    class Mutant(RadixMachine):
        def make_store(self, budget):
            return RADIX_MUTANTS[mutant](budget)

    with pytest.raises(AssertionError):
        run_state_machine_as_test(Mutant, settings=CATCH)


class NewestFirst(LRU):
    """The eviction order reversed: the most recently freed block goes first."""

    def _pick(self, ok):
        key = next(k for k in reversed(self.order) if ok(k))
        del self.order[key]
        return key


class KeepsHitsFree(OrderedDict):
    """A free queue a reused block never leaves: it can be evicted while a request holds it."""

    def pop(self, key, *default):
        return self.get(key, *default)


def _paged(num_blocks, budget_bytes):
    return kv.PagedStore(block_size=4, num_blocks=num_blocks, budget_bytes=budget_bytes)


def _evicts_newest(num_blocks, budget_bytes):
    store = _paged(num_blocks, budget_bytes)
    store.policy = NewestFirst(store.policy.capacity)
    store._policy_spec = None  # keep this policy when the first snapshot sizes the pool
    return store


def _keeps_hits_free(num_blocks, budget_bytes):
    store = _paged(num_blocks, budget_bytes)
    store._free = KeepsHitsFree()
    return store


def _head_first_range(*args):
    # insert frees a request's blocks with range(n - 1, -1, -1) (tail first); this frees head first
    if len(args) == 3 and args[2] == -1:
        return builtins.range(args[1] + 1, args[0] + 1)
    return builtins.range(*args)


PAGED_MUTANTS = {
    "evict newest": _evicts_newest,
    "referenced block left in the free queue": _keeps_hits_free,
    "free head first": None,  # the request's blocks freed head first (below)
}


@pytest.mark.parametrize("mutant", PAGED_MUTANTS)
def test_paged_machine_catches(mutant, monkeypatch):
    make = PAGED_MUTANTS[mutant]
    if mutant == "free head first":
        monkeypatch.setattr(paged_module, "range", _head_first_range, raising=False)

    class Mutant(PagedMachine):
        def make_store(self, num_blocks, budget_bytes):
            if make is None:
                return super().make_store(num_blocks, budget_bytes)
            return make(num_blocks, budget_bytes)

    with pytest.raises(AssertionError):
        run_state_machine_as_test(Mutant, settings=CATCH)


@pytest.mark.parametrize("machine", [RadixMachine, PagedMachine])
def test_the_real_stores_pass_the_same_settings(machine):
    run_state_machine_as_test(machine, settings=CATCH)
