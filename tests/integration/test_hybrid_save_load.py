"""Save/load of a hybrid model's snapshot (tiny-hybrid: lfm2, conv ArraysCache and attention
KVCache layers alternating) gives a cache that continues exactly like a cold prefill.

TOL: float32 tiny model; measured differences are ~1e-6 (the prompt is split into two forward
passes). Mutant caught: a save/load that loses the recurrent (conv) state, which the test shows
moves the logits by far more than TOL.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

import kvlab as kv

pytestmark = pytest.mark.model

TOL = 1e-4
MESSAGES = [{"role": "system", "content": "You are a careful assistant. Keep answers short."},
            {"role": "user", "content": "Which is larger, 7 squared or 50? Explain briefly."}]


@pytest.fixture(scope="module")
def hybrid():
    return kv.load("tiny-hybrid")


def arrays(layer):
    return [a for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)]


def test_hybrid_snapshot_round_trips_and_continues_like_cold(hybrid, tmp_path):
    full = kv.tokenise(hybrid, MESSAGES)
    split = kv.split_at_boundary(full, at="system")
    assert split.clean and 0 < len(split.prefix_ids) < len(full.ids)
    cold, _ = kv.prefill(hybrid, full.ids)
    _, cache = kv.prefill(hybrid, split.prefix_ids)
    snap = kv.snapshot(cache, tokens=split.prefix_ids, model=hybrid)
    assert snap.kinds == ("ArraysCache", "KVCache", "ArraysCache", "KVCache") and not snap.trimmable

    path = kv.save(snap, tmp_path / "hybrid.safetensors")
    back = kv.load_snapshot(path, hybrid)
    assert (back.kinds, back.offset, back.token_ids, back.nbytes, back.fingerprint) == (
        snap.kinds, snap.offset, tuple(split.prefix_ids), snap.nbytes, hybrid.fingerprint)
    for a, b in zip(snap.layers, back.layers):
        assert len(arrays(a)) == len(arrays(b)) > 0
        assert all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(arrays(a), arrays(b)))

    warm, _ = kv.prefill(hybrid, split.suffix_ids, kv.restore(back))
    assert float(mx.abs(cold - warm).max().item()) < TOL
    kept, _ = kv.prefill(hybrid, split.suffix_ids, kv.restore(kv.compact(back)))  # what a store keeps
    assert float(mx.abs(cold - kept).max().item()) < TOL

    # the recurrent state carries the prefix: losing it (a save that dropped it) is far off
    lost = kv.restore(back)
    for c in lost:
        if isinstance(c, ArraysCache):
            c.cache = [mx.zeros_like(a) for a in c.cache]
    wrong, _ = kv.prefill(hybrid, split.suffix_ids, lost)
    assert float(mx.abs(cold - wrong).max().item()) > 100 * TOL
