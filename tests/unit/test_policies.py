"""kvlab.policies: one table, one definition each; every compiled kernel equal to its plain-Python
definition (hits, eviction log, miss reasons) on random traces; each policy's own semantics on
hand-made sequences."""

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import chained_traces, hits, trace

import kvlab as kv
from kvlab.sim import simulator
from kvlab.policies import ONLINE, POLICIES, Unit, make_policy, policies_frame
from kvlab.sim.dispatch import KERNELS, run_kernel
from kvlab.sim.prepare import prepare_replay
from kvlab.sim.reference import run_python

PARAMS = {"slru": {"protected_percent": 50}, "s3fifo": {"small_percent": 25},
          "tinylfu": {"sample_factor": 2}, "cost_aware": {"linear": 7}, "priority": {"pin_tokens": 8}}


def singles(*blocks, bs=4):
    """One-full-block requests (n = bs + 1), each with its own partial tail id."""
    return trace([(bs + 1, [b, 10_000 + i]) for i, b in enumerate(blocks)], bs)


# --- the table ------------------------------------------------------------------------------


def test_every_policy_is_in_the_table_with_a_source_and_a_kernel():
    assert list(POLICIES) == ["lru", "fifo", "lfu", "slru", "s3fifo", "arc", "tinylfu", "length_aware",
                              "cost_aware", "priority", "belady"]
    assert set(KERNELS) == set(POLICIES)
    assert simulator.POLICIES == ("infinite", *POLICIES)
    assert ONLINE == tuple(p for p in POLICIES if p != "belady")
    for name, info in POLICIES.items():
        assert info.source.startswith("https://") and info.semantics
        assert info.definition.name == name and info.definition.__doc__
        assert name in repr(info) and "<b>" in info._repr_html_()
    frame = policies_frame()
    assert frame.columns == ["policy", "offline", "semantics", "source"] and frame.height == 11
    assert frame.filter(pl.col("offline"))["policy"].to_list() == ["belady"]


def test_make_policy_errors_say_what_to_do():
    with pytest.raises(kv.KvlabError, match="unknown policy 'clock'; use one of lru, fifo"):
        make_policy("clock")
    with pytest.raises(kv.KvlabError, match=r"does not take \['pin_tokens'\]"):
        make_policy("lru", 4, pin_tokens=3)
    with pytest.raises(kv.BudgetError, match="capacity must be an int >= 0"):
        make_policy("arc", -1)
    with pytest.raises(kv.KvlabError, match=r"policy 'arc' does not take \['nope'\]"):
        kv.simulate(singles(1), "arc", 4, policy_params={"nope": 1})


def test_policy_objects_show_themselves_and_honour_evictable():
    p = make_policy("lru", 3)
    for k in "abc":
        p.access(Unit(k))
    p.access(Unit("a"))
    assert repr(p) == "LRU(3 units, size 3 of 3)" and "<code>" in p._repr_html_()
    assert p.victim(lambda k: k != "b") == "c"   # b is least recent but held by the cache
    p.remove("b")
    assert list(p.order) == ["a"] and p.size == 1 and "b" not in p
    with pytest.raises(kv.BudgetError, match="nothing evictable"):
        p.victim(lambda k: False)
    assert repr(Unit(7, depth=16, tokens=16)) == "Unit(7, size=1, depth=16, tokens=16)"


# --- compiled == reference ---------------------------------------------------------------------


def same(a, b):
    assert a.hits.tolist() == b.hits.tolist()
    assert a.evicted.tolist() == b.evicted.tolist()
    assert a.evicted_at.tolist() == b.evicted_at.tolist()
    assert a.reasons.tolist() == b.reasons.tolist()
    assert a.evicted_by.tolist() == b.evicted_by.tolist()


