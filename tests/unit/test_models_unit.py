"""kvlab.models / kvlab.models.gguf pieces that need no model weights."""

import sys

import numpy as np
import pytest

import kvlab as kv
from kvlab.models import folders, gguf
from kvlab.models import loading as models

import mlx.core as mx  # noqa: E402  (after kvlab: OpenBLAS first)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute: HF rotate-half rows -> interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of dim 8
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(np.array(gguf.unpermute(mx.array(permuted), 3)), w)


def test_interleaved_rope_on_permuted_rows_equals_half_rope():
    # why the un-permute is needed: llama.cpp rotates pairs (2i, 2i+1), mlx-lm's llama halves
    heads, dim, T = 2, 8, 5
    x = mx.random.normal((1, heads, T, dim), key=mx.random.key(0))
    perm = mx.array(llama_cpp_permute(np.arange(dim), 1))  # row j of GGUF = row perm[j] of HF
    half = mx.fast.rope(x, dim, traditional=False, base=10000.0, scale=1.0, offset=0)
    pairs = mx.fast.rope(x[..., perm], dim, traditional=True, base=10000.0, scale=1.0, offset=0)
    assert mx.allclose(pairs, half[..., perm], atol=1e-5)
    unpermuted = mx.fast.rope(x, dim, traditional=True, base=10000.0, scale=1.0, offset=0)
    assert not mx.allclose(unpermuted, half, atol=1e-2)


def test_qwen_tokenizer(qwen_tokenizer):
    tok = qwen_tokenizer
    assert len(tok._tokenizer) == 151669 == models.tiny_config()["vocab_size"]
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    for text in ("Hello, world!", "naïve café 東京 🙂", "  spaces\n\n"):
        assert tok.decode(tok.encode(text)) == text
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert models.qwen_tokenizer() is tok  # cached


def test_tiny_configs():
    plain, hybrid = models.tiny_config(), models.tiny_config(hybrid=True)
    assert plain["model_type"] == "qwen3" and hybrid["model_type"] == "lfm2"
    assert plain["num_attention_heads"] * plain["head_dim"] == plain["hidden_size"]
    assert hybrid["layer_types"] == ["conv", "full_attention", "conv", "full_attention"]
    assert hybrid["conv_L_cache"] == 3 and hybrid["block_dim"] == 64


def test_bad_arguments_fail_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    with pytest.raises(kv.KvlabError, match="dtype 'fp8' is not supported"):
        kv.load("tiny", dtype="fp8")
    with pytest.raises(kv.ModelNotFoundError, match="known names"):
        kv.load("gpt-5")
    with pytest.raises(TypeError, match="kvlab Model"):
        kv.fingerprint("tiny")
    assert list(tmp_path.iterdir()) == []


def test_home_and_dtype_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path / "h"))
    assert folders.kvlab_home() == (tmp_path / "h").resolve()
    monkeypatch.delenv("KVLAB_HOME")
    assert folders.kvlab_home().parts[-2:] == (".cache", "kvlab")
    assert models.default_dtype() == ("bfloat16" if sys.platform == "darwin" else "float32")


def test_digest_files(tmp_path):
    (tmp_path / "a.json").write_text("1")
    (tmp_path / "b.json").write_text("2")
    d = folders.digest_files(tmp_path, ["b.json", "a.json", "missing.json"])
    assert d == folders.digest_files(tmp_path, ["a.json", "b.json"])
    (tmp_path / "a.json").write_text("3")
    assert d != folders.digest_files(tmp_path, ["a.json", "b.json"])


def test_gguf_path_points_at_the_packaged_file():
    path = models.gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
