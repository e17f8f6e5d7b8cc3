"""One small adapter per VLM architecture: the parts of an image request that differ between
mlx-vlm models, so ``RequestModel`` stays generic.

An adapter says how an image becomes pixel values and a token count (``process``), how the
vision tower turns them into language-model features (``features``), how token ids are embedded
(``embed``), whether positions are M-RoPE (``mrope``) and how the language model runs a chunk
on a kvlab (mlx-lm) cache (``run``). Each mirrors its mlx-vlm model's own ``get_input_embeddings``
and ``__call__``; ``tests/integration/test_vlm_families.py`` checks the cold logits against
mlx-vlm's own forward pass for every architecture.

=========  ============================  ==============  ============================================
arch       language model cache          positions       image features
=========  ============================  ==============  ============================================
qwen2_vl   KVCache                       M-RoPE (t,h,w)  vision_tower(patches, grid)
qwen3_5    ArraysCache (GatedDeltaNet)   M-RoPE (t,h,w)  vision_tower(patches, grid)[0]
           + KVCache
gemma4     RotatingKVCache + KVCache,    plain           embed_vision(vision_tower(pixels)), token
           KV-shared layers without                      embeddings scaled by sqrt(hidden), image
           a cache                                       tokens' per-layer inputs from id 0
=========  ============================  ==============  ============================================

gemma4's tokens of one image attend to each other (``bidirectional``): its adapter passes the
``mm_token_type_ids`` mlx-vlm's processor makes and, on top of a cached prefix, where mlx-vlm
drops that overlay, masks through ``ImageBlockMask``; ``RequestModel`` refuses a chunk that starts
or ends inside such an image.

Example:
    >>> adapter_for("gemma4").mrope, adapter_for("qwen3_5").mrope
    (False, True)
"""

from __future__ import annotations

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ..errors import ModelNotFoundError  # noqa: E402
from ..primitives.display import summary_html  # noqa: E402


class Adapter:
    """qwen2_vl: M-RoPE positions, features straight from the vision tower, an mlx-lm KV cache."""

    arch = "qwen2_vl"
    mrope = True
    image_token = "<|image_pad|>"

    def process(self, image_processor, img) -> tuple[mx.array, tuple[int, int, int], int]:
        """(pixel values, (t, h, w) grid, image token count) of one PIL image."""
        out = image_processor(images=[img])
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
        merge = int(getattr(image_processor, "merge_size", 2))
        return mx.array(np.asarray(out["pixel_values"])), grid, int(np.prod(grid)) // merge**2

    def features(self, module, pixel_values: mx.array, grid) -> mx.array:
        """[tokens, hidden] language-model features of one image."""
        tower = module.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        return tower(pixel_values.astype(dtype), mx.array([grid]), output_hidden_states=False)

    def embed(self, module, ids: mx.array) -> mx.array:
        """[1, L, hidden] embeddings of token ids (image placeholders are overwritten after)."""
        return module.language_model.model.embed_tokens(ids)

    def run(self, module, ids: mx.array, embeds: mx.array, cache, positions) -> mx.array:
        """Logits [1, L, vocab] of one chunk on ``cache`` (mlx-lm cache objects)."""
        return module.language_model(ids, inputs_embeds=embeds, cache=cache, position_ids=positions).logits

    def bidirectional(self, module) -> bool:
        """Whether the tokens of one image attend to each other (then a cache cut inside an image
        is never exact: ``VLModel.restorable_limit``). qwen2_vl and qwen3_5: causal throughout."""
        return False

    def make_cache(self, module) -> list:
        """A fresh mlx-lm prompt cache (kvlab snapshots know mlx-lm's cache classes)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(module)

    def vision_summary(self, config: dict) -> str:
        vc = config.get("vision_config", {})
        return f"{vc.get('depth', '?')} blocks, width {vc.get('embed_dim', vc.get('hidden_size', '?'))}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.arch}, {'M-RoPE' if self.mrope else 'plain'} positions)"

    def _repr_html_(self) -> str:
        return summary_html(type(self).__name__, repr(self))


def mlx_lm_cache_like(vlm_cache) -> list:
    """mlx-lm cache objects of the kinds mlx-vlm's own ``make_cache`` returns (mlx-vlm has cache
    classes of its own; kvlab's snapshots and stores know mlx-lm's)."""
    from mlx_lm.models import cache as lm_cache

    out = []
    for c in vlm_cache:
        kind = type(c).__name__
        if kind == "KVCache":
            out.append(lm_cache.KVCache())
        elif kind == "RotatingKVCache":
            out.append(lm_cache.RotatingKVCache(max_size=int(c.max_size), keep=int(c.keep)))
        elif kind == "ArraysCache":
            out.append(lm_cache.ArraysCache(size=len(c.cache)))
        else:
            raise ModelNotFoundError(f"mlx-vlm made a {kind} cache layer, which kvlab's VLM path does "
                                     "not map onto mlx-lm's caches; use a qwen2_vl, qwen3_5 or gemma4 model")
    return out


class ImageBlockMask:
    """One layer's mlx-lm cache whose attention mask also lets the tokens of one image in this
    chunk see each other. mlx-vlm's Gemma 4 adds that overlay only to a square mask (a chunk on an
    empty cache) and silently drops it on top of a cached prefix (measured: logits 5.8 off); the
    chunk's own keys are the mask's last L columns for KVCache and RotatingKVCache alike. Everything
    else is the wrapped cache's."""

    def __init__(self, cache, token_types: mx.array):
        self.cache = cache
        ids = mx.cumsum((token_types[0] == 1) & mx.concatenate(
            [mx.array([True]), token_types[0, 1:] != token_types[0, :-1]]), axis=0)
        block = mx.where(token_types[0] == 1, ids, -1)  # [L] image run number, -1 for text
        self.same = (block[:, None] == block[None, :]) & (block[:, None] >= 0)  # [L, L]

    def make_mask(self, n: int, window_size=None, return_array: bool = False):
        base = self.cache.make_mask(n, window_size=window_size, return_array=True)
        if base is None or n != self.same.shape[0]:
            return base
        before = mx.zeros((n, base.shape[-1] - n), dtype=mx.bool_)
        return base | mx.concatenate([before, self.same], axis=1)

    def __getattr__(self, name):
        return getattr(self.cache, name)


