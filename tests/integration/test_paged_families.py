"""PagedStore on hybrid, sliding-window, CacheList and pure recurrent models through kv.Engine
(and the divergence test for SharedRadixStore beside it).

Tolerance: cached vs cold logits, max |diff| <= 1e-4 on float32 tiny models (restored state is the
state a cold prefill computes; only the order of float additions differs when a prefill runs in
two pieces; measured 2e-6 to 2e-5).

Each test names the mutant (broken implementation) it catches; each was checked by breaking the
code by hand.
"""

import random

import pytest

import kvlab as kv
from kvlab.primitives.tolerance import tolerance
import mlx.core as mx
import polars as pl
from kvlab.primitives.cache_parts import parts_of, window_kv
from kvlab.primitives.snapshots import advance, make_cache, snapshot
from kvlab.stores import PagedStore, SharedRadixStore
from kvlab.workloads import branching, multi_turn

pytestmark = pytest.mark.model

TOL = tolerance("float32")  # 1e-4: float32 tiny model(s), cached vs cold max |logit difference|
BLOCK = 16
WORKLOADS = {
    "multi_turn": lambda: multi_turn(4, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=4),
    "branching": lambda: branching(3, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=4),
}


def ids_of(n, seed, vocab=1000):
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_5", "nemotron_h", "mamba2", "falcon_h1"])
def test_every_family_reuses_exactly(model_type, workload):
    # mutants: a restored window without its oldest block (join_window slicing from lo + 1), a
    # checkpoint whose arrays mlx-lm writes into on restore (CacheList lists handed out as stored:
    # the branch's second use of the checkpoint at 96 was off by 0.75), no checkpoints at all (0 reuse)
    model = kv.load(f"tiny:{model_type}")
    engine = kv.Engine(model, PagedStore(BLOCK, budget_bytes=256 << 20), verify=True, max_tokens=4)
    results = [engine.run(r) for r in WORKLOADS[workload]()]
    assert all(r.verify_diff <= TOL for r in results), [r.verify_diff for r in results]
    assert all(r.reused_tokens > 0 for r in results[1:]), [r.reused_tokens for r in results]
    assert all(r.reused_tokens % BLOCK == 0 for r in results)


@pytest.mark.parametrize("store_name", ["paged", "shared-radix"])
@pytest.mark.parametrize("model_type", ["qwen3_5", "mamba2"])
def test_never_restores_past_the_divergence(model_type, store_name):
    # mutants: a paged checkpoint matched by position alone, not by the chained hash of the block
    # it ends; a shared-radix checkpoint looked up by position in the whole tree, not only on the
    # matched path. Either restores the state at 64 of the unrelated prompt cached first: the
    # logits move by far more than TOL (recurrent layers remember their first tokens)
    model = kv.load(f"tiny:{model_type}")
    store = (PagedStore(BLOCK, budget_bytes=256 << 20, checkpoint_every=BLOCK) if store_name == "paged"
             else SharedRadixStore(budget_bytes=256 << 20))
    engine = kv.Engine(model, store, verify=True, max_tokens=2, checkpoints="every:16")
    a = ids_of(100, 1)
    b = a[:70] + ids_of(40, 2)
    assert b[70] != a[70]
    engine.run(ids_of(100, 8))
    engine.run(a)
    r = engine.run(b)
    assert r.reused_tokens == 64 and r.verify_diff <= TOL


def test_sliding_window_holds_at_most_the_window_plus_a_block():
    # mutant: window KV never released (every block of the 300-token prompt kept: 288 tokens)
    model = kv.load("tiny:gemma3_text")
    store = PagedStore(BLOCK, budget_bytes=256 << 20)
    engine = kv.Engine(model, store, max_tokens=1)
    engine.run(ids_of(300, 3))
    parts = parts_of(snapshot(advance(model, ids_of(4, 4), make_cache(model)), model=model))
    windows = [p for p in parts if p.kind == "window"]
    assert {int(p.state[4]) for p in windows} == {32}
    c = store.components()
    # per token and window layer: keys + values of 1 KV head of 16 float32 = 128 bytes
    per_token = 2 * 16 * 4
    assert c["window"] <= len(windows) * (32 + BLOCK) * per_token
    assert c["window"] == len(windows) * 32 * per_token  # [256, 288): two whole blocks
    assert all(n <= 32 + BLOCK for n in c["window_tokens"].values())
    full = [p for p in parts if p.kind == "full"]
    assert c["full"] == len(full) * 288 * per_token
    # bytes per cached token against the dense-equivalent bound (window layers: the window only)
    bound = len(full) * 288 * per_token + len(windows) * 32 * per_token
    assert store.nbytes / bound == 1.0


