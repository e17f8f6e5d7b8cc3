"""Quantized KV caches without a model: mlx-lm's real QuantizedKVCache filled with random KV.

Invariants and the broken implementation each one catches:
- a snapshot holds the valid tokens only, in views that do not alias the live buffer (mutant: keep
  ``c.keys``/``c.values`` as they are -> nbytes counts the 256-token buffer, and the snapshot
  changes under trim-then-append);
- nbytes equals the formula from bits, group size and head dims (mutant: scale bytes 2 instead of
  the dtype's 4);
- trim, save/load and restore keep the packed words, scales and biases bit for bit;
- the file's digest covers its metadata (mutant: digest over arrays only -> a file edited to claim
  8-bit KV loads and restores garbage);
- PagedStore cuts quantized layers into blocks and gathers them back exactly, quantizing float
  blocks cached below quantized_kv_start (mutant: concatenate without requantizing -> error).
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

import kvlab as kv
from kvlab.errors import QuantizationError, SnapshotError
from kvlab.keys import CacheKey
from kvlab.primitives.kv_format import (check_reusable, check_settings, kv_format, maybe_quantize, parse_format,
                             quantized_bytes_per_token)
from kvlab.primitives.tokens import from_ids

HEADS, DIM, LAYERS = 2, 64, 3
TOKS = from_ids([0])


def float_cache(n: int, seed: int = 0, layers: int = LAYERS) -> list:
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, HEADS, n, DIM)), mx.random.normal((1, HEADS, n, DIM)))
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def quant_cache(n: int, bits: int = 4, group: int = 64, seed: int = 0) -> list:
    return maybe_quantize(float_cache(n, seed), bits, group, 0)


def arrays(snap):
    return [a for layer in snap.layers for part in layer.state[:2] for a in part]


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_snapshot_counts_valid_tokens_by_the_formula(bits, group):
    cache = quant_cache(40, bits, group)
    assert all(type(c) is QuantizedKVCache and c.keys[0].shape[2] == 256 for c in cache)  # preallocated
    snap = kv.snapshot(cache)
    per_token = quantized_bytes_per_token(bits, group, head_dim=DIM, kv_heads=HEADS, layers=LAYERS)
    assert per_token == LAYERS * 2 * HEADS * (DIM * bits // 32 * 4 + 2 * (DIM // group) * 4)
    assert snap.nbytes == 40 * per_token
    assert all(a.shape[2] == 40 for a in arrays(snap))
    assert kv_format(snap) == kv_format(cache) == f"q{bits}g{group}" and snap.kinds == ("QuantizedKVCache",) * 3


def test_snapshot_does_not_alias_the_live_quantized_buffer():
    cache = quant_cache(40)
    snap = kv.snapshot(cache)
    before = [mx.array(a) for a in arrays(snap)]  # real copies
    for c in cache:  # an engine's next request: trim to a shared prefix, append other tokens
        c.trim(8)
        c.update_and_fetch(mx.ones((1, HEADS, 8, DIM)) * 7, mx.ones((1, HEADS, 8, DIM)) * 7)
    mx.eval([c.state for c in cache])
    assert same(arrays(snap), before)
    live = [a[..., 32:40, :] for c in cache for part in (c.keys, c.values) for a in part]
    assert not same(live, [a[..., 32:40, :] for a in before])  # the live cache did change


def test_restore_trim_and_continue_are_exact():
    cache = quant_cache(48)
    snap = kv.snapshot(cache, tokens=list(range(48)))
    restored = kv.restore(snap)
    assert [type(c) for c in restored] == [QuantizedKVCache] * LAYERS
    assert all(c.offset == 48 and (c.group_size, c.bits) == (64, 4) for c in restored)
    assert same(arrays(kv.snapshot(restored)), arrays(snap))
    short = kv.trim(snap, 16)
    assert short.offset == 32 and short.token_ids == tuple(range(32)) and short.nbytes == snap.nbytes * 2 // 3
    assert same(arrays(short), [a[..., :32, :] for a in arrays(snap)])
    # appending to a restored cache quantizes the new tokens and leaves the snapshot alone
    new = mx.random.normal((1, HEADS, 5, DIM))
    for c in restored:
        c.update_and_fetch(new, new)
    assert kv.snapshot(restored).offset == 53 and same(arrays(kv.snapshot(cache)), arrays(snap))
    empty = kv.snapshot([QuantizedKVCache(64, 4)])
    assert empty.offset == 0 and empty.nbytes == 0 and type(kv.restore(empty)[0]) is QuantizedKVCache


def test_save_load_round_trip_and_format_checks(tmp_path):
    snap = kv.snapshot(quant_cache(40, 3, 32), tokens=list(range(40)), model=None)
    snap = type(snap)(snap.layers, snap.offset, snap.token_ids, "fp")
    model = type("M", (), {"fingerprint": "fp"})()
    path = kv.save(snap, tmp_path / "q.safetensors")
    back = kv.load_snapshot(path, model, kv_format="q3g32")
    assert back.offset == 40 and back.nbytes == snap.nbytes and same(arrays(back), arrays(snap))
    assert [(layer.state[3], layer.state[4]) for layer in back.layers] == [(32, 3)] * LAYERS
    arrays_, meta = mx.load(str(path), return_metadata=True)
    assert meta["kv_format"] == "q3g32" and meta["kvlab_format"] == "2"
    assert len(arrays_) == LAYERS * 6  # packed words, scales and biases of keys and values, as they are
    with pytest.raises(SnapshotError, match="holds q3g32 KV, not the float32 asked for"):
        kv.load_snapshot(path, model, kv_format="float32")
    fsnap = kv.snapshot(float_cache(40))
    fpath = kv.save(type(fsnap)(fsnap.layers, 40, None, "fp"), tmp_path / "f.safetensors")
    assert kv_format(kv.load_snapshot(fpath, model)) == "float32"
    with pytest.raises(SnapshotError, match="holds float32 KV, not the q3g32"):
        kv.load_snapshot(fpath, model, kv_format="q3g32")
    # metadata edited to call 3-bit KV 8-bit: the digest covers the metadata, so it fails to load
    layers = json.loads(meta["layers"])
    for layer in layers:
        layer["scalars"]["4"] = 8
    meta = {**meta, "layers": json.dumps(layers), "kv_format": "q8g32"}
    mx.save_safetensors(str(tmp_path / "edited.safetensors"), arrays_, meta)
    with pytest.raises(SnapshotError, match="is corrupt"):
        kv.load_snapshot(tmp_path / "edited.safetensors", model)


def test_maybe_quantize_has_mlx_lms_meaning():
    cache = float_cache(20)
    assert maybe_quantize(cache, None, 64, 0) is cache and type(cache[0]) is KVCache  # kv_bits=None: no-op
    maybe_quantize(cache, 4, 64, 21)
    assert type(cache[0]) is KVCache                                                   # offset 20 < 21
    maybe_quantize(cache, 4, 64, 20)
    assert [type(c) for c in cache] == [QuantizedKVCache] * LAYERS                     # offset >= start
    mixed = [ArraysCache(1), *float_cache(4, layers=1)]
    maybe_quantize(mixed, 8, 32, 0)
    assert [type(c) for c in mixed] == [ArraysCache, QuantizedKVCache]                 # SSM state stays


def test_settings_errors_are_kvlab_errors():
    check_settings(4, 64, (64,))
    with pytest.raises(QuantizationError, match=r"kv_group_size 128 does not divide the head dimension 64.*\(32, 64\)"):
        check_settings(4, 128, (64,))
    with pytest.raises(QuantizationError, match="No group size mlx supports divides it"):
        check_settings(4, 32, (16,))
    with pytest.raises(QuantizationError, match="kv_bits must be one of"):
        check_settings(7, 64)
    with pytest.raises(QuantizationError, match="kv_group_size must be one of"):
        check_settings(4, 16)
    with pytest.raises(QuantizationError, match="does not divide the head dimension 16"):
        maybe_quantize(float_cache(4, layers=1) + [_dim16()], 4, 32, 0)
    assert parse_format("q4g64") == (4, 64) and parse_format("float32") is None


def _dim16():
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 4, 16)), mx.zeros((1, 1, 4, 16)))
    return c


def test_reuse_check_refuses_other_formats():
    q4, f = kv.snapshot(quant_cache(30)), kv.snapshot(float_cache(30))
    check_reusable(q4, 4, 64, 0)
    check_reusable(f, None)
    check_reusable(f, 4, 64, 31)  # float below quantized_kv_start is what the engine caches itself
    with pytest.raises(SnapshotError, match="quantized \\(q4g64.*this engine runs float KV"):
        check_reusable(q4, None)
    with pytest.raises(SnapshotError, match="this engine runs q8g64"):
        check_reusable(q4, 8, 64, 0)
    with pytest.raises(SnapshotError, match="float32 for 30 tokens.*from token 30 on"):
        check_reusable(f, 4, 64, 30)


def test_paged_store_blocks_quantized_layers_exactly():
    store = kv.PagedStore(block_size=16, num_blocks=64)
    ids = tuple(range(1, 49))
    snap = kv.snapshot(quant_cache(48), tokens=ids)
    store.insert(CacheKey(ids), TOKS, snap)
    assert store.entries == 3 and store.nbytes == snap.nbytes
    assert set(store.blocks_frame()["bytes"]) == {snap.nbytes // 3}
    match = store.lookup(CacheKey(ids), TOKS, limit=47)
    assert match.tokens == 32 and kv_format(match.snapshot) == "q4g64"
    assert same(arrays(match.snapshot), [a[..., :32, :] for a in arrays(snap)])
    assert match.snapshot.nbytes == snap.nbytes * 2 // 3
    assert same(arrays(kv.snapshot(kv.restore(match.snapshot))), arrays(match.snapshot))


def test_paged_store_quantizes_float_blocks_cached_below_the_start():
    # request A (32 tokens) stayed float (below quantized_kv_start); B continued it past the start,
    # so B's KV is A's float KV quantized plus quantized new tokens
    a_ids, b_ids = tuple(range(1, 33)), tuple(range(1, 49))
    a_cache = float_cache(32)
    a_snap = kv.snapshot(a_cache, tokens=a_ids)
    b_cache = maybe_quantize(kv.restore(a_snap), 4, 64, 0)
    extra = mx.random.normal((1, HEADS, 16, DIM))
    for c in b_cache:
        c.update_and_fetch(extra, extra)
    b_snap = kv.snapshot(b_cache, tokens=b_ids)
    store = kv.PagedStore(block_size=16, num_blocks=64)
    store.insert(CacheKey(a_ids), TOKS, a_snap)
    store.insert(CacheKey(b_ids), TOKS, b_snap)   # its first two blocks are A's float ones
    assert store.entries == 3
    match = store.lookup(CacheKey(b_ids + (99,)), TOKS, limit=48)
    assert match.tokens == 48 and kv_format(match.snapshot) == "q4g64"
    assert same(arrays(match.snapshot), arrays(b_snap))
    assert kv_format(store.lookup(CacheKey(a_ids + (99,)), TOKS, limit=32).snapshot) == "float32"
    store.insert(CacheKey(tuple(range(1, 65))), TOKS,
                 kv.snapshot(maybe_quantize(float_cache(64), 8, 64, 0), tokens=range(1, 65)))
    with pytest.raises(SnapshotError, match="one PagedStore per KV format"):
        store.lookup(CacheKey(tuple(range(1, 66))), TOKS, limit=64)
