"""Issue 2's invariants on real models: cached == uncached, trim, save/load, no aliasing, errors."""

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

import kvlab as kv
from kvlab.errors import NotTrimmableError, SnapshotError, TemplateError
from kvlab.primitives.tolerance import tolerance

pytestmark = pytest.mark.model

TINY_TOL = tolerance("float32")  # 1e-4; the tiny models are float32, 4 layers: observed ~1e-6
# SmolLM2 (30 layers, logits ~20) in its dtype: float32 1e-3 (observed ~5e-5), bfloat16 on a Mac

SYSTEM = ("You are a meticulous assistant for a research lab. Answer with care, cite the "
          "step you used, and keep answers short. ") * 3
A = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


def conversation(model):
    full = kv.tokenise(model, A)
    split = kv.split_at_boundary(full, at="system")
    return full, split


def max_diff(a, b) -> float:
    return float(mx.abs(a - b).max().item())


@pytest.mark.parametrize("name,deep", [("tiny", False), ("smol", True)])
def test_restore_then_prefill_equals_cold(request, name, deep):
    model = request.getfixturevalue(name)
    tol = tolerance(model.dtype, deep=deep)
    full, split = conversation(model)
    assert split.clean and split.prefix_ids + split.suffix_ids == full.ids
    cold, _ = kv.prefill(model, full.ids)
    _, cache = kv.prefill(model, split.prefix_ids)
    snap = kv.snapshot(cache, tokens=split.prefix_ids, model=model)
    assert snap.offset == len(split.prefix_ids)
    warm, _ = kv.prefill(model, split.suffix_ids, kv.restore(snap))
    assert max_diff(cold, warm) < tol
    # the same after trimming back to a shorter prefix
    short = kv.trim(snap, 7)
    assert short.offset == len(split.prefix_ids) - 7 and short.token_ids == split.prefix_ids[:-7]
    warm2, _ = kv.prefill(model, full.ids[short.offset:], kv.restore(short))
    assert max_diff(cold, warm2) < tol


def test_save_load_round_trip(tiny, tmp_path):
    full, split = conversation(tiny)
    cold, _ = kv.prefill(tiny, full.ids)
    _, cache = kv.prefill(tiny, split.prefix_ids)
    snap = kv.snapshot(cache, tokens=split.prefix_ids, model=tiny)
    path = kv.save(snap, tmp_path / "s.safetensors")
    back = kv.load_snapshot(path, tiny)
    assert back.offset == snap.offset and back.token_ids == split.prefix_ids and back.nbytes == snap.nbytes
    warm, _ = kv.prefill(tiny, split.suffix_ids, kv.restore(back))
    assert max_diff(cold, warm) < TINY_TOL
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_snapshot_survives_trim_and_refill_of_live_cache(tiny):
    full, split = conversation(tiny)
    _, cache = kv.prefill(tiny, split.prefix_ids)
    snap = kv.snapshot(cache, model=tiny)
    before = [np.array(layer.state[0]) for layer in snap.layers]
    for c in cache:
        c.trim(10)
    kv.prefill(tiny, [42] * 30, cache)  # overwrites the buffer in place
    live = kv.restore(snap)
    for c in live:
        c.trim(5)
    kv.prefill(tiny, [7] * 30, live)
    after = [np.array(layer.state[0]) for layer in snap.layers]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_naive_aliasing_is_corrupted(tiny):
    """The pitfall kvlab avoids: keeping the live cache's own array objects (vllm-mlx#575)."""
    _, split = conversation(tiny)
    _, cache = kv.prefill(tiny, split.prefix_ids)
    naive = [(c.keys, c.offset) for c in cache]
    before = [np.array(k[..., :off, :]) for k, off in naive]
    for c in cache:
        c.trim(10)
    kv.prefill(tiny, [42] * 30, cache)
    changed = sum(not np.array_equal(b, np.array(k[..., :off, :])) for b, (k, off) in zip(before, naive))
    assert changed == len(cache)


def test_snapshot_counts_valid_tokens_not_buffer(tiny):
    _, cache = kv.prefill(tiny, list(range(100, 130)))
    snap = kv.snapshot(cache)
    layer = cache[0]
    assert layer.keys.shape[2] == 256  # mlx-lm preallocates in steps of 256
    per_token = 2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.dtype.size
    assert snap.nbytes == 30 * per_token * len(cache)


def test_trim_non_trimmable_names_layer_and_type():
    hybrid = kv.load("tiny-hybrid")
    _, cache = kv.prefill(hybrid, list(range(100, 120)))
    snap = kv.snapshot(cache)
    assert not snap.trimmable
    with pytest.raises(NotTrimmableError, match=r"layer 0 \(ArraysCache\)"):
        kv.trim(snap, 3)


