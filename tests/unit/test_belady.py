"""belady, the offline optimum under the simulator's semantics: equal to an exhaustive search on
small traces, never beaten by any policy on traces from the workload generators, and the
counterexample that shaped its definition (a next use that cannot hit re-inserts for free)."""

import functools
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sim_helpers import chained_traces, trace

import kvlab as kv
from kvlab.policies import ONLINE
from kvlab.sim.dispatch import run_kernel, sweep_kernel
from kvlab.sim.prepare import prepare_replay
from kvlab.sim.reference import run_python
from kvlab.sim.simulator import one_pass

SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def optimum(rep, cap) -> int:
    """Most hit blocks any eviction choice gets: try every kept set after every request."""
    flat = rep.flat.tolist()
    reqs = [flat[rep.offsets[r]:rep.offsets[r + 1]] for r in range(len(rep.tokens))]

    @functools.lru_cache(None)
    def best(r, state):
        if r == len(reqs):
            return 0
        ids, k = reqs[r], 0
        while k < rep.hittable[r] and ids[k] in state:
            k += 1
        pool = state | frozenset(ids[:rep.inserted[r]])
        if len(pool) <= cap:  # keeping more never hurts: any later choice stays open
            return k + best(r + 1, pool)
        return k + max(best(r + 1, frozenset(c)) for c in itertools.combinations(sorted(pool), cap))

    return best(0, frozenset())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_traces(block_sizes=(1,), max_requests=7, max_blocks=5), st.integers(0, 4))
def test_belady_equals_exhaustive_search(t, cap):
    rep = prepare_replay(t, None, 1, None)
    best = optimum(rep, cap)
    assert int(run_python(rep, "belady", cap).hits.sum()) == best
    assert int(run_kernel(rep, "belady", cap).hits.sum()) == best


def test_a_next_use_that_cannot_hit_counts_as_never():
    # Found by the exhaustive search against "farthest next hittable use" taken literally.
    # Block 4 is next used by request 3, whose single token is never hittable (the last token is
    # always computed): that use re-inserts it for free, so keeping it until then is worthless.
    # Ranking it by its hittable use at request 4 keeps it over block 2 and loses a hit.
    t = trace([(4, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (3, [0, 1, 2]), (1, [4]), (4, [4, 5, 6, 12])], 1)
    rep = prepare_replay(t, None, 1, None)
    assert optimum(rep, 3) == 4
    r = kv.simulate(t, "belady", capacity_tokens=3)
    assert r.requests["hit_blocks"].to_list() == [0, 0, 2, 0, 2]
    assert r.summary["hit_blocks"] == 4


# --- no policy beats it --------------------------------------------------------------------


@st.composite
def workload_traces(draw):
    """A trace from the workload generators: prefix_repetition's shared prefixes, or random
    conversations / branching prompts through kv.traces.from_requests."""
    kind = draw(st.sampled_from(["prefix_repetition", "branching"]))
    if kind == "prefix_repetition":
        try:
            wl = kv.workloads.prefix_repetition(
                prefix_len=draw(st.integers(8, 64)), suffix_len=draw(st.integers(1, 48)),
                num_prompts=draw(st.integers(2, 24)), num_prefixes=draw(st.integers(1, 4)),
                seed=draw(st.integers(0, 2**16)), vocab_size=50)
        except kv.RequestError:
            assume(False)
        assume(wl is not None)
        return wl, 8
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    seqs = []
    for _ in range(draw(st.integers(2, 30))):
        base = list(seqs[rng.integers(len(seqs))]) if seqs and rng.random() < 0.7 else []
        base = base[: rng.integers(0, len(base) + 1)]
        seqs.append(base + rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist())
    return kv.traces.from_requests(seqs, 1, block_size=4), None


@SLOW
@given(st.data())
def test_no_policy_beats_belady(data):
    source, bs = data.draw(workload_traces())
    passes = data.draw(st.integers(1, 2))
    rep = prepare_replay(source, bs, passes, None)
    caps = sorted(set(data.draw(st.lists(st.integers(0, max(1, rep.n_blocks)), min_size=1, max_size=5))))
    caps_tokens = [c * rep.block_size for c in caps] + [None]
    for policy in ONLINE:
        frame = kv.sweep(source, policy, caps_tokens, bs, passes=passes)
        assert (frame["hit_tokens"] <= frame["belady_hit_tokens"]).all(), policy
        assert (frame["gap_to_belady"] >= 0).all()
    best = kv.sweep(source, "belady", caps_tokens, bs, passes=passes)["hit_tokens"].to_list()
    assert best == sorted(best)  # the optimum never falls as capacity grows


def test_no_policy_beats_belady_on_chat_workloads(qwen_tokenizer):
    wls = [kv.workloads.multi_turn(turns=5), kv.workloads.agentic_loop(turns=4, system_tokens=200),
           kv.workloads.shared_system_prompt(num_users=6, system_tokens=200)]
    for wl in wls:
        caps = [16 * c for c in (0, 4, 16, 40, 80)]
        for policy in ONLINE:
            frame = kv.sweep(wl, policy, caps, 16, tokenizer=qwen_tokenizer, passes=2)
            assert (frame["hit_tokens"] <= frame["belady_hit_tokens"]).all(), (wl.name, policy)
    # a growing conversation: LRU keeps exactly what the optimum keeps (the conversation's head)
    chat = kv.sweep(wls[0], "lru", [16 * 8, 16 * 24], 16, tokenizer=qwen_tokenizer, passes=2)
    assert chat["hit_tokens"].to_list() == chat["belady_hit_tokens"].to_list()
    # an agent loop larger than the cache: LRU evicts every block before its reuse, the optimum
    # keeps some; the ceiling shows how much a policy could still win
    agent = kv.sweep(wls[1], "lru", [16 * 24, 16 * 40], 16, tokenizer=qwen_tokenizer, passes=2)
    assert (agent["belady_hit_tokens"] >= 2 * agent["hit_tokens"]).all()


def test_sweep_reports_the_ceiling_and_belady_equals_it():
    t = kv.traces.read().head(400)
    caps = [512 * c for c in (10, 100, 1000)] + [None]
    lru = kv.sweep(t, "lru", caps)
    best = kv.sweep(t, "belady", caps)
    assert lru.columns[:5] == ["capacity_tokens", "token_hit_rate", "request_hit_rate", "hit_tokens",
                               "prompt_tokens"]
    assert lru["belady_hit_tokens"].to_list() == best["hit_tokens"].to_list() == best["belady_hit_tokens"].to_list()
    assert lru["gap_to_belady"].to_list() == pytest.approx(
        (lru["belady_token_hit_rate"] - lru["token_hit_rate"]).to_list())
    assert lru["hit_tokens"][-1] == best["hit_tokens"][-1]  # unbounded: nothing to choose
    assert (lru["gap_to_belady"][:3] > 0).all()


# --- the ceiling in one pass ---------------------------------------------------------------


@st.composite
def reuse_traces(draw):
    """Up to 40 requests of 1-12 blocks of 2 tokens (some ending inside a block), their ids from a
    small alphabet: a block recurs at other depths and in other company than the chained hashes
    of real traces allow, so belady's ties (depth, then age) decide evictions."""
    rows = []
    for _ in range(draw(st.integers(1, 40))):
        ids = draw(st.lists(st.integers(0, 15), min_size=1, max_size=12, unique=True))
        if rows and draw(st.booleans()):  # reuse an earlier request's head
            head = rows[draw(st.integers(0, len(rows) - 1))][1]
            ids = head[: draw(st.integers(0, len(head)))] + [i for i in ids if i not in head]
            ids = ids or head[:1]
        tokens = 2 * len(ids) - draw(st.integers(0, 1))
        rows.append((max(1, tokens), ids))
    return trace(rows, block_size=2)


def assert_one_pass_is_belady_at_each_capacity(rep, caps):
    one = one_pass(rep, "belady", caps)
    per = sweep_kernel(rep, "belady", caps)
    assert one.shape == per.shape == (len(rep.tokens), len(caps))
    assert np.array_equal(one, per), np.argwhere(one != per)[:5].tolist()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reuse_traces(), st.lists(st.one_of(st.none(), st.integers(0, 24)), min_size=1, max_size=6),
       st.integers(1, 2))
