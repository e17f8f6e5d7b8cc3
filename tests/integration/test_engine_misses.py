"""Why each missed prompt token missed, in the Engine: one reason per token, summing to
``prompt_tokens - reused_tokens`` for every request in every store, on the tiny and the hybrid
model, with salts, images and evictions; exact reasons on hand-made prompts; and the same
per-request reasons as ``kv.simulate`` for a token-id workload through a PagedStore.

Mutants caught: a reason counted twice or dropped (the sums), ``evicted_by`` off by one request,
divergence reported as new (``diverged_at``), a salt counted as a new prompt, a paged block
evicted but still treated as cached (the simulator comparison), a ``miss`` event per request
instead of per reason."""

import dataclasses

import numpy as np
import polars as pl
import pytest

import kvlab as kv
from kvlab.policies import ALL_REASONS, MISS_REASONS
from kvlab.workloads import Request

pytestmark = pytest.mark.model

RNG = np.random.default_rng(7)
A = tuple(int(x) for x in RNG.integers(100, 5000, 60))
B = tuple(int(x) for x in RNG.integers(100, 5000, 60))
C = A[:30] + tuple(int(x) for x in RNG.integers(100, 5000, 30))  # A's first 30, then its own


def nonzero(result) -> dict:
    return {k: v for k, v in result.miss_reasons.items() if v}


def check_accounting(engine) -> None:
    """Every request: one reason per missed token; the miss rows and the frame say the same."""
    ev = engine.events.filter(pl.col("event") == "miss")
    frame = engine.results_frame()
    for r in engine.results:
        assert list(r.miss_reasons) == list(ALL_REASONS)
        assert sum(r.miss_reasons.values()) == r.prompt_tokens - r.reused_tokens, r
        rows = ev.filter(pl.col("request") == r.request_id).select("detail", "tokens").rows()
        assert rows == [(k, v) for k, v in r.miss_reasons.items() if v]
        if r.evicted_by is not None:
            assert r.miss_reasons["evicted"] > 0 and r.evicted_by < r.request_id
            evictions = engine.events.filter((pl.col("request") == r.evicted_by)
                                             & pl.col("event").is_in(["evict", "block_removed"]))
            assert evictions.height > 0
    assert frame.select(list(ALL_REASONS)).sum_horizontal().to_list() == [
        r.prompt_tokens - r.reused_tokens for r in engine.results]
    totals = engine.stats()["miss_reasons"]
    assert sum(totals.values()) == sum(r.prompt_tokens - r.reused_tokens for r in engine.results)


def workload(model) -> list:
    conv = list(kv.workloads.multi_turn(turns=3))
    other = list(kv.workloads.multi_turn(turns=2, seed=1))
    users = list(kv.workloads.shared_system_prompt(num_users=3, system_tokens=60))
    salted = dataclasses.replace(conv[0], salt="tenant-b")
    return [conv[0], conv[1], users[0], users[1], salted, other[0], conv[2], users[2], other[1],
            conv[0], salted, conv[1]]


def entry_bytes(model, request) -> int:
    e = kv.Engine(model, kv.RadixStore())
    e.run(request, max_tokens=1)
    return int(e.events.filter(pl.col("event") == "insert")["bytes"].max())


STORES = ["radix", "shared-radix", "paged", "system", "mlx-lru", "disk", "tiered", "tiered-paged"]


def make(name, budget, tmp_path, model):
    if name == "tiered-paged":
        return kv.stores.make_store("tiered", budget_bytes=budget, disk_path=tmp_path, model=model,
                                    disk_budget_bytes=3 * budget, ram="paged", block_size=16)
    if name in ("disk", "tiered"):
        return kv.stores.make_store(name, budget_bytes=budget, disk_path=tmp_path, model=model,
                                    disk_budget_bytes=3 * budget)
    return kv.stores.make_store(name, budget_bytes=budget, block_size=16, max_size=2)


@pytest.mark.parametrize("model_name", ["tiny", "tiny-hybrid"])
@pytest.mark.parametrize("store", STORES)
def test_reasons_sum_to_the_missed_tokens_in_every_store(store, model_name, tiny, tiny_hybrid, tmp_path):
    model = tiny if model_name == "tiny" else tiny_hybrid
    requests = workload(model)
    # room for about two of the longest prompts: later requests evict earlier ones
    budget = int(2.2 * entry_bytes(model, requests[6]))
    engine = kv.Engine(model, make(store, budget, tmp_path, model))
    for r in requests:
        engine.run(r, max_tokens=2)
    check_accounting(engine)
    totals = engine.stats()["miss_reasons"]
    assert totals["first_seen"] > 0 and totals["partial_block"] >= len(requests)
    if engine.core.store_refuses:
        # a store that holds none of this model's cache: what it was offered is not_trimmable
        assert totals["not_trimmable"] > 0 and sum(r.reused_tokens for r in engine.results) == 0
    elif store == "paged" and model_name == "tiny-hybrid":
        # the paged store keeps the recurrent state at block ends: it reuses, and whole blocks only
        reused = [r.reused_tokens for r in engine.results]
        assert sum(reused) > 0 and all(n % 16 == 0 for n in reused)
    if store in ("radix", "shared-radix", "paged", "mlx-lru") and model_name == "tiny":
        # the salted repeat finds the same ids under another namespace
        assert engine.results[4].miss_reasons["salt_or_extra_keys"] > 0
        assert totals["evicted"] > 0


