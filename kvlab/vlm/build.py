"""The tiny VLMs: deterministic random-weight mlx-vlm models built offline into $KVLAB_HOME with
the real Qwen tokenizer, a chat template whose image placeholder is ``<|image_pad|>`` (the
config's image_token_id) and a small-image preprocessor config. Built once, in a temporary folder
renamed into place (as kv.load's tiny models are).

- ``qwen2_vl`` (``kv.load_vlm("tiny")``): 4 dense layers, a 2-block vision tower;
- ``qwen3_5`` and ``gemma4`` (``kv.load("tiny-vlm:<arch>")``): ``kvlab.vlm.tiny_archs``.

Example:
    >>> tiny_vlm_config()["vision_config"]["depth"]
    2
    >>> ensure_tiny_vlm().name.startswith("tiny-qwen2vl-")
    True
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ..models.tiny import ensure_tiny_folder, qwen_tokenizer_dir, qwen_vocab_size, tiny_rng  # noqa: E402

TINY_VLM_VERSION = 1  # bump when the tiny VLM builder's output changes

# Qwen2-VL's chat template (as shipped with Qwen/Qwen2-VL-*-Instruct).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Small images stay small: 56x56 px -> 4 image tokens, at most 64 tokens per image.
TINY_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
                     "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                     "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64,
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711],
                     "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                     "do_convert_rgb": True}

# files besides the tokenizer's that decide how a VLM folder processes images
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json")


def tiny_vlm_config() -> dict:
    """config.json of the tiny qwen2_vl: 4 text layers of width 64, a 2-block vision tower."""
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            "vocab_size": qwen_vocab_size(), "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e6,
            "tie_word_embeddings": True,
            # head_dim 16 -> 8 rotary frequencies split over (t, h, w)
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "bos_token_id": 151643, "eos_token_id": [151645, 151643],
            "torch_dtype": "float32",
            # mlp_ratio must be an int: mlx-vlm sizes the vision MLP with int(embed_dim * ratio)
            "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 64,
                              "num_heads": 2, "mlp_ratio": 2, "in_channels": 3, "patch_size": 14,
                              "spatial_patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2}}


def ensure_tiny_vlm(with_status: bool = False):
    """The tiny qwen2_vl's folder, built once (temp dir + rename, like kv.load's tiny models);
    ``with_status=True`` gives ``(folder, built_now)``. The others: ``tiny_archs.ensure_tiny_arch``."""
    return ensure_tiny_folder("tiny-qwen2vl", tiny_vlm_config(), build_tiny_vlm, with_status, name="tiny-vlm",
                              builder=f"tiny-vlm-{TINY_VLM_VERSION}", preprocessor=TINY_PREPROCESSOR)


def instantiate(cfg: dict):
    """An mlx-vlm model object for ``cfg`` (mlx-vlm's own config classes), randomly initialised."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    model_class, _ = get_model_and_args(config=dict(cfg))
    raw = json.loads(json.dumps(cfg))
    raw.setdefault("text_config", {})
    model_config = model_class.ModelConfig.from_dict(raw)
    model_config = update_module_configs(model_config, model_class, raw, ["text", "vision"])
    return model_class.Model(model_config)


def write_tokenizer(out: Path, template: str, named_tokens: dict | None = None) -> None:
    """The Qwen tokenizer files with ``template`` as the chat template; ``named_tokens`` become
    tokenizer attributes (``extra_special_tokens``: ``{"image_token": "<|image_pad|>"}`` gives
    ``tokenizer.image_token`` and ``.image_token_id``, which some mlx-vlm processors read)."""
    src = qwen_tokenizer_dir()
    for fname in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copyfile(src / fname, out / fname)
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg["chat_template"] = template  # the Qwen3 text template has no image parts
    if named_tokens:
        tok_cfg["extra_special_tokens"] = dict(named_tokens)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}))


def build_tiny_vlm(out: Path, cfg: dict) -> None:
    """Write a random-weight mlx-vlm folder for ``cfg`` into ``out`` (weights seeded per name)."""
    from mlx.utils import tree_flatten, tree_unflatten

    model = instantiate(cfg)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 1:  # norm scales one, biases zero
            norm = any(k in name for k in ("norm", "ln_q")) and name.endswith("weight")
            value = np.ones(p.shape, np.float32) if norm else np.zeros(p.shape, np.float32)
        else:
            # embeddings std 0.25 keep tied logits near std 2; other weights preserve scale
            std = 0.25 if "embed_tokens" in name else 1 / np.sqrt(np.prod(p.shape[1:]))
            value = tiny_rng(name).standard_normal(p.shape, dtype=np.float32) * np.float32(std)
        params[name] = mx.array(value)
    model.update(tree_unflatten(list(params.items())))
    write_tokenizer(out, QWEN2_VL_TEMPLATE)
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2))
    # written so mlx-vlm finds it locally instead of asking the hub
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
