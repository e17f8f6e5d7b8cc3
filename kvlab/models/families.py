"""Tiny random-weight models of every cache family mlx-lm 0.32 runs: ``kv.load("tiny:<model_type>")``.

Each is one of mlx-lm's own architectures (``mlx_lm.utils._get_classes``) at toy size, with the real
Qwen3 tokenizer (``kvlab.models.tiny``), built offline once into ``$KVLAB_HOME/models``. Together
they cover every kind of layer cache a prefix cache meets (``kvlab.primitives.layout``):

=================  ==================  ===========================================================
family             model types         cache per layer
=================  ==================  ===========================================================
dense              qwen3               KVCache
sliding            gemma3_text,        RotatingKVCache(32) + KVCache; gemma4_text's last two layers
                   gemma4_text,        read earlier layers' KV (no cache of their own)
                   gpt_oss
hybrid             qwen3_5,            ArraysCache (GatedDeltaNet / Mamba2 / conv state) + KVCache
                   qwen3_next,
                   nemotron_h, lfm2
CacheList          falcon_h1           CacheList(ArraysCache, KVCache) in every layer
pure recurrent     mamba2, rwkv7       ArraysCache
chunked            llama4              ChunkedKVCache(32) on 3 of 4 layers + KVCache
recurrent+sliding  recurrent_gemma     ArraysCache + RotatingKVCache(32), no full KV
=================  ==================  ===========================================================

Recurrent layers are initialised for long memory. With mlx-lm's default initialisation a random
recurrent layer forgets within ~50 tokens, so a wrongly restored state would still pass a
verification against cold prefill; ``context_sensitivity`` measures how far the last logits of a
200-token prompt move when its first tokens change (kvlab's tests require >= 1e-2).

Example:
    >>> m = kv.load("tiny:mamba2")                      # doctest: +SKIP
    >>> m.layout.summary()                              # doctest: +SKIP
    '4 x recurrent state (ArraysCache)'
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from ..errors import ModelNotFoundError  # noqa: E402
from .tiny import QWEN_FILES, ensure_tiny_folder, qwen_tokenizer_dir, qwen_vocab_size, tiny_rng  # noqa: E402

FAMILIES_VERSION = 1  # bump when the builder's output changes
PREFIX = "tiny:"
WINDOW = 32  # sliding windows and attention chunks: small enough that 4-turn chats wrap them

FAMILY_OF = {
    "qwen3": "dense",
    "gemma3_text": "sliding", "gemma4_text": "sliding", "gpt_oss": "sliding",
    "qwen3_5": "hybrid", "qwen3_next": "hybrid", "nemotron_h": "hybrid", "lfm2": "hybrid",
    "falcon_h1": "CacheList",
    "mamba2": "pure recurrent", "rwkv7": "pure recurrent",
    "llama4": "chunked",
    "recurrent_gemma": "recurrent + sliding",
}
MODEL_TYPES = tuple(FAMILY_OF)

# Long memory: a recurrent layer's per-token decay close to 1 (see the module docstring).
LONG_MEMORY = {
    "dt_bias": -6.0,           # Mamba2 / GatedDeltaNet: softplus(-6) ~ 0.0025 steps
    "A_log": 0.0,              # A = -1
    "recurrent_param": -6.0,   # RG-LRU: a ~ 0.99 per token
    "w_lora.lora.2.bias": -6.0,  # RWKV-7: decay exp(-0.61 sigmoid(-6)) ~ 0.9985
}


def _base(vocab: int) -> dict:
    return {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": True,
            "bos_token_id": 151643, "eos_token_id": [151645, 151643], "torch_dtype": "float32"}


def family_config(model_type: str) -> dict:
    """The config.json of ``tiny:<model_type>``.

        >>> family_config("gemma3_text")["sliding_window"]
        32
    """
    if model_type not in FAMILY_OF:
        raise ModelNotFoundError(f"no tiny model of type {model_type!r}; kvlab builds "
                                 f"{', '.join(PREFIX + t for t in MODEL_TYPES)}")
    v = qwen_vocab_size()
    base = {"model_type": model_type, **_base(v)}
    attention = {"head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
    linear = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}
    mamba = {"conv_kernel": 4, "n_groups": 1, "use_conv_bias": True}
    configs = {
        "qwen3": {**attention},
        "gemma3_text": {**attention, "num_key_value_heads": 1, "query_pre_attn_scalar": 16,
                        "sliding_window": WINDOW, "sliding_window_pattern": 2},
        "gemma4_text": {**attention, "num_key_value_heads": 1, "global_head_dim": 16, "num_hidden_layers": 6,
                        "num_kv_shared_layers": 2, "vocab_size_per_layer_input": v,
                        "hidden_size_per_layer_input": 8, "sliding_window": WINDOW,
                        "sliding_window_pattern": 2, "use_double_wide_mlp": False},
        "gpt_oss": {**attention, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                    "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_theta": 150000},
        "qwen3_5": {**attention, **linear},
        "qwen3_next": {**attention, **linear, "num_experts": 4, "num_experts_per_tok": 2,
                       "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64, "mlp_only_layers": [],
                       "moe_intermediate_size": 64, "partial_rotary_factor": 0.25},
        "nemotron_h": {**mamba, "intermediate_size": 128, "attention_bias": False, "mamba_num_heads": 4,
                       "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16, "mlp_bias": False,
                       "layer_norm_epsilon": 1e-5, "use_bias": False, "head_dim": 16,
                       "hybrid_override_pattern": "M*M-"},  # "-" (MLP) layers get no cache
        "lfm2": {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128,
                 "intermediate_size": 128, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
                 "block_auto_adjust_ff_dim": False,
                 "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
        "falcon_h1": {"head_dim": 16, "intermediate_size": 128, "mamba_d_conv": 4, "mamba_d_head": 16,
                      "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_n_heads": 4, "mamba_n_groups": 1,
                      "mamba_chunk_size": 32, "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0},
        "mamba2": {**mamba, "num_heads": 4, "head_dim": 16, "intermediate_size": 64, "state_size": 16,
                   "layer_norm_epsilon": 1e-5, "use_bias": False,
                   "expand": 1,  # transformers validates config.json when the tokenizer loads
                   "time_step_limit": [0.0, 1e9], "time_step_rank": 8},
        "rwkv7": {"intermediate_size": 128, "norm_eps": 1e-5, "head_dim": 16, "a_low_rank_dim": 8,
                  "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8},
        "recurrent_gemma": {"attention_bias": False, "conv1d_width": 4, "intermediate_size": 128,
                            "logits_soft_cap": 30.0, "num_hidden_layers": 3, "num_key_value_heads": 1,
                            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_window_size": WINDOW,
                            "block_types": ["recurrent", "attention"], "lru_width": 64},
    }
    if model_type == "llama4":  # llama4 reads cache[3]: at least 4 layers; ChunkedKVCache on 3 of 4
        text = {**_base(v), **attention, "model_type": "llama4_text", "attention_bias": False,
                "attention_chunk_size": WINDOW, "intermediate_size_mlp": 128, "interleave_moe_layer_step": 2,
                "num_local_experts": 2, "num_experts_per_tok": 1, "rope_scaling": None, "use_qk_norm": True}
        return {**base, "architectures": ["Llama4ForConditionalGeneration"], "text_config": text}
    return {**base, **configs[model_type]}


def is_family_name(name: str) -> bool:
    return name.startswith(PREFIX)


def ensure_family(name: str, with_status: bool = False):
    """The folder of ``tiny:<model_type>``, built once; ``with_status``: ``(folder, built_now)``."""
    model_type = name[len(PREFIX):] if is_family_name(name) else name
    cfg = family_config(model_type)
    return ensure_tiny_folder(f"tiny-{model_type}", cfg, build_family, with_status,
                              name=PREFIX + model_type, builder=f"families-{FAMILIES_VERSION}")


def initial_value(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The deterministic initial value of one parameter: long-memory recurrent biases
    (``LONG_MEMORY``), ones for norms and scales, zeros for other biases and attention sinks,
    normal weights that keep activations at unit scale."""
    for suffix, value in LONG_MEMORY.items():
        if name.endswith(suffix):
            return np.full(shape, value, np.float32)
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1 and ("norm" in name or leaf in ("D", "layer_scalar")):
        return np.ones(shape, np.float32)
    if leaf.endswith("bias") or leaf == "sinks":
        return np.zeros(shape, np.float32)
    if len(shape) == 1:  # mixing coefficients (RWKV's x_*) and other per-channel factors
        return np.full(shape, 0.5, np.float32)
    std = 0.25 if "embed" in name else 1 / np.sqrt(np.prod(shape[1:]))
    return tiny_rng(name).standard_normal(shape, dtype=np.float32) * np.float32(std)


def build_family(out: Path, cfg: dict) -> None:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    params = {name: mx.array(initial_value(name, tuple(p.shape))) for name, p in tree_flatten(model.parameters())}
    model.update(tree_unflatten(list(params.items())))
    for fname in QWEN_FILES:
        shutil.copyfile(qwen_tokenizer_dir() / fname, out / fname)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})


def context_sensitivity(model, n: int = 200, changed: int = 20, seed: int = 0) -> float:
    """How far the last-position logits of an ``n``-token prompt move (max abs) when its first
    ``changed`` tokens are replaced: a model that forgets them cannot tell a wrong restored state
    from a right one."""
    from ..primitives.snapshots import prefill

    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 20000, n).tolist()
    other = rng.integers(1000, 20000, changed).tolist() + ids[changed:]
    a, _ = prefill(model, ids)
    b, _ = prefill(model, other)
    return float(mx.abs(a - b).max().item())