def test_the_one_pass_ceiling_is_belady_replayed_at_each_capacity(t, caps, passes):
    rep = prepare_replay(t, None, passes, None)
    assert_one_pass_is_belady_at_each_capacity(rep, caps)
    for c in caps[:2]:  # and the plain-Python definition, request by request
        got = one_pass(rep, "belady", [c])[:, 0]
        assert got.tolist() == run_python(rep, "belady", c, reasons=False).hits.tolist()
    frame = kv.sweep(t, "lru", [None if c is None else 2 * c for c in caps], passes=passes)
    assert frame["belady_hit_tokens"].to_list() == [2 * int(x) for x in sweep_kernel(rep, "belady", caps).sum(axis=0)]


@SLOW
@given(st.data())
def test_the_one_pass_ceiling_on_workload_traces(data):
    source, bs = data.draw(workload_traces())
    rep = prepare_replay(source, bs, data.draw(st.integers(1, 3)), None)
    caps = data.draw(st.lists(st.one_of(st.none(), st.integers(0, max(1, rep.n_blocks))), min_size=1, max_size=8))
    assert_one_pass_is_belady_at_each_capacity(rep, caps)


def test_the_one_pass_ceiling_on_the_mooncake_trace():
    for passes in (1, 2):
        rep = prepare_replay(kv.traces.read(), None, passes, None)
        caps = [int(c) for c in np.geomspace(8, rep.n_blocks, 15)] + [None]
        assert_one_pass_is_belady_at_each_capacity(rep, caps)


def test_stores_refuse_the_offline_optimum():
    with pytest.raises(kv.KvlabError, match="offline"):
        kv.RadixStore(budget_bytes=1 << 20, policy="belady")
    with pytest.raises(kv.KvlabError, match="offline"):
        kv.PagedStore(block_size=4, num_blocks=8, policy="belady")
