"""load_vlm(): an mlx-vlm model (qwen2_vl, qwen3_5, gemma4) whose image requests kvlab can cache
correctly.

An image request's token ids are only placeholders (``<|image_pad|>`` repeated); the image enters
through the vision tower. Token ids alone therefore cannot key its KV (vllm-mlx#718): kvlab hashes
each image's decoded pixels (``Tokens.images``) and the Engine passes those hashes as extra keys.
The uncached rest of a request runs through ``RequestModel``: the VLM bound to that request's
images and M-RoPE positions, with mlx-lm's model signature ``(ids[1, L], cache=...) -> logits``,
so it works on top of any restored kvlab snapshot.

- ``images``: load_image, image_hash, Pixels (reading, hashing, placeholder runs);
- ``model``: VLModel (tokenise with images, process_image, for_request, prefill);
- ``net``: RequestModel (the VLM bound to one request; ``vlm.net`` is the text-only one);
- ``archs``: one adapter per architecture (image processing, vision tower call, embeddings,
  positions, the language-model call on an mlx-lm cache): adapter_for, SUPPORTED_ARCHS;
- ``build``: the tiny random-weight qwen2_vl (tiny_vlm_config, ensure_tiny_vlm);
- ``tiny_archs``: the tiny qwen3_5 (hybrid) and gemma4 (sliding window, KV-shared) VLMs;
- ``load``: load_vlm ("tiny", "tiny:<arch>"; ``kv.load("tiny-vlm:<arch>")`` routes here).

Example (``cat.png`` stands for any image: a path, a PIL image or a uint8 array)::

    import kvlab as kv
    vlm = kv.load_vlm("tiny")                  # random-weight qwen2_vl, built offline once
    hybrid = kv.load("tiny-vlm:qwen3_5")       # or "tiny-vlm:gemma4"
    msgs = [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                         {"type": "text", "text": "What is this?"}]}]
    toks = kv.tokenise(vlm, msgs)              # toks.images[0].hash / .token_start / .token_end
    logits, cache = vlm.prefill(toks)          # cold (or on top of a restored cache)
    kv.Engine(vlm, kv.RadixStore(), verify=True).run(msgs)
"""

from __future__ import annotations

from ..errors import ImageError, VLMUnavailableError
from .archs import ADAPTERS, Adapter, adapter_for
from .build import (QWEN2_VL_TEMPLATE, TINY_PREPROCESSOR, TINY_VLM_VERSION, ensure_tiny_vlm,
                    tiny_vlm_config)
from .images import Pixels, image_hash, image_source, load_image, placeholder_runs
from .load import SUPPORTED_ARCHS, load_vlm, require_mlx_vlm
from .model import IMAGE_MEMO, VLModel
from .net import RequestModel, cache_offset
from .tiny_archs import ensure_tiny_arch, tiny_arch_config

__all__ = ["ADAPTERS", "Adapter", "IMAGE_MEMO", "ImageError", "Pixels", "QWEN2_VL_TEMPLATE", "RequestModel",
           "SUPPORTED_ARCHS", "TINY_PREPROCESSOR", "TINY_VLM_VERSION", "VLMUnavailableError", "VLModel", "cache_offset",
           "ensure_tiny_vlm", "image_hash", "image_source", "load_image", "load_vlm",
           "placeholder_runs", "require_mlx_vlm", "tiny_vlm_config", "adapter_for", "ensure_tiny_arch",
           "tiny_arch_config"]
