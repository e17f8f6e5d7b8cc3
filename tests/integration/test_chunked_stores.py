"""PagedStore and SharedRadixStore on llama4's chunked attention (ChunkedKVCache, chunk 32): held as
a sliding window of the chunk size, restored as the ChunkedKVCache a cold prefill continues from.

Tolerance: cached vs cold logits, max |diff| <= 1e-4 on float32 tiny models (a restored cache is the
cache a cold prefill computes; only the order of float additions differs when a prefill runs in two
pieces; measured 2e-6 to 3e-6).

Each test names the mutant (broken implementation) it catches; each was checked by breaking the
code by hand.
"""

import random

import pytest

import kvlab as kv
from kvlab.primitives.tolerance import tolerance
import mlx.core as mx
from kvlab.keys import CacheKey
from kvlab.primitives.cache_parts import parts_of, window_kv
from kvlab.primitives.snapshots import advance, make_cache, snapshot
from kvlab.primitives.tokens import common_prefix_len
from kvlab.stores import PagedStore, SharedRadixStore
from kvlab.workloads import branching, multi_turn

pytestmark = pytest.mark.model

TOL = tolerance("float32")  # 1e-4: float32 tiny model(s), cached vs cold max |logit difference|
BLOCK = 16
CHUNK = 32
PER_TOKEN = 2 * 2 * 16 * 4  # keys + values of 2 KV heads of 16 float32, per chunked layer
WORKLOADS = {
    "multi_turn": lambda: multi_turn(4, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=4),
    "branching": lambda: branching(3, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=4),
}
STORES = {
    "paged": lambda: PagedStore(BLOCK, budget_bytes=256 << 20),
    "shared-radix": lambda: SharedRadixStore(budget_bytes=256 << 20),
}
# every:16 checkpoints are taken mid-prompt: the paged store drops their windows once a deeper one
# is kept unless told to keep them, and these tests restore at one of them
KEEPING_ALL = {**STORES, "paged": lambda: PagedStore(BLOCK, budget_bytes=256 << 20, keep_superseded_windows=True)}


def ids_of(n, seed, vocab=1000):
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def chunked_parts(model):
    parts = parts_of(snapshot(advance(model, ids_of(4, 4), make_cache(model)), model=model))
    return [p for p in parts if p.kind == "chunked"]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("store", sorted(STORES))
def test_llama4_reuses_exactly(family, store, workload):
    # mutants: the old refusal of chunked layers ("chunked" not in holds: store_refuses set, 0
    # reused); restored with start_position 0 (shared-radix: logits off by 0.23-0.31; the paged
    # hits here land on chunk borders, which read no chunked KV: see the next test)
    model = family("llama4")
    engine = kv.Engine(model, STORES[store](), verify=True, max_tokens=4)
    assert not engine.core.store_refuses
    results = [engine.run(r) for r in WORKLOADS[workload]()]
    assert all(r.verify_diff <= TOL for r in results), [r.verify_diff for r in results]
    assert all(r.reused_tokens > 0 for r in results[1:]), [r.reused_tokens for r in results]


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_hit_inside_a_chunk_is_exact(family, store):
    # the workloads' paged hits land on chunk borders (96, 192, 256), where no chunked KV is read;
    # a hit at 112 = 3 * 32 + 16 reads the 16 tokens of its chunk.
    # mutant: restored with start_position 0 (logits off by 0.33 in both stores)
    model = family("llama4")
    engine = kv.Engine(model, KEEPING_ALL[store](), verify=True, max_tokens=2, checkpoints="every:16")
    a = ids_of(150, 1)
    b = a[:120] + ids_of(40, 2)
    assert b[120] != a[120]
    engine.run(a)
    r = engine.run(b)
    assert r.reused_tokens == 112 and r.verify_diff <= TOL, (r.reused_tokens, r.verify_diff)


def test_paged_chunked_layer_holds_at_most_the_chunk_plus_a_block(family):
    # mutant: chunked KV kept for every block before the checkpoint, not only the chunk's reach
    # (reach() from block 0: 288 tokens per layer, 221184 bytes)
    model = family("llama4")
    store = PagedStore(BLOCK, budget_bytes=256 << 20)
    kv.Engine(model, store, max_tokens=1).run(ids_of(300, 3))
    chunked = chunked_parts(model)
    assert len(chunked) == 3 and {int(p.state[3]) for p in chunked} == {CHUNK}
    c = store.components()
    assert c["window"] == len(chunked) * CHUNK * PER_TOKEN  # [256, 288): two whole blocks
    assert c["window_tokens"] == {p.layer: CHUNK for p in chunked}
    assert all(n <= CHUNK + BLOCK for n in c["window_tokens"].values())


def test_shared_radix_chunked_checkpoints_hold_at_most_the_chunk(family):
    # mutant: a checkpoint keeping all the chunked cache holds after a 100-token prefill in one
    # piece (mlx-lm trims its front only before the next step: 100 tokens, not 32)
    model = family("llama4")
    store = SharedRadixStore(budget_bytes=256 << 20)
    kv.Engine(model, store, max_tokens=1, checkpoints="every:100").run(ids_of(300, 3))
    chunked = chunked_parts(model)
    c = store.components()
    assert c["checkpoints"] >= 2
    assert c["window"] == c["checkpoints"] * len(chunked) * CHUNK * PER_TOKEN  # CHUNK tokens each
    assert c["recurrent"] == 0