def test_restored_window_is_the_cold_window():
    # mutant: a window joined in ring order, or one token short (lo off by one)
    model = kv.load("tiny:gemma3_text")
    store = PagedStore(BLOCK, budget_bytes=256 << 20)
    ids = ids_of(300, 5)
    kv.Engine(model, store, max_tokens=1).run(ids)
    m = store.lookup(kv.keys.CacheKey(tuple(ids)), None, limit=299)
    assert m.tokens == 288
    # the KV the store kept came from the engine's prefill of the first 299 tokens in one piece:
    # the same prefill, cold, holds bitwise the same keys and values for tokens 256..287 (a prefill
    # of another length may differ in the last float bit: BLAS tiles batches differently)
    cold = snapshot(advance(model, ids[:299], make_cache(model)), model=model)
    for got, want in zip(parts_of(m.snapshot), parts_of(cold)):
        if got.kind != "window":
            continue
        assert tuple(got.state[2:]) == (288, 0, 32, 32)  # offset, keep, max_size, _idx
        gk, gv, first = window_kv(got.state)
        wk, wv, wfirst = window_kv(want.state)
        assert first == 256 and gk.shape[2] == 32
        assert mx.array_equal(gk, wk[..., 256 - wfirst:288 - wfirst, :]) and mx.array_equal(gv, wv[..., 256 - wfirst:288 - wfirst, :])


def test_recurrent_bytes_per_turn_are_the_checkpoints_states():
    # mutant: checkpoint bytes not counted (recurrent 0), or counted with the blocks' full KV
    model = kv.load("tiny:qwen3_5")
    store = PagedStore(BLOCK, budget_bytes=256 << 20, checkpoint_every=BLOCK)
    engine = kv.Engine(model, store, max_tokens=1)
    a = ids_of(100, 6)
    engine.run(a)
    state = sum(layer.nbytes for layer in snapshot(advance(model, a[:16], make_cache(model)), model=model).layers
                if layer.kind == "ArraysCache")
    assert state == 2 * 5632
    assert store.components()["recurrent"] == 6 * state  # block ends 16..96
    engine.run(a + ids_of(40, 7))  # 140 tokens: new block ends 112, 128
    c = store.components()
    assert c["recurrent"] == 8 * state and c["checkpoints"] == 8
    per_turn = (engine.events.filter(pl.col("event") == "checkpoint_stored")
                .group_by("request").agg(pl.col("bytes").sum()).sort("request"))
    assert per_turn["bytes"].to_list() == [6 * state, 2 * state]


def test_superseded_windows_released_by_default_one_window_per_prompt():
    # mutants: the option ignored or True by default (9 checkpoints kept); prompt ends superseded
    # too (1 checkpoint: a branch off an earlier turn finds no window, branching reuse 1600 not
    # 2464); the new checkpoint dropped instead of the superseded ones (the next turn finds no
    # window: reuse falls); a checkpoint on another path dropped (branching reuse falls)
    model = kv.load("tiny:gemma3_text")
    sizes = dict(system_tokens=256, user_tokens=64, reply_tokens=128, max_tokens=1)
    reused = {}
    for keep in (True, False):
        store = PagedStore(BLOCK, keep_superseded_windows=True) if keep else PagedStore(BLOCK)
        engine = kv.Engine(model, store, verify=True, max_tokens=1)
        chat = [engine.run(r) for r in multi_turn(4, **sizes)]
        assert all(r.verify_diff <= TOL for r in chat)
        c = store.components()
        reused[keep] = [r.reused_tokens for r in chat]
        if not keep:  # one checkpoint (and one 32-token window per layer) per turn's prompt end
            assert c["checkpoints"] == 4 and set(c["window_tokens"].values()) == {4 * 32}
            released = engine.events.filter(pl.col("event") == "checkpoint_removed")["detail"].to_list()
            assert released and all(d.startswith("superseded by the checkpoint at ") for d in released)
        else:
            assert c["checkpoints"] == 9
    assert reused[True] == reused[False] == [0, 336, 528, 736]
    for keep in (True, False):
        engine = kv.Engine(model, PagedStore(BLOCK, keep_superseded_windows=keep), verify=True, max_tokens=1)
        results = [engine.run(r) for r in branching(3, **sizes)]
        assert all(r.verify_diff <= TOL for r in results)
        assert [r.reused_tokens for r in results] == [0, 336, 528, 336, 528, 736]
