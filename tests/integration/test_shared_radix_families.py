"""SharedRadixStore on hybrid, sliding-window, CacheList, pure recurrent and recurrent + sliding
models, through kv.Engine and kvlab's conformance cells.

Tolerance: cached vs cold logits, max |diff| <= 1e-4 on float32 tiny models (a restored state is
the state a cold prefill computes; only the order of float additions differs when a prefill runs
in two pieces; measured 2e-6 to 2e-5).

Each test names the mutant (broken implementation) it catches; each was checked by breaking the
code by hand.
"""

import random

import pytest

import kvlab as kv
from kvlab.primitives.tolerance import tolerance
from kvlab.experiments.conformance import run_cell
import mlx.core as mx
from kvlab.primitives.cache_parts import parts_of, window_kv
from kvlab.primitives.snapshots import advance, make_cache, snapshot
from kvlab.stores import SharedRadixStore

pytestmark = pytest.mark.model

TOL = tolerance("float32")  # 1e-4: float32 tiny model(s), cached vs cold max |logit difference|
FAMILIES = ["gemma3_text", "qwen3_5", "nemotron_h", "mamba2", "falcon_h1", "recurrent_gemma"]


def ids_of(n, seed, vocab=1000):
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


@pytest.mark.parametrize("workload", ["multi_turn", "branching", "agentic_loop"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_reuses_exactly(model_type, workload):
    # mutants: a window checkpoint kept in ring order, not temporal order (gemma3_text off),
    # no checkpoints kept (a miss on every request: status not "exact")
    cell = run_cell(model_type, "shared-radix", workload)
    assert cell.status == "exact", cell
    assert cell.max_logit_diff <= TOL and cell.reused_tokens > 0


def test_window_checkpoints_hold_the_window_and_count_per_component():
    # mutants: a checkpoint keeping the whole window buffer the snapshot holds (after a 300-token
    # prefill: 300 tokens, not 32), recurrent bytes counted as window
    model = kv.load("tiny:gemma3_text")
    store = SharedRadixStore(budget_bytes=256 << 20)
    engine = kv.Engine(model, store, max_tokens=1, checkpoints="every:100")
    engine.run(ids_of(300, 3))
    parts = parts_of(snapshot(advance(model, ids_of(4, 4), make_cache(model)), model=model))
    windows = [p for p in parts if p.kind == "window"]
    full = [p for p in parts if p.kind == "full"]
    per_token = 2 * 16 * 4  # keys + values of 1 KV head of 16 float32
    c = store.components()
    stored = engine.events.filter(engine.events["event"] == "checkpoint_stored")
    assert sorted(stored["tokens"]) == [100, 200, 300]
    assert c["checkpoints"] == 3 and c["recurrent"] == 0
    assert c["window"] == 3 * len(windows) * 32 * per_token
    assert set(c["window_tokens"].values()) == {3 * 32}
    assert c["full"] == len(full) * 300 * per_token
    assert store.nbytes == c["full"] + c["window"]


def test_window_tokens_are_stored_once_along_a_path():
    # mutants: every checkpoint with its own copy of its window (12 x 32 tokens per layer, not
    # 100), a window joined from its bases one token short or long (lookups below: keys differ)
    model = kv.load("tiny:gemma3_text")
    store = SharedRadixStore(budget_bytes=256 << 20)
    ids = ids_of(100, 9)
    kv.Engine(model, store, max_tokens=1, checkpoints="every:8").run(ids)
    c = store.components()
    assert c["checkpoints"] == 13  # 8, 16, ..., 96 and the prompt's end, 100
    assert set(c["window_tokens"].values()) == {100}
    cold = parts_of(snapshot(advance(model, ids[:99], make_cache(model)), model=model))
    for limit in (40, 99):
        m = store.lookup(kv.keys.CacheKey(tuple(ids)), None, limit=limit)
        at = m.tokens
        assert at == limit // 8 * 8
        for got, want in zip(parts_of(m.snapshot), cold):
            if got.kind != "window":
                continue
            gk, gv, first = window_kv(got.state)
            wk, _, wfirst = window_kv(want.state)
            assert (first, gk.shape[2], int(got.state[2])) == (at - 32, 32, at)
            # KV of a token is the same whichever prefill computed it, to float rounding
            assert mx.abs(gk - wk[..., first - wfirst:at - wfirst, :]).max().item() <= 1e-5


@pytest.mark.parametrize("store", ["shared-radix", "paged"])
def test_inspector_shows_bytes_per_component(store):
    # mutants: the Inspector showing the store's total as full KV, or window and recurrent
    # swapped; a store's checkpoint bytes left out of components()
    pytest.importorskip("ipywidgets")
    model = kv.load("tiny:gemma3_text")
    kv_store = kv.stores.make_store(store, budget_bytes=256 << 20)
    engine = kv.Engine(model, kv_store, max_tokens=1, checkpoints="every:96")
    engine.run(ids_of(300, 3))
    parts = parts_of(snapshot(advance(model, ids_of(4, 4), make_cache(model)), model=model))
    windows, full = (sum(p.kind == k for p in parts) for k in ("window", "full"))
    per_token = 2 * 16 * 4
    # shared-radix: full KV of all 300 tokens, a 32-token window at 96, 192 and 288, and at 300
    # only the 12 tokens after 288 (the rest of its window is the one at 288's);
    # paged: 288 tokens in 18 blocks, checkpoints at 96 and 192 taken mid-prompt and superseded
    # (their windows dropped), the prompt's end at 288 with its two window blocks
    want = {"shared-radix": (300 * full * per_token, (3 * 32 + 12) * windows * per_token, 4),
            "paged": (288 * full * per_token, 32 * windows * per_token, 1)}[store]
    ins = kv.Inspector(engine)
    ins.refresh()
    shown = ins.state()["components"]
    assert (shown["full"], shown["window"], shown["checkpoints"]) == want and shown["recurrent"] == 0
    assert shown["full"] + shown["window"] == kv_store.nbytes
    header = ins.header.value
    assert f"full KV {want[0]:,} B" in header and f"window KV {want[1]:,} B" in header
    assert "recurrent state 0 B" in header and f"{want[2]} checkpoints" in header
    assert f"window KV {want[1]:,} B" in ins._repr_html_()