@pytest.mark.parametrize("store", sorted(STORES))
def test_restored_chunked_cache_is_the_cold_one(family, store):
    # mutants: restored with start_position 0, or holding only the tokens from its chunk start
    # (256..271: start_position 256). The latter's logits are exact (the chunk mask hides every
    # earlier token), but the cache is not the one mlx-lm has after a cold prefill of 272 tokens
    # ([240, 272) once it trims its front), which is what this store promises to restore.
    model = family("llama4")
    kv_store = KEEPING_ALL[store]()
    ids = ids_of(300, 5)
    kv.Engine(model, kv_store, max_tokens=1, checkpoints="every:16").run(ids)
    m = kv_store.lookup(CacheKey(tuple(ids)), None, limit=272)
    assert m.tokens == 272
    cold = snapshot(advance(model, ids[:299], make_cache(model)), model=model)
    seen = 0
    for got, want in zip(parts_of(m.snapshot), parts_of(cold)):
        if got.kind != "chunked":
            continue
        seen += 1
        assert tuple(got.state[2:]) == (272, CHUNK, 240)  # offset, chunk_size, start_position
        gk, gv, first = window_kv(got.state)
        wk, wv, wfirst = window_kv(want.state)
        assert first == 240 and gk.shape[2] == CHUNK
        assert mx.allclose(gk, wk[..., 240 - wfirst:272 - wfirst, :], rtol=0, atol=1e-5)
        assert mx.allclose(gv, wv[..., 240 - wfirst:272 - wfirst, :], rtol=0, atol=1e-5)
    assert seen == 3



# -- a branch that parts inside the deepest entry: fall back to what can be restored exactly --------
# The issue-31 scenario: four turns, then a branch that edits the third reply. Every store holds
# the turn-4 prompt, whose chunked layers keep only their last chunk, and something shorter.
ALL_STORES = ("radix", "mlx-lru", "disk", "tiered", "shared-radix", "paged")
FALLING_BACK = ("radix", "mlx-lru", "disk", "tiered")  # the stores that keep whole entries


def _store(name, model, folder):
    return kv.make_store(name, disk_path=folder, model=model) if name in ("disk", "tiered") else kv.make_store(name)


def _four_turns_and_a_branch(model, edit):
    """The four turns' messages, then turn 4's with its third reply edited; their prompt ids."""
    turns = [r.messages for r in multi_turn(4, system_tokens=48, user_tokens=24, reply_tokens=32)]
    branch = list(turns[3])
    branch[6] = {"role": "assistant", "content": edit(branch[6]["content"])}  # the third reply
    reqs = [*turns, branch]
    return reqs, [kv.tokenise(model, r).ids for r in reqs]


@pytest.mark.parametrize("name", ALL_STORES)
def test_a_branch_editing_the_third_reply_reuses_the_turn_before(family, name, tmp_path):
    # mutants: radix and mlx-lm's LRU dropping the turn-3 entry as subsumed by turn 4's (which
    # says it can be trimmed, but its chunked layers hold only their last chunk); the disk tier
    # offering the turn-4 file it cannot cut. Before the fix the branch reused 0 ("could not trim
    # the matched entry") in radix, mlx-lru, disk and tiered.
    model = family("llama4")
    reqs, ids = _four_turns_and_a_branch(model, lambda reply: "Alternatively: " + reply)
    assert common_prefix_len(ids[3], ids[4]) == len(ids[2])  # the branch parts where turn 3's prompt ends
    engine = kv.Engine(model, _store(name, model, tmp_path), verify=True, max_tokens=2)
    results = [engine.run(r) for r in reqs]
    whole = (lambda n: n // BLOCK * BLOCK) if name == "paged" else (lambda n: n)  # paged: whole blocks
    assert [r.reused_tokens for r in results] == [0] + [whole(len(i)) for i in ids[:3]] + [whole(len(ids[2]))]
    assert all(r.verify_diff <= TOL for r in results), [r.verify_diff for r in results]


# a wrapped sliding window and a recurrent state cannot be cut back at all: the same fallback
FAMILY_CASES = [("llama4", n) for n in FALLING_BACK] + [(f, n) for f in ("gemma3_text", "qwen3_5")
                                                       for n in ("radix", "mlx-lru")]


@pytest.mark.parametrize("model_type,name", FAMILY_CASES)
def test_a_branch_inside_an_uncuttable_entry_falls_back_and_says_from_what(family, model_type, name,
                                                                          tmp_path):
    # the branch edits the end of the third reply: it shares more than turn 3's prompt with turn
    # 4's entry, which cannot be cut back there (llama4: its chunk starts later). Without
    # checkpoints the store's next best entry is turn 3's prompt. Mutants: no fallback (the
    # store offers turn 4's entry, the core refuses it: 0 reused); turn 3's entry dropped as
    # subsumed by turn 4's.
    model = family(model_type)
    reqs, ids = _four_turns_and_a_branch(model, lambda reply: reply + " And one more thing.")
    shared = common_prefix_len(ids[3], ids[4])
    assert shared > len(ids[2]) and shared // CHUNK * CHUNK < len(ids[3]) - CHUNK
    engine = kv.Engine(model, _store(name, model, tmp_path), verify=True, max_tokens=2, checkpoints="none")
    *_, branch = [engine.run(r) for r in reqs]
    assert branch.reused_tokens == len(ids[2]) and branch.verify_diff <= TOL
    assert branch.why.startswith(f"an entry of {len(ids[3])} tokens shares {shared} with this prompt but its "
                                 f"cache cannot be trimmed to {shared} (layer "), branch.why
    assert branch.why.endswith(f"; fell back to the entry of {len(ids[2])} tokens"), branch.why
    assert branch.miss_reasons["not_trimmable"] == shared - len(ids[2])