# -- exact reasons on hand-made prompts -----------------------------------------------------------

def test_radix_eviction_divergence_and_salt(tiny):
    per = entry_bytes(tiny, list(A))
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=int(per * 1.5)))  # one entry fits
    r = [engine.run(list(x), max_tokens=1) for x in (A, B, A, C, A)]
    assert nonzero(r[0]) == {"first_seen": 59, "partial_block": 1}
    assert nonzero(r[1]) == {"first_seen": 59, "partial_block": 1}
    # B's insertion (request 2) evicted A
    assert nonzero(r[2]) == {"evicted": 59, "partial_block": 1} and r[2].evicted_by == 2
    # C shares A's first 30 tokens (reused), then differs at token 30
    assert r[3].reused_tokens == 30 and nonzero(r[3]) == {"diverged": 29, "partial_block": 1}
    assert r[3].diverged_at == 30 and r[3].evicted_by is None
    # C replaced A (request 4): A reuses the shared 30, the rest was evicted by request 4
    assert r[4].reused_tokens == 30 and nonzero(r[4]) == {"evicted": 29, "partial_block": 1}
    assert r[4].evicted_by == 4
    salted = engine.run(Request(ids=A, salt="bob"), max_tokens=1)
    assert nonzero(salted) == {"salt_or_extra_keys": 59, "partial_block": 1}
    assert engine.run(Request(ids=A, salt="bob"), max_tokens=1).miss_reasons["partial_block"] == 1


def test_paged_block_granularity(tiny):
    engine = kv.Engine(tiny, kv.PagedStore(block_size=8, num_blocks=10))
    r = [engine.run(list(x), max_tokens=1) for x in (A, B, A, C)]
    # 60 tokens: 7 full blocks within the first 59, the last 4 tokens partial
    assert nonzero(r[0]) == {"first_seen": 56, "partial_block": 4}
    # B's 7 blocks evicted 4 of A's (tail first: A keeps its first 3 blocks)
    assert r[2].reused_tokens == 24 and nonzero(r[2]) == {"evicted": 32, "partial_block": 4}
    assert r[2].evicted_by == 2
    # C differs at token 30, inside block 3: the whole block and the rest are diverged
    assert r[3].reused_tokens == 24 and nonzero(r[3]) == {"diverged": 32, "partial_block": 4}
    assert r[3].diverged_at == 30


def test_hybrid_caches_without_a_checkpoint_are_not_trimmable(tiny_hybrid):
    conv = list(kv.workloads.multi_turn(turns=2))
    n = len(kv.tokenise(tiny_hybrid, list(conv[0].messages)).ids)
    plain = kv.Engine(tiny_hybrid, kv.RadixStore(), checkpoints=False)
    plain.run(conv[0], max_tokens=1)
    again = plain.run(conv[0], max_tokens=1)
    # the entry holds all n tokens but cannot drop the last one
    assert again.reused_tokens == 0 and nonzero(again) == {"not_trimmable": n - 1, "partial_block": 1}
    checkpointed = kv.Engine(tiny_hybrid, kv.RadixStore())
    checkpointed.run(conv[0], max_tokens=1)
    assert nonzero(checkpointed.run(conv[0], max_tokens=1)) == {"partial_block": 1}
    # the paged store checkpoints the recurrent state at block ends (the policy's n - 1 moved down
    # to one): the repeat reuses whole blocks (mutant caught: the Engine cutting at n - 1 itself,
    # where the paged store cannot keep a recurrent state -> not_trimmable)
    paged = kv.Engine(tiny_hybrid, kv.PagedStore(block_size=16))
    paged.run(conv[0], max_tokens=1)
    full = (n - 1) // 16 * 16
    repeat = paged.run(conv[0], max_tokens=1)
    assert repeat.reused_tokens == full and nonzero(repeat) == {"partial_block": n - full}


def test_a_request_larger_than_the_store_is_over_capacity(tiny, tmp_path):
    # a disk tier of about two 8-token block files: writing A's 7 blocks pushes out its own first 5
    disk = kv.DiskStore(tmp_path, 27_000, model=tiny, block_size=8)
    engine = kv.Engine(tiny, disk)
    first = engine.run(list(A), max_tokens=1)
    assert disk.entries == 2 and first.evictions == 5
    again = engine.run(list(A), max_tokens=1)
    assert again.reused_tokens == 0 and nonzero(again) == {"over_capacity": 56, "partial_block": 4}
    assert again.evicted_by is None


def test_prompt_output_keying_drift_is_a_divergence(tiny):
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What is 2+2?"}
    reply = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."}
    engine = kv.Engine(tiny, kv.RadixStore(), keying="prompt+output")
    engine.run([system, user, reply], max_tokens=3)
    r2 = engine.run([system, user, reply, {"role": "user", "content": "And 3+3?"}], max_tokens=1)
    assert r2.drift_index == r2.reused_tokens == r2.diverged_at
    assert nonzero(r2) == {"diverged": r2.prompt_tokens - r2.reused_tokens - 1, "partial_block": 1}


