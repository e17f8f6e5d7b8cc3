"""The pure pieces of kvlab.vlm's architecture adapters and tiny VLM configs (no model loaded)."""

import numpy as np
import pytest

import kvlab as kv  # noqa: F401  (OpenBLAS before mlx.core)

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as lm_cache  # noqa: E402
from mlx_vlm.models import cache as vlm_cache  # noqa: E402

from kvlab.errors import ModelNotFoundError  # noqa: E402
from kvlab.primitives.tokens import ImageRef  # noqa: E402
from kvlab.vlm.archs import SUPPORTED_ARCHS, ImageBlockMask, adapter_for, mlx_lm_cache_like  # noqa: E402
from kvlab.vlm.net import cache_offset, inside_image  # noqa: E402
from kvlab.vlm.tiny_archs import preprocessor, tiny_arch_config, weight  # noqa: E402


def test_supported_archs_and_positions():
    assert SUPPORTED_ARCHS == ("qwen2_vl", "qwen3_5", "gemma4")
    assert [adapter_for(a).mrope for a in SUPPORTED_ARCHS] == [True, True, False]
    assert {adapter_for(a).image_token for a in SUPPORTED_ARCHS} == {"<|image_pad|>"}
    with pytest.raises(ModelNotFoundError, match="supports qwen2_vl, qwen3_5, gemma4, not 'llava'"):
        adapter_for("llava")


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma4"])
def test_tiny_configs_use_qwen_vision_tokens(arch):
    # mutant caught: gemma4's own ids (258880/255999/258882) left in place: outside the Qwen
    # vocabulary (151669), so the template's <|image_pad|> would never match image_token_id
    cfg = tiny_arch_config(arch)
    assert cfg["image_token_id"] == 151655 and cfg["model_type"] == arch
    start, end = ("vision_start_token_id", "vision_end_token_id") if arch == "qwen3_5" else ("boi_token_id",
                                                                                          "eoi_token_id")
    assert (cfg[start], cfg[end]) == (151652, 151653)
    assert cfg["text_config"]["hidden_size"] == 64 and cfg["text_config"]["vocab_size"] == cfg["vocab_size"]
    assert 4 <= cfg["text_config"]["num_hidden_layers"] <= 6
    assert preprocessor(arch)["patch_size"] == cfg["vision_config"]["patch_size"] == 8
    with pytest.raises(ModelNotFoundError, match="tiny-vlm:qwen2_vl, tiny-vlm:qwen3_5, tiny-vlm:gemma4"):
        tiny_arch_config("llava")


def test_weights_are_deterministic_and_long_memory():
    assert weight("language_model.model.layers.0.linear_attn.dt_bias", (4,)).tolist() == [-6.0] * 4
    assert weight("language_model.model.layers.0.linear_attn.A_log", (4,)).tolist() == [0.0] * 4
    assert weight("vision_tower.blocks.0.norm1.bias", (3,)).tolist() == [0.0] * 3  # not a norm scale
    assert weight("vision_tower.blocks.0.norm1.weight", (3,)).tolist() == [1.0] * 3
    a, b = weight("x.q_proj.weight", (4, 8)), weight("x.q_proj.weight", (4, 8))
    assert np.array_equal(a, b) and not np.array_equal(a, weight("x.k_proj.weight", (4, 8)))


def test_mlx_vlm_caches_map_onto_mlx_lm_ones():
    got = mlx_lm_cache_like([vlm_cache.ArraysCache(size=2), vlm_cache.KVCache(),
                             vlm_cache.RotatingKVCache(max_size=32, keep=0)])
    assert [type(c) for c in got] == [lm_cache.ArraysCache, lm_cache.KVCache, lm_cache.RotatingKVCache]
    assert len(got[0].cache) == 2 and (got[2].max_size, got[2].keep) == (32, 0)
    with pytest.raises(ModelNotFoundError, match="ChunkedKVCache"):
        mlx_lm_cache_like([vlm_cache.ChunkedKVCache(16)])


def test_cache_offset_reads_the_first_attention_layer():
    # mutant caught: the offset of layer 0 (a hybrid's recurrent state says nothing: 0), which
    # made every qwen3_5 chunk start its image features and positions at 0
    kv_layer = lm_cache.KVCache()
    kv_layer.update_and_fetch(mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)))
    assert cache_offset([lm_cache.ArraysCache(2), kv_layer]) == 5
    assert cache_offset(None) == cache_offset([]) == cache_offset([lm_cache.ArraysCache(2)]) == 0


def test_only_gemma4_keeps_bidirectional_image_attention():
    # mutant caught: the key left out of the tiny config (mlx-vlm's TextConfig default is None)
    assert tiny_arch_config("gemma4")["text_config"]["use_bidirectional_attention"] == "vision"
    assert "use_bidirectional_attention" not in tiny_arch_config("qwen3_5")["text_config"]
    assert [adapter_for(a).bidirectional(None) for a in ("qwen2_vl", "qwen3_5")] == [False, False]


def test_image_block_mask_opens_the_chunks_images_on_top_of_a_cached_prefix():
    """A chunk of 5 at offset 3: text, image A (2 tokens), text, image B (1 token). The mask is
    the causal one over 3 cached + 5 keys, plus each image's tokens seeing each other; a mask that
    does not cover the chunk (a one-token decode) stays the cache's own. Mutant caught: the
    overlay on the first L key columns instead of the last (the chunk's own keys)."""
    c = lm_cache.KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    wrapped = ImageBlockMask(c, mx.array([[0, 1, 1, 0, 1]]))
    mask = np.asarray(wrapped.make_mask(5, window_size=None, return_array=False))
    want = np.tril(np.ones((5, 8), bool), k=3)
    want[1, 3 + 2] = True  # image A's first token sees its second
    assert mask.shape == (5, 8) and np.array_equal(mask, want)
    assert wrapped.offset == 3 and wrapped.make_mask(1) is None
    r = lm_cache.RotatingKVCache(max_size=4)
    r.update_and_fetch(mx.zeros((1, 1, 6, 4)), mx.zeros((1, 1, 6, 4)))
    got = np.asarray(ImageBlockMask(r, mx.array([[1, 1]])).make_mask(2, window_size=4))
    # 3 kept keys + the chunk's 2 (window 4): the image's first token sees the second, the window
    # still hides the oldest key from the second
    assert got.tolist() == [[True] * 5, [False, True, True, True, True]]


def test_inside_image_names_the_image_and_where_to_restore():
    images = [ImageRef("a" * 64, 4, 10, 1), ImageRef("b" * 64, 20, 26, 1)]
    assert [inside_image(images, p, "gemma4") == "" for p in (4, 10, 19, 20, 26)] == [True] * 5
    assert inside_image(images, 21, "gemma4") == ("position 21 is inside image 1 (tokens 20:26): gemma4 "
                                                  "attends bidirectionally within an image; restore at or "
                                                  "before token_start 20")
