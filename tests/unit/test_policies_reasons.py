"""Why each missed token missed: every reason on hand-made traces with exact token counts, the
reasons summing to the missed tokens for every policy, and the per-capacity view in kv.sweep."""

import pytest
from sim_helpers import trace

import kvlab as kv
from kvlab.policies import MISS_REASONS, POLICIES
from kvlab.workloads import Request, Workload


def reasons(result):
    return [{k: v for k, v in row.items() if v} for row in result.requests.select(MISS_REASONS).iter_rows(named=True)]


ENGINES = ["numba", "python"]


@pytest.mark.parametrize("engine", ENGINES)
def test_first_seen_partial_diverged_and_extensions(engine):
    rows = [(14, [0, 1, 2, 3]),      # 3 full blocks (12 tokens) + 2; hittable (13 // 4) = 3
            (14, [0, 1, 5, 6]),      # shares 0, 1 then differs: block 5 diverged
            (22, [0, 1, 2, 7, 8, 9]),  # extends request 0's three blocks: 7, 8 are new, not diverged
            (9, [10, 11, 12])]       # a new prompt
    r = kv.simulate(trace(rows), engine=engine)
    assert r.requests["hit_tokens"].to_list() == [0, 8, 12, 0]
    assert reasons(r) == [{"first_seen": 12, "partial_block": 2},
                          {"diverged": 4, "partial_block": 2},
                          {"first_seen": 8, "partial_block": 2},
                          {"first_seen": 8, "partial_block": 1}]
    assert r.requests["evicted_by"].null_count() == 4


@pytest.mark.parametrize("engine", ENGINES)
def test_evicted_names_the_request_that_evicted_it(engine):
    # capacity 2 blocks: request 1 evicts request 0's blocks, request 2 wants them back
    rows = [(9, [0, 1, 2]), (9, [3, 4, 5]), (9, [0, 1, 6])]
    r = kv.simulate(trace(rows), "lru", 8, engine=engine)
    assert r.requests["hit_tokens"].to_list() == [0, 0, 0]
    assert reasons(r) == [{"first_seen": 8, "partial_block": 1}, {"first_seen": 8, "partial_block": 1},
                          {"evicted": 8, "partial_block": 1}]
    assert r.requests["evicted_by"].to_list() == [None, None, 1]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_resident_block_behind_a_missing_one_inherits_its_reason(engine):
    # lfu, capacity 2: block 1 is used twice (also out of chain), so block 0 (used once) is the
    # one request 2's new block evicts; request 3 then misses 0 (evicted) and cannot use 1
    rows = [(9, [0, 1, 2]), (9, [7, 1, 3]), (5, [4, 5]), (9, [0, 1, 6])]
    r = kv.simulate(trace(rows), "lfu", 8, engine=engine)
    assert r.requests["hit_tokens"].to_list() == [0, 0, 0, 0]
    last = r.requests.row(3, named=True)
    assert last["evicted"] == 8 and last["partial_block"] == 1  # block 1 resident, but behind 0
    assert last["evicted_by"] is not None


@pytest.mark.parametrize("engine", ENGINES)
def test_over_capacity_is_what_no_cache_this_size_could_hold(engine):
    r = kv.simulate(trace([(25, [0, 1, 2, 3, 4, 5, 6]), (25, [0, 1, 2, 3, 4, 5, 7])]), "lru", 8, engine=engine)
    assert r.requests["hit_tokens"].to_list() == [0, 8]
    assert reasons(r) == [{"first_seen": 8, "over_capacity": 16, "partial_block": 1},
                          {"over_capacity": 16, "partial_block": 1}]


@pytest.mark.parametrize("engine", ENGINES)
def test_salt_or_extra_keys(engine):
    ids = tuple(range(64))
    wl = Workload("salts", (Request(ids=ids, name="a", salt="alice"), Request(ids=ids, name="b", salt="bob"),
                            Request(ids=ids, name="c", salt="alice"),
                            Request(ids=ids[:32] + (9,) * 32, name="d", salt="bob")))
    r = kv.simulate(wl, block_size=16, engine=engine)
    assert r.requests["hit_tokens"].to_list() == [0, 0, 48, 32]
    assert reasons(r) == [{"first_seen": 48, "partial_block": 16}, {"salt_or_extra_keys": 48, "partial_block": 16},
                          {"partial_block": 16}, {"diverged": 16, "partial_block": 16}]


def test_not_trimmable_is_engine_only():
    assert "not_trimmable" not in MISS_REASONS and "not_trimmable" in kv.policies.ALL_REASONS


def test_reasons_sum_to_the_missed_tokens_for_every_policy():
    t = kv.traces.read().head(500)
    for policy in POLICIES:
        for cap in (0, 512 * 30, 512 * 3000):
            r = kv.simulate(t, policy, cap, passes=2)
            f = r.requests
            assert (f.select(MISS_REASONS).sum_horizontal() == f["prompt_tokens"] - f["hit_tokens"]).all()
            assert sum(r.summary["miss_reasons"].values()) == r.summary["prompt_tokens"] - r.summary["hit_tokens"]
        assert r.summary["miss_reasons"]["over_capacity"] == 0  # 3000 blocks hold any one request


def test_sweep_reports_reasons_per_capacity():
    t = kv.traces.read().head(400)
    caps = [512 * c for c in (0, 20, 200)] + [None]
    for policy in ("lru", "arc"):
        f = kv.sweep(t, policy, caps, reasons=True)
        assert f.columns[-6:] == list(MISS_REASONS)
        assert (f.select(MISS_REASONS).sum_horizontal() == f["prompt_tokens"] - f["hit_tokens"]).all()
        assert f["hit_tokens"].to_list() == kv.sweep(t, policy, caps)["hit_tokens"].to_list()
        assert f["evicted"][-1] == 0 and f["over_capacity"][-1] == 0  # unbounded
        assert f["evicted"][0] == 0 and f["over_capacity"][0] > 0     # capacity 0 holds nothing
        assert f["evicted"][1] > 0
