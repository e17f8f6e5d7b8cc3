"""KeptKVCache without a model: the position-preserving cache a press leaves, filled with random KV.

Invariants and the broken implementation each one catches (each mutant was run and fails here):
- the RoPE offset is the true length and grows by what is appended, the rows by the same (mutant:
  offset set to the kept row count);
- make_mask counts rows, not the offset: an array mask is [N, rows + N] (mutant: offset);
- no ``merge`` (mutant: subclassing KVCache, whose merge lets mlx-lm's batching server swap in a
  plain BatchKVCache and drop the positions);
- trim drops only appended rows, never exposes a stale row, and refuses below the compression
  point (mutants: trim moving the offset below the boundary; keys_and_values sliced by the buffer);
- state round-trips through from_state, snapshot/restore and save/load, kept positions included
  (mutant: positions left out of the state);
- rows a head does not use are hidden from its own query heads only (mutant: mx.tile);
- a compressed snapshot cannot be cut below its boundary (kvlab.primitives.layout.refusal).
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

from types import SimpleNamespace

import mlx.core as mx
import pytest

from kvlab.errors import NotTrimmableError, QuantizationError, SnapshotError
from kvlab.primitives.kept_cache import KeptKVCache, QuantizedKeptKVCache
from kvlab.primitives.kv_format import kv_format
from kvlab.primitives.layout import CacheLayout, refusal
from kvlab.primitives.snapshot_files import load_snapshot, save
from kvlab.primitives.snapshots import restore, snapshot, trim
from kvlab.presses.base import ascending

H, D, T = 2, 8, 10


def kept_cache(kept=((0, 3, 7, 9), (1, 2, 8, 9)), offset=T, seed=0) -> KeptKVCache:
    mx.random.seed(seed)
    kept = mx.array(kept, dtype=mx.int32)
    n = kept.shape[1]
    return KeptKVCache(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)), kept, offset)


def test_offset_is_the_true_length_and_rows_are_what_it_holds():
    c = kept_cache()
    assert (c.offset, c.rows, c.boundary) == (T, 4, T)
    k, v = c.update_and_fetch(mx.ones((1, H, 3, D)), mx.ones((1, H, 3, D)))
    assert (c.offset, c.rows, k.shape[2]) == (T + 3, 7, 7)
    assert c.positions().tolist() == [[0, 3, 7, 9, 10, 11, 12], [1, 2, 8, 9, 10, 11, 12]]
    assert c.size() == T + 3 and c.kept_positions().tolist() == [[0, 3, 7, 9], [1, 2, 8, 9]]


def test_masks_count_rows_not_the_offset():
    c = kept_cache()
    assert c.make_mask(1) is None
    assert c.make_mask(5) == "causal"
    mask = c.make_mask(5, return_array=True)
    assert mask.shape == (5, 4 + 5)
    assert mask[0].tolist() == [True] * 5 + [False] * 4  # all kept rows, then its own row
    with pytest.raises(ValueError, match="no window"):
        c.make_mask(5, window_size=4)


def test_no_merge_so_a_batching_server_cannot_replace_it():
    assert not hasattr(KeptKVCache, "merge") and not hasattr(QuantizedKeptKVCache, "merge")


def test_trim_drops_appended_rows_only_and_never_a_stale_one():
    c = kept_cache()
    assert not c.is_trimmable()
    c.update_and_fetch(mx.full((1, H, 3, D), 7.0), mx.full((1, H, 3, D), 7.0))
    assert c.is_trimmable()
    assert c.trim(2) == 2 and (c.offset, c.rows) == (T + 1, 5)
    k, _ = c.update_and_fetch(mx.full((1, H, 1, D), 9.0), mx.full((1, H, 1, D), 9.0))
    assert k.shape[2] == 6 and k[0, 0, 4, 0].item() == 7.0 and k[0, 0, 5, 0].item() == 9.0
    with pytest.raises(NotTrimmableError, match="compressed cache of 10 tokens"):
        c.trim(3)
    assert (c.offset, c.rows) == (T + 2, 6)  # a refused trim changes nothing


def test_state_round_trips_through_from_state_snapshot_restore_and_files(tmp_path):
    c = kept_cache()
    c.update_and_fetch(mx.ones((1, H, 2, D)), mx.ones((1, H, 2, D)))
    back = KeptKVCache.from_state(c.state)
    assert (back.offset, back.boundary, back.rows) == (c.offset, c.boundary, c.rows)
    assert mx.array_equal(back.keys_and_values()[0], c.keys_and_values()[0])
    snap = snapshot([c], model=SimpleNamespace(fingerprint="f" * 64))
    assert snap.offset == T + 2 and snap.layers[0].kind == "KeptKVCache" and kv_format(snap) == "float32"
    path = save(snap, tmp_path / "kept.safetensors", model=SimpleNamespace(fingerprint="f" * 64, dtype="float32"))
    loaded = load_snapshot(path, SimpleNamespace(fingerprint="f" * 64, dtype="float32"))
    for s in (snap, loaded):
        live = restore(s)[0]
        assert isinstance(live, KeptKVCache)
        assert live.kept.tolist() == c.kept.tolist() and (live.offset, live.boundary) == (T + 2, T)
        assert mx.array_equal(live.keys_and_values()[1], c.keys_and_values()[1])
    # the snapshot's views do not change when the live cache is trimmed and appended to
    before = snap.layers[0].state[0][0, 0, -1].tolist()
    c.trim(1)
    c.update_and_fetch(mx.full((1, H, 1, D), 5.0), mx.full((1, H, 1, D), 5.0))
    assert snap.layers[0].state[0][0, 0, -1].tolist() == before


def test_a_compressed_snapshot_is_cut_only_back_to_its_boundary():
    c = kept_cache()
    c.update_and_fetch(mx.ones((1, H, 3, D)), mx.ones((1, H, 3, D)))
    snap = snapshot([c])
    assert trim(snap, 3).offset == T
    with pytest.raises(NotTrimmableError, match="whole-context hit"):
        trim(snap, 4)
    assert refusal("KeptKVCache", snap.layers[0].state, T) is None
    assert "compressed cache of 10 tokens" in refusal("KeptKVCache", snap.layers[0].state, T - 1)
    assert CacheLayout.of([c]).kinds == ("compressed",)


def test_unused_rows_are_hidden_from_their_own_query_heads_only():
    c = kept_cache(kept=((0, 4, 6, -1), (1, 2, 3, 5)))
    q = mx.zeros((1, 2 * H, 1, D))  # 2 query heads per KV head
    c.update_and_fetch(mx.ones((1, H, 1, D)), mx.ones((1, H, 1, D)))
    mask = c.attention_mask(None, q)
    assert mask.shape == (1, 4, 1, 5)
    assert mask[0, :, 0].tolist() == [[True, True, True, False, True]] * 2 + [[True] * 5] * 2
    c2 = kept_cache(kept=((0, 4, 6, -1), (1, 2, 3, 5)))
    c2.update_and_fetch(mx.ones((1, H, 2, D)), mx.ones((1, H, 2, D)))
    causal = c2.attention_mask("causal", mx.zeros((1, 2 * H, 2, D)))
    assert causal[0, 0].tolist() == [[True, True, True, False, True, False], [True, True, True, False, True, True]]
    assert causal[0, 2].tolist() == [[True] * 5 + [False], [True] * 6]
    assert kept_cache().attention_mask("causal", q) == "causal"  # no unused rows: the mask as it was
    with pytest.raises(QuantizationError, match="adakv"):
        c.to_quantized(group_size=32, bits=4)


def test_quantized_after_compression_keeps_positions_and_quantizes_new_rows():
    mx.random.seed(1)
    kept = mx.array([[0, 3, 7, 9], [1, 2, 8, 9]], dtype=mx.int32)
    c = KeptKVCache(mx.random.normal((1, H, 4, 64)), mx.random.normal((1, H, 4, 64)), kept, T)
    q = c.to_quantized(group_size=64, bits=4)
    assert isinstance(q, QuantizedKeptKVCache) and (q.offset, q.rows, q.bits, q.group_size) == (T, 4, 4, 64)
    k, _ = q.update_and_fetch(mx.ones((1, H, 2, 64)), mx.ones((1, H, 2, 64)))
    assert k[0].shape[2] == 6 and q.offset == T + 2
    snap = snapshot([q])
    assert kv_format(snap) == "q4g64" and restore(snap)[0].kept.tolist() == kept.tolist()


def test_reported_positions_are_ascending_with_unused_rows_last():
    assert ascending(mx.array([[3, -1, 1, 2], [-1, 0, -1, 5]])).tolist() == [[1, 2, 3], [0, 5, -1]]


def test_an_unknown_cache_class_in_a_snapshot_is_refused():
    from kvlab.primitives.snapshots import LayerState, Snapshot

    with pytest.raises(SnapshotError, match="unknown mlx-lm cache class"):
        restore(Snapshot((LayerState("NoSuchCache", (), 0, 0),), 0))