def test_result_row_and_html_carry_the_reasons(tiny):
    engine = kv.Engine(tiny, kv.RadixStore())
    r = engine.run(list(A), max_tokens=1)
    row = r.row()
    assert "miss_reasons" not in row and {k: row[k] for k in ALL_REASONS} == r.miss_reasons
    assert row["diverged_at"] is None and row["evicted_by"] is None
    assert "missed: first_seen 59, partial_block 1" in r._repr_html_()
    assert "first_seen 59" in engine._repr_html_()


# -- images ---------------------------------------------------------------------------------------

@pytest.mark.vlm
@pytest.mark.parametrize("store", ["radix", "paged"])
def test_same_ids_other_image_is_salt_or_extra_keys(store):
    pytest.importorskip("mlx_vlm")
    vlm = kv.load_vlm("tiny")
    wl = list(kv.workloads.multimodal_mix(num_requests=4))  # text, image, text, image (same text)
    engine = kv.Engine(vlm, kv.RadixStore() if store == "radix" else kv.PagedStore(block_size=16))
    r = [engine.run(x, max_tokens=1) for x in wl + wl[1:2]]
    check_accounting(engine)
    start = kv.tokenise(vlm, list(wl[3].messages)).images[0].token_start
    block = 1 if store == "radix" else 16
    # request 2 (the first image) parts from request 1's text where its image's tokens begin
    assert r[1].diverged_at is not None and r[1].miss_reasons["diverged"] > 0
    # request 4: identical ids to request 2, another image: from the image on, another namespace
    assert r[3].prompt_ids == r[1].prompt_ids and r[3].reused_tokens == start // block * block
    assert r[3].miss_reasons["salt_or_extra_keys"] == (r[3].prompt_tokens - 1) // block * block - r[3].reused_tokens
    assert r[3].miss_reasons["diverged"] == r[3].miss_reasons["first_seen"] == 0
    # request 2 again: its image's KV is still cached
    assert r[4].miss_reasons["salt_or_extra_keys"] == 0 and sum(nonzero(r[4]).values()) == r[4].prompt_tokens - r[4].reused_tokens


# -- the simulator's reasons, through a real PagedStore ---------------------------------------------

BLOCK = 4


def id_workload(seed=1, n=24):
    rng = np.random.default_rng(seed)
    prefixes = [[int(x) for x in rng.integers(100, 5000, int(rng.integers(8, 24)))] for _ in range(4)]
    out = []
    for _ in range(n):
        p = prefixes[int(rng.integers(0, 4))]
        ids = p[: int(rng.integers(0, len(p) + 1))] + [int(x) for x in rng.integers(100, 5000, int(rng.integers(1, 12)))]
        out.append(Request(ids=tuple(ids), salt="s" if rng.random() < 0.2 else None, max_tokens=1))
    return out


def engine_vs_simulator(tiny, requests, policy, cap):
    engine = kv.Engine(tiny, kv.PagedStore(block_size=BLOCK, num_blocks=cap or 100_000, policy=policy))
    for r in requests:
        engine.run(r, max_tokens=1)
    check_accounting(engine)
    ours = engine.results_frame().select(pl.col("reused_tokens").alias("hit_tokens"), *MISS_REASONS,
                                         (pl.col("evicted_by") - 1).alias("evicted_by"))  # rows, from 0
    sim = kv.simulate(requests, policy, cap * BLOCK if cap else None, BLOCK, engine="python")
    theirs = sim.requests.select("hit_tokens", *MISS_REASONS, "evicted_by")
    return ours, theirs, engine


@pytest.mark.parametrize("cap", [6, 10, 16, None])
def test_paged_engine_reasons_equal_the_simulators_under_lru(tiny, cap):
    requests = id_workload()
    ours, theirs, engine = engine_vs_simulator(tiny, requests, "lru", cap)
    assert ours.equals(theirs)
    assert (engine.stats()["evictions"] > 0) == (cap is not None)
    if cap is not None:
        assert ours["evicted"].sum() > 0 and ours["salt_or_extra_keys"].sum() > 0
        assert ours["diverged"].sum() > 0


def test_paged_engine_and_simulator_differ_in_the_evictor_under_fifo(tiny):
    """The simulator evicts after a request's insertion, from every resident block, so FIFO may
    evict the oldest block the request itself just used; PagedStore evicts while it allocates and
    never a block the running request holds, so it takes another block now and that one a request
    later. Under LRU a request's blocks are always the most recent and the two coincide (above).
    Pinned: on this workload hits and reasons agree; ``evicted_by`` names a later request."""
    requests = id_workload()
    ours, theirs, _ = engine_vs_simulator(tiny, requests, "fifo", 10)
    assert ours.drop("evicted_by").equals(theirs.drop("evicted_by"))
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(ours["evicted_by"].to_list(), theirs["evicted_by"].to_list()))
            if a != b]
    assert diff == [(20, 6, 5), (21, 17, 16)]