class Qwen35Adapter(Adapter):
    """qwen3_5: a Qwen3-VL vision tower (returns features and deepstack lists), M-RoPE, and a
    GatedDeltaNet hybrid whose recurrent layers call methods only mlx-vlm's ArraysCache has
    (``update_window``, ``update_recurrent``): each chunk runs on mlx-vlm ArraysCaches that hold
    the mlx-lm ones' arrays, which are written back after the chunk."""

    arch = "qwen3_5"

    def features(self, module, pixel_values, grid):
        tower = module.vision_tower
        feats, _deepstack = tower(pixel_values.astype(tower.patch_embed.proj.weight.dtype), mx.array([grid]))
        return feats

    def run(self, module, ids, embeds, cache, positions):
        if cache is None:
            return super().run(module, ids, embeds, cache, positions)
        from mlx_lm.models.cache import ArraysCache as LmArrays
        from mlx_vlm.models.cache import ArraysCache as VlmArrays

        bridged = []
        for c in cache:
            if isinstance(c, LmArrays):
                v = VlmArrays(size=len(c.cache))
                v.cache = list(c.cache)
                bridged.append(v)
            else:
                bridged.append(c)
        logits = super().run(module, ids, embeds, bridged, positions)
        for c, v in zip(cache, bridged):
            if v is not c:
                c.cache = list(v.cache)
        return logits

    def make_cache(self, module):
        return mlx_lm_cache_like(module.language_model.make_cache())


class Gemma4Adapter(Adapter):
    """gemma4: plain positions (the cache offset), token embeddings scaled by sqrt(hidden) with
    the image features (``embed_vision`` of the pooled vision tower output) not scaled, per-layer
    inputs computed from the ids with image placeholders replaced by 0, as mlx-vlm's
    ``get_input_embeddings`` does; sliding-window and KV-shared layers (no cache of their own)."""

    arch = "gemma4"
    mrope = False

    def process(self, image_processor, img):
        data, counts = image_processor(images=[img])
        pixels = np.asarray(data["pixel_values"])  # [1, C, H, W], resized to whole pooling cells
        p = int(image_processor.patch_size)
        return mx.array(pixels), (1, pixels.shape[-2] // p, pixels.shape[-1] // p), int(counts[0])

    def features(self, module, pixel_values, grid):
        dtype = module.embed_vision.embedding_projection.weight.dtype
        return module.embed_vision(module.vision_tower(pixel_values.astype(dtype)))[0]

    def embed(self, module, ids):
        text = module.language_model.model
        return text.embed_tokens(ids) * text.embed_scale

    def per_layer_inputs(self, module, ids):
        text = module.language_model.model
        if not text.hidden_size_per_layer_input:
            return None
        return text.get_per_layer_inputs(mx.where(ids == module.config.image_token_id, 0, ids))

    def run(self, module, ids, embeds, cache, positions):
        types = self.token_types(module, ids)
        if cache is not None and self.bidirectional(module) and ids.shape[1] > 1:
            cache = [ImageBlockMask(c, types) for c in cache]
        return module.language_model(None, inputs_embeds=embeds, cache=cache,
                                     per_layer_inputs=self.per_layer_inputs(module, ids),
                                     mm_token_type_ids=types).logits

    def bidirectional(self, module) -> bool:
        """Whether the tokens of one image attend to each other (Gemma 4's
        ``use_bidirectional_attention: "vision"``, as mlx-vlm reads it)."""
        return getattr(module.language_model.config, "use_bidirectional_attention", None) == "vision"

    def token_types(self, module, ids):
        """[1, L] 1 at image placeholders, else 0: what mlx-vlm's Gemma 4 processor passes as
        ``mm_token_type_ids``, so the tokens of one image attend to each other."""
        return (ids == module.config.image_token_id).astype(mx.int32)

    def make_cache(self, module):
        return mlx_lm_cache_like(module.language_model.make_cache())

    def vision_summary(self, config):
        vc = config.get("vision_config", {})
        return (f"{vc.get('num_hidden_layers', '?')} blocks, width {vc.get('hidden_size', '?')}, "
                f"pooling {vc.get('pooling_kernel_size', '?')}")


ADAPTERS = {a.arch: a for a in (Adapter(), Qwen35Adapter(), Gemma4Adapter())}
SUPPORTED_ARCHS = tuple(ADAPTERS)


def adapter_for(arch: str) -> Adapter:
    """The adapter of an mlx-vlm ``model_type``, or ModelNotFoundError naming the supported ones."""
    if arch not in ADAPTERS:
        raise ModelNotFoundError(f"kvlab's image prefill supports {', '.join(SUPPORTED_ARCHS)}, not {arch!r} "
                                 "(image features, positions and the language-model call are "
                                 "architecture-specific: kvlab.vlm.archs)")
    return ADAPTERS[arch]