@pytest.mark.parametrize("policy", [*POLICIES, "infinite"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=chained_traces(out_of_chain=True, priorities=True), cap_blocks=st.integers(0, 30), passes=st.integers(1, 2), with_params=st.booleans())
def test_compiled_replay_equals_the_definition(policy, t, cap_blocks, passes, with_params):
    rep = prepare_replay(t, None, passes, None)
    cap = None if policy == "infinite" else cap_blocks
    params = PARAMS.get(policy) if with_params else None
    ref = run_python(rep, policy, cap, params)
    fast = run_kernel(rep, policy, cap, params)
    same(ref, fast)
    # every missed token has exactly one reason
    missed = rep.tokens - ref.hits * rep.block_size
    assert ref.reasons.sum(axis=1).tolist() == missed.tolist()
    assert (ref.reasons >= 0).all()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_compiled_equals_definition_on_the_mooncake_trace(policy):
    rep = prepare_replay(kv.traces.read().head(600), None, 2, None)
    for cap in (0, 40, 900):
        same(run_python(rep, policy, cap, PARAMS.get(policy)), run_kernel(rep, policy, cap, PARAMS.get(policy)))


# --- each policy's semantics --------------------------------------------------------------------

ENGINES = ["numba", "python"]


@pytest.mark.parametrize("engine", ENGINES)
def test_slru_protects_what_was_hit_twice(engine):
    # capacity 3 (protected share 2 of 3): A is hit, then a scan of B C D passes through probation
    t = singles(1, 1, 2, 3, 4, 1)
    assert hits(kv.simulate(t, "slru", 12, engine=engine)) == [0, 1, 0, 0, 0, 1]
    assert hits(kv.simulate(t, "lru", 12, engine=engine)) == [0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("engine", ENGINES)
def test_s3fifo_drops_one_hit_wonders_and_readmits_ghosts(engine):
    # capacity 2: small share 10% -> small is evicted first while it holds anything
    t = singles(1, 2, 1, 3, 2, 4, 2)
    got = kv.simulate(t, "s3fifo", 8, engine=engine)
    # 1 was hit in small -> moves to main when 3 arrives; 2 goes to the ghost; 2 comes back into
    # main (a ghost), 4 is a one-hit wonder evicted from small, so 2 stays and hits
    assert hits(got) == [0, 0, 1, 0, 0, 0, 1]
    p = make_policy("s3fifo", 2)
    for k in (1, 2, 1, 3):
        p.access(Unit(k))
    assert p.victim() == 2 and list(p.ghost) == [2]


@pytest.mark.parametrize("engine", ENGINES)
def test_arc_adapts_to_ghost_hits(engine):
    p = make_policy("arc", 2)
    for k in (1, 1, 2, 3):   # 1 seen twice: T2; 2 and 3 once: T1
        p.access(Unit(k))
    assert p.victim() == 2 and list(p.b1) == [2] and p.p == 0
    p.access(Unit(2))      # a ghost hit in B1: recency deserves more room
    assert p.p == 1 and list(p.t2) == [1, 2] and list(p.t1) == [3]
    assert p.victim() == 1 and list(p.b2) == [1]  # T1 is at its target: T2's oldest goes
    t = singles(1, 1, 2, 3, 4, 5, 1)   # 1 is in T2; a scan of T1-only blocks cannot push it out
    assert hits(kv.simulate(t, "arc", 8, engine=engine)) == [0, 1, 0, 0, 0, 0, 1]
    assert hits(kv.simulate(t, "lru", 8, engine=engine)) == [0, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("engine", ENGINES)
def test_tinylfu_rejects_a_newcomer_used_less_than_the_victim(engine):
    t = singles(1, 1, 1, 2, 3, 1)   # 1 is used thrice; 2 and 3 once each
    assert hits(kv.simulate(t, "tinylfu", 4, engine=engine)) == [0, 1, 1, 0, 0, 1]
    assert hits(kv.simulate(t, "lru", 4, engine=engine)) == [0, 1, 1, 0, 0, 0]
    p = make_policy("tinylfu", 1, sample_factor=100)
    for k in (1, 1, 2):
        p.access(Unit(k))
    assert p.freq(1) == 2 and p.freq(2) == 1 and p.victim() == 2


def test_tinylfu_frequencies_age():
    p = make_policy("tinylfu", 1, sample_factor=4)  # halve every 4 accesses
    for k in (1, 1, 1, 2):
        p.access(Unit(k))
    assert p.epoch == 1 and p.freq(1) == 1 and p.freq(2) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_length_aware_evicts_later_blocks_first_among_equals(engine):
    # one 3-block request, capacity 2: lfu ties go to the least recent (the head was accessed
    # last, so the tail goes); length_aware also drops the deepest: here the same block
    t = trace([(13, [0, 1, 2, 3]), (5, [7, 8]), (13, [0, 1, 2, 9])])
    assert hits(kv.simulate(t, "length_aware", 8, engine=engine)) == [0, 0, 1]
    p = make_policy("length_aware", 2)
    p.access(Unit("deep", depth=512))
    p.access(Unit("shallow", depth=0))
    p.access(Unit("shallow", depth=0))
    p.access(Unit("deep", depth=512))
    assert p.victim() == "deep"   # equal counts: the later block goes although used more recently
    q = make_policy("lfu", 2)
    for u in ("deep", "shallow", "shallow", "deep"):
        q.access(Unit(u))
    assert q.victim() == "shallow"


def test_cost_aware_prices_depth_and_evicts_leaves_only():
    assert kv.policies.recompute_cost(0, 16) < kv.policies.recompute_cost(4096, 16)
    p = make_policy("cost_aware", 10, linear=0)
    p.access(Unit("root", depth=0, tokens=16))
    p.access(Unit("child", depth=16, tokens=16, parent="root"))
    p.access(Unit("other", depth=4096, tokens=16))
    # the root is cheapest but has a resident child: the child (a leaf) goes first
    assert p.victim() == "child"
    assert p.victim() == "root" and p.inflation == kv.policies.recompute_cost(0, 16, 0)
    # the deep block outlives a shallow one used as often
    p.access(Unit("shallow", depth=0, tokens=16))
    assert p.victim() == "shallow"


@pytest.mark.parametrize("engine", ENGINES)
def test_cost_aware_keeps_deep_expensive_chains(engine):
    # capacity 3 blocks; request 0 is a 3-block chain, request 1 a single shallow block: the
    # chain's leaf is dearer than the single block (deeper), so the single block goes
    t = trace([(13, [0, 1, 2, 3]), (5, [7, 8]), (13, [0, 1, 2, 9])])
    assert hits(kv.simulate(t, "cost_aware", 12, engine=engine)) == [0, 0, 3]
    assert hits(kv.simulate(t, "lru", 12, engine=engine)) == [0, 0, 2]


@pytest.mark.parametrize("engine", ENGINES)
def test_priority_pins_and_weights(engine):
    # capacity 4 blocks of 4 tokens. Tenant A's 8-token system prompt (blocks 0, 1), then a long
    # request of tenant B (its own system prompt 4, 5 and a 3-block tail), then A again.
    rows = [(13, [0, 1, 2, 3]), (21, [4, 5, 6, 7, 8, 9]), (13, [0, 1, 10, 11])]
    t = trace(rows)
    assert hits(kv.simulate(t, "lru", 16, engine=engine)) == [0, 0, 0]  # B pushed A's prompt out
    # pin_tokens pins every prompt's first 8 tokens (both system prompts): B's tail goes instead
    assert hits(kv.simulate(t, "priority", 16, engine=engine, policy_params={"pin_tokens": 8})) == [0, 0, 2]
    # weights from the trace's priority column, or priorities=: request 0 outranks the others
    assert hits(kv.simulate(trace(rows, priority=[5, 0, 0]), "priority", 16, engine=engine)) == [0, 0, 2]
    assert hits(kv.simulate(t, "priority", 16, engine=engine, priorities=[5, 0, 0])) == [0, 0, 2]
    pinned = [kv.policies.PINNED, 0, 0]
    assert hits(kv.simulate(t, "priority", 16, engine=engine, priorities=pinned)) == [0, 0, 2]
    assert hits(kv.simulate(t, "priority", 16, engine=engine)) == [0, 0, 0]  # all 0: plain LRU
    # a block's priority is the highest of the requests that used it: request 1 (priority 0)
    # reuses request 0's blocks without lowering them
    used = [(13, [0, 1, 2, 3]), (13, [0, 1, 2, 4]), (21, [4, 5, 6, 7, 8, 9]), (13, [0, 1, 10, 11])]
    assert hits(kv.simulate(trace(used), "priority", 16, engine=engine, priorities=[5, 0, 1, 0])) == [0, 3, 0, 2]
    with pytest.raises(kv.RequestError, match="2 priorities for 3 requests"):
        kv.simulate(t, "priority", 16, priorities=[1, 2])


def test_sweep_runs_every_policy_and_matches_simulate():
    t = kv.traces.read().head(300)
    caps = [512 * c for c in (0, 50, 400)] + [None]
    for policy in POLICIES:
        frame = kv.sweep(t, policy, caps)
        want = [kv.simulate(t, policy, c).summary["hit_tokens"] for c in caps]
        assert frame["hit_tokens"].to_list() == want, policy
        assert frame["hit_tokens"][-1] == kv.simulate(t, "infinite").summary["hit_tokens"]


def test_a_block_repeated_within_a_request_is_refused():
    with pytest.raises(kv.TraceError, match="request 1 holds block id 3 twice"):
        kv.simulate(trace([(9, [0, 1, 2]), (13, [3, 4, 3, 5])]), "cost_aware", 8)
