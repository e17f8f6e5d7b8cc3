"""Tiny random-weight VLMs of the seed's cache families: ``kv.load("tiny-vlm:<arch>")``.

=========  ============================================  =====================================
arch       language model (width 64)                     vision tower, image tokens
=========  ============================================  =====================================
qwen2_vl   4 dense layers (``kvlab.vlm.build``)          2 blocks, 56x84 px -> 6 tokens
qwen3_5    GatedDeltaNet, attention, x2 (hybrid)         Qwen3-VL, 1 block, 56x84 px -> 6 tokens
gemma4     sliding(32) / full x2 + 2 KV-shared layers    1 block, pooled 2x2, 56x84 px -> 6 tokens
=========  ============================================  =====================================

Every one uses the real Qwen tokenizer: each config's image / image-start / image-end ids are
Qwen's ``<|image_pad|>`` 151655, ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, and the
chat template (Qwen2-VL's) renders exactly those, so the template's image tokens and the config's
``image_token_id`` agree. Recurrent layers are initialised for long memory
(``kvlab.models.families.LONG_MEMORY``), so a wrongly restored state cannot pass verification.
Gemma 4's text config keeps ``use_bidirectional_attention: "vision"`` as real Gemma 4 sets it
(mlx-vlm's TextConfig defaults to None): the tokens of one image attend to each other, so its
cache is never cut inside an image (``VLModel.restorable_limit``).

Example:
    >>> tiny_arch_config("gemma4")["image_token_id"]
    151655
    >>> ensure_tiny_arch("qwen3_5").name.startswith("tiny-vlm-qwen3_5-")   # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ..errors import ModelNotFoundError  # noqa: E402
from ..models.families import initial_value  # noqa: E402
from ..models.tiny import ensure_tiny_folder, qwen_vocab_size  # noqa: E402
from .build import PROCESSOR_FILES, QWEN2_VL_TEMPLATE, instantiate, write_tokenizer  # noqa: E402

TINY_ARCHS_VERSION = 3  # bump when this builder's output changes
ARCHS = ("qwen2_vl", "qwen3_5", "gemma4")
QWEN_VISION_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                   "vision_end_token_id": 151653}
WINDOW = 32  # gemma4's sliding window, as kvlab's tiny text gemma4


def _text(vocab: int) -> dict:
    return {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": True,
            "bos_token_id": 151643, "eos_token_id": [151645, 151643]}


def tiny_arch_config(arch: str) -> dict:
    """config.json of the tiny VLM of ``arch`` (qwen3_5 or gemma4; qwen2_vl: ``tiny_vlm_config``)."""
    v = qwen_vocab_size()
    common = {"vocab_size": v, "eos_token_id": [151645, 151643], "bos_token_id": 151643,
              "tie_word_embeddings": True, "torch_dtype": "float32"}
    if arch == "qwen3_5":
        text = {**_text(v), "model_type": "qwen3_5_text", "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                # head_dim 16, half of it rotary -> 4 frequencies split over (t, h, w)
                "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e6,
                                    "partial_rotary_factor": 0.5}}
        vision = {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                  "out_hidden_size": 64, "num_heads": 2, "patch_size": 8, "in_channels": 3,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                  "deepstack_visual_indexes": []}
        return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", **common,
                **QWEN_VISION_IDS, "text_config": text, "vision_config": vision}
    if arch == "gemma4":
        text = {**_text(v), "model_type": "gemma4_text", "num_hidden_layers": 6, "num_key_value_heads": 1,
                "global_head_dim": 16, "num_kv_shared_layers": 2, "vocab_size_per_layer_input": v,
                "hidden_size_per_layer_input": 8, "sliding_window": WINDOW, "sliding_window_pattern": 2,
                "use_double_wide_mlp": False, "final_logit_softcapping": 30.0,
                # as real Gemma 4: the tokens of one image attend to each other
                "use_bidirectional_attention": "vision"}
        vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                  "global_head_dim": 16, "patch_size": 8, "position_embedding_size": 64,
                  "pooling_kernel_size": 2, "default_output_length": 9}
        return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", **common,
                "image_token_id": 151655, "boi_token_id": 151652, "eoi_token_id": 151653,
                "audio_token_id": 151656, "video_token_id": None, "hidden_size": 64,
                "vision_soft_tokens_per_image": 9, "text_config": text, "vision_config": vision}
    raise ModelNotFoundError(f"no tiny VLM of type {arch!r}; kvlab builds "
                             + ", ".join(f"tiny-vlm:{a}" for a in ARCHS))


def preprocessor(arch: str) -> dict:
    """preprocessor_config.json: small images stay a handful of tokens."""
    if arch == "qwen3_5":  # 16 px per merged token, at most 6 tokens: 56x84 px -> 32x48 -> 2x3
        return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 16 * 16 * 4,
                "max_pixels": 16 * 16 * 6, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}
    return {"image_processor_type": "Gemma4ImageProcessor", "processor_class": "Gemma4Processor",
            "patch_size": 8, "max_soft_tokens": 9, "pooling_kernel_size": 2, "do_resize": True,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False, "do_convert_rgb": True}


def ensure_tiny_arch(arch: str, with_status: bool = False):
    """The folder of ``tiny-vlm:<arch>``, built once; ``with_status``: ``(folder, built_now)``."""
    cfg = tiny_arch_config(arch)
    return ensure_tiny_folder(f"tiny-vlm-{arch}", cfg, build_tiny_arch, with_status, name=f"tiny-vlm:{arch}",
                              builder=f"tiny-vlm-archs-{TINY_ARCHS_VERSION}", preprocessor=preprocessor(arch))


def weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One parameter's deterministic value: biases zero (a recurrent layer's ``dt_bias`` long-memory),
    everything else as kvlab's tiny text families (``kvlab.models.families.initial_value``)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias") and leaf != "dt_bias":
        return np.zeros(shape, np.float32)
    return initial_value(name, shape)


def build_tiny_arch(out: Path, cfg: dict) -> None:
    from mlx.utils import tree_flatten, tree_unflatten

    arch = cfg["model_type"]
    model = instantiate(cfg)
    params = {name: mx.array(weight(name, tuple(p.shape))) for name, p in tree_flatten(model.parameters())}
    model.update(tree_unflatten(list(params.items())))
    # mlx-vlm's Gemma 4 processor (its server) expands tokenizer.image_token to the image's soft
    # tokens between boi/eoi tokens, which the template already renders: so no boi/eoi names here
    write_tokenizer(out, QWEN2_VL_TEMPLATE, {"image_token": "<|image_pad|>"} if arch == "gemma4" else None)
    pre = preprocessor(arch)
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    # written so mlx-vlm finds them locally instead of asking the hub
    # (gemma4's processor reads its image settings from here, nested, before preprocessor_config.json)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": pre["processor_class"],
                                                           "image_processor": pre}))
    (out / "video_preprocessor_config.json").write_text(json.dumps({**pre, "processor_class": None}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})


assert "preprocessor_config.json" in PROCESSOR_FILES  # digested into each VLM's fingerprint