def test_trim_wrapped_rotating_cache(tiny):
    cache = [mlx_cache.RotatingKVCache(max_size=16) for _ in tiny.module.layers]
    _, cache = kv.prefill(tiny, list(range(100, 140)), cache)
    with pytest.raises(NotTrimmableError, match="RotatingKVCache.*wrapped"):
        kv.trim(kv.snapshot(cache), 2)


def test_rotating_cache_before_wrapping_round_trips(tiny):
    ids = list(range(100, 120))
    cache = [mlx_cache.RotatingKVCache(max_size=64) for _ in tiny.module.layers]
    cold, _ = kv.prefill(tiny, ids, [mlx_cache.RotatingKVCache(max_size=64) for _ in tiny.module.layers])
    _, cache = kv.prefill(tiny, ids[:12], cache)
    warm, _ = kv.prefill(tiny, ids[12:], kv.restore(kv.snapshot(cache)))
    assert max_diff(cold, warm) < TINY_TOL


# ---- files: clear errors, nothing half-written ----------------------------------------------------

@pytest.fixture
def saved(tiny, tmp_path):
    _, cache = kv.prefill(tiny, list(range(100, 140)))
    return kv.save(kv.snapshot(cache, model=tiny), tmp_path / "s.safetensors")


def test_load_refuses_other_model(saved):
    other = kv.load("tiny-hybrid")
    with pytest.raises(SnapshotError, match="was made by model"):
        kv.load_snapshot(saved, other)


def test_load_refuses_truncated_and_corrupt(tiny, saved, tmp_path):
    data = open(saved, "rb").read()
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="corrupt or truncated"):
        kv.load_snapshot(truncated, tiny)
    corrupt = tmp_path / "c.safetensors"
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    corrupt.write_bytes(bytes(flipped))
    with pytest.raises(SnapshotError, match="corrupt"):
        kv.load_snapshot(corrupt, tiny)
    with pytest.raises(SnapshotError, match="no snapshot file"):
        kv.load_snapshot(tmp_path / "missing.safetensors", tiny)


def test_load_refuses_newer_format(tiny, saved, tmp_path):
    arrays, meta = mx.load(saved, return_metadata=True)
    meta["kvlab_format"] = "99"
    newer = str(tmp_path / "n.safetensors")
    mx.save_safetensors(newer, arrays, meta)
    with pytest.raises(SnapshotError, match="newer"):
        kv.load_snapshot(newer, tiny)


def test_failed_save_leaves_no_file(tiny, tmp_path, monkeypatch):
    _, cache = kv.prefill(tiny, list(range(100, 140)))
    snap = kv.snapshot(cache, model=tiny)

    def boom(path, arrays, metadata):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", boom)
    with pytest.raises(OSError):
        kv.save(snap, tmp_path / "s.safetensors")
    assert os.listdir(tmp_path) == []


def test_save_needs_model_identity(tiny, tmp_path):
    _, cache = kv.prefill(tiny, [1, 2, 3])
    with pytest.raises(SnapshotError, match="model="):
        kv.save(kv.snapshot(cache), tmp_path / "x.safetensors")


# ---- tokenise / split errors --------------------------------------------------------------------

def test_tokenise_bad_conversations(tiny):
    with pytest.raises(TemplateError, match="empty conversation"):
        kv.tokenise(tiny, [])
    with pytest.raises(TemplateError, match="unknown role 'wizard'"):
        kv.tokenise(tiny, [{"role": "wizard", "content": "hi"}])


def test_tokenise_without_chat_template(qwen_tokenizer):
    from transformers import AutoTokenizer

    from kvlab.models.loading import qwen_tokenizer_dir

    bare = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    bare.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        kv.tokenise(bare, [{"role": "user", "content": "hi"}])


def test_generation_after_restore_matches_cold(smol):
    """mlx-lm's own stream_generate accepts restored caches and greedy output is unchanged."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    full, split = conversation(smol)
    greedy = make_sampler(temp=0.0)
    cold = "".join(r.text for r in stream_generate(smol.module, smol.tokenizer, list(full.ids),
                                                   max_tokens=12, sampler=greedy))
    _, cache = kv.prefill(smol, split.prefix_ids)
    warm = "".join(r.text for r in stream_generate(smol.module, smol.tokenizer, list(split.suffix_ids),
                                                   max_tokens=12, sampler=greedy,
                                                   prompt_cache=kv.restore(kv.snapshot(cache))))
    assert warm == cold and "Paris" in cold
