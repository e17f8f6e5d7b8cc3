"""kvlab.models / kvlab.models.gguf against real weights: the embedded SmolLM2 and the tiny models."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import kvlab as kv
from kvlab.models import folders
from kvlab.models import loading as models
from kvlab.primitives.tolerance import tolerance

import mlx.core as mx  # noqa: E402  (after kvlab: OpenBLAS first)
from mlx_lm import generate  # noqa: E402
from mlx_lm.models.cache import can_trim_prompt_cache  # noqa: E402

pytestmark = pytest.mark.model

# max |logit difference| against the float64 numpy reference: the deep-model tolerance of the dtype
# smollm2 is built in (float32 here: 1e-3)


def _child(expr: str, home) -> str:
    """Evaluate `expr` in a fresh Python process with KVLAB_HOME=home; its last stdout line."""
    env = dict(os.environ, KVLAB_HOME=str(home))
    code = f"import kvlab as kv; print({expr})"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]


def _visible(home):
    """Everything in $KVLAB_HOME/models, hidden files included."""
    folder = home / "models"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# -- an independent GGUF reader and llama forward pass (numpy, float64) ------------------------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def read_gguf_raw(path):
    """Parse the GGUF file by hand: (metadata, {name: float64 array}); F32, Q4_1, Q8_0 only."""
    buf = memoryview(open(path, "rb").read())
    pos = 0

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode()

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(_SCALAR[t])

    assert bytes(buf[:4]) == b"GGUF"
    pos = 4
    version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    assert version >= 2
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, dims, take("<I"), take("<Q")))
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, dims, kind, offset in infos:
        n = int(np.prod(dims))
        shape = tuple(reversed(dims))  # ne0 is the fastest-varying dimension
        if kind == 0:  # F32
            t = np.frombuffer(buf, np.float32, n, start + offset).astype(np.float64)
        elif kind == 3:  # Q4_1: blocks of 32 = fp16 d, fp16 m, 16 bytes of nibbles
            blocks = np.frombuffer(buf, np.uint8, n // 32 * 20, start + offset).reshape(-1, 20)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
            qs = blocks[:, 4:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)  # low nibbles first
            t = d * q + m
        elif kind == 8:  # Q8_0: blocks of 32 = fp16 d, 32 int8
            blocks = np.frombuffer(buf, np.uint8, n // 32 * 34, start + offset).reshape(-1, 34)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
            t = d * blocks[:, 2:].copy().view(np.int8).astype(np.float64)
        else:
            raise NotImplementedError(f"ggml type {kind} for {name}")
        tensors[name] = t.reshape(shape)
    return meta, tensors


def reference_logits(meta, w, ids):
    """llama.cpp's computation: q/k rows stay permuted and RoPE rotates adjacent pairs."""
    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rope(x):  # x: (T, heads, d); pairs (2i, 2i+1) rotate by pos * base^(-2i/d)
        d = x.shape[-1]
        ang = np.arange(len(ids))[:, None] * base ** (-np.arange(0, d, 2) / d)[None]
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    base = meta["llama.rope.freq_base"]
    n_head, n_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    T = len(ids)
    x = w["token_embd.weight"][ids]
    hd = x.shape[-1] // n_head
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(meta["llama.block_count"]):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(T, n_head, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(T, n_kv, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
        k, v = (np.repeat(a, n_head // n_kv, axis=1) for a in (k, v))
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, -1)
        x = x + att @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", w["token_embd.weight"])  # tied when the GGUF has no output
    return rms(x[-1], w["output_norm.weight"]) @ out.T


# -- the embedded SmolLM2 --------------------------------------------------------------------

@pytest.mark.embedded
def test_smollm2_answers_paris(smol):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    text = generate(smol.module, smol.tokenizer, ids, max_tokens=20)  # greedy by default
    assert "Paris" in text, text


@pytest.mark.embedded
def test_smollm2_logits_match_reference_forward_pass(smol):
    meta, weights = read_gguf_raw(models.gguf_path())
    assert "output.weight" not in weights  # tied embeddings, as the converted config says
    assert smol.config["tie_word_embeddings"] is True
    ids = smol.tokenizer.encode("The quick brown fox jumps over the lazy dog. 2 + 2 =")
    ref = reference_logits(meta, weights, ids)
    got = np.array(smol.module(mx.array([ids]))[0, -1].astype(mx.float32), dtype=np.float64)
    assert smol.dtype == models.default_dtype() == smol.stored_dtype
    assert got.shape == ref.shape == (49152,)
    assert np.abs(got - ref).max() < tolerance(smol.dtype, deep=True), np.abs(got - ref).max()
    assert got.argmax() == ref.argmax()


@pytest.mark.embedded
def test_smollm2_folder_and_tokenizer(smol):
    tok = smol.tokenizer
    assert smol.name == "smollm2" and smol.arch == "llama" and smol.kind == "text"
    assert smol.num_layers == 30 and smol.context_length == 8192
    assert smol.path.name == f"smollm2-135m-instruct-{smol.dtype}"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "kvlab.json"} <= {p.name for p in smol.path.iterdir()}
    assert tok.eos_token_ids == {2} and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    # llama.cpp's smollm pre-tokenizer: every digit is its own token
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok.encode(special)) == 1
    for text in ("Hello, world!", "  two  spaces\n\ttab", "naïve café 東京 🙂", "x=12.5e-3;"):
        assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.embedded
def test_fingerprint_stable_across_processes(smol, tiny):
    home = folders.kvlab_home()
    assert _child("kv.load().fingerprint", home) == smol.fingerprint == kv.fingerprint(smol)
    assert _child("kv.load('tiny').fingerprint", home) == tiny.fingerprint
    assert smol.fingerprint != tiny.fingerprint
    assert len(smol.fingerprint) == 64 and int(smol.fingerprint, 16) >= 0


@pytest.mark.embedded
def test_interrupted_conversion_leaves_nothing_loadable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))

    def dies_halfway(path, arrays, metadata=None):
        with open(path, "wb") as fh:
            fh.write(b"\0" * 1000)
        raise OSError("simulated: disk full while writing weights")

    monkeypatch.setattr(mx, "save_safetensors", dies_halfway)
    with pytest.raises(OSError, match="simulated"):
        kv.load()
    assert _visible(tmp_path) == [".smollm2-135m-instruct-float32.lock"]  # no folder, no temp
    monkeypatch.undo()
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    assert "Paris" in generate(*_smol_parts(kv.load()), max_tokens=20)


@pytest.mark.embedded
def test_prepare_builds_once(tmp_path, monkeypatch, capsys, smol, tiny):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    folders = models.prepare()
    first = capsys.readouterr().out
    assert first.startswith("kvlab: smollm2 built in") and "tiny-hybrid built" in first
    assert folders["smollm2"].name == smol.path.name and folders["tiny"].name == tiny.path.name
    assert models.prepare() == folders
    assert "smollm2 ready" in capsys.readouterr().out


def _smol_parts(m):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    return m.module, m.tokenizer, m.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


# -- tiny models ----------------------------------------------------------------------------

def test_tiny_is_a_qwen3_with_the_qwen_tokenizer(tiny, qwen_tokenizer):
    assert tiny.arch == "qwen3" and tiny.dtype == "float32" and tiny.context_length == 4096
    assert tiny.config["vocab_size"] == len(qwen_tokenizer._tokenizer) == 151669
    assert tiny.module.model.embed_tokens.weight.dtype == mx.float32
    msgs = [{"role": "user", "content": "hello"}]
    ids = tiny.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == qwen_tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert "<think>" in tiny.tokenizer.chat_template
    logits = tiny.module(mx.array([ids]))[0, -1]
    # random but not degenerate: a spread of values and a clear argmax
    assert 0.5 < logits.std().item() < 10
    assert len(set(np.array(logits).round(3).tolist())) > 1000
    cache = tiny.make_cache()
    assert len(cache) == tiny.num_layers == 4 and can_trim_prompt_cache(cache)


def test_tiny_builds_identically_in_two_homes(tmp_path, monkeypatch, tiny):
    built = []
    for sub in ("a", "b"):
        monkeypatch.setenv("KVLAB_HOME", str(tmp_path / sub))
        m = kv.load("tiny")
        built.append((m.fingerprint, m.path.name, (m.path / "model.safetensors").read_bytes()))
    assert built[0] == built[1]
    assert built[0][0] == tiny.fingerprint  # and equal to the session's own build


def test_tiny_loads_fast_once_built(tiny):
    import time

    start = time.perf_counter()
    again = kv.load("tiny")
    assert time.perf_counter() - start < 10  # ~2s on an idle 2-core box, mostly the tokenizer
    assert again.fingerprint == tiny.fingerprint and again.path == tiny.path


def test_tiny_hybrid_cache_is_not_trimmable():
    m = kv.load("tiny-hybrid")
    kinds = [type(c).__name__ for c in m.make_cache()]
    assert m.arch == "lfm2" and kinds == ["ArraysCache", "KVCache", "ArraysCache", "KVCache"]
    assert not can_trim_prompt_cache(m.make_cache())
    logits = m.module(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 151669) and bool(mx.isfinite(logits).all())


def test_dtype_cast_changes_fingerprint(tiny):
    half = kv.load("tiny", dtype="bfloat16")
    assert half.dtype == "bfloat16" and half.module.model.embed_tokens.weight.dtype == mx.bfloat16
    assert half.fingerprint != tiny.fingerprint and half.path == tiny.path


def test_local_folder_fingerprint_matches_manifest(tiny, tmp_path):
    # a copy without kvlab.json is hashed from its bytes; same bytes -> same fingerprint
    copy = tmp_path / "my-model"
    shutil.copytree(tiny.path, copy, ignore=shutil.ignore_patterns("kvlab.json"))
    m = kv.load(copy)
    assert m.name == "my-model" and m.path == copy.resolve()
    assert m.fingerprint == tiny.fingerprint


def test_broken_or_stale_folders_are_rebuilt(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    folder = tmp_path / "models" / tiny.path.name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a half folder from an old, killed build
    stale = tmp_path / "models" / f".{tiny.path.name}.tmp-dead"
    stale.mkdir()
    assert kv.load("tiny").fingerprint == tiny.fingerprint
    assert not stale.exists()
    with open(folder / "model.safetensors", "r+b") as fh:  # truncated weights
        fh.truncate(100)
    assert kv.load("tiny").fingerprint == tiny.fingerprint
    manifest = json.loads((folder / "kvlab.json").read_text())
    size = (folder / "model.safetensors").stat().st_size
    assert manifest["weights_bytes"]["model.safetensors"] == size


def test_interrupted_tiny_build_leaves_nothing_loadable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))

    def dies(path, arrays, metadata=None):
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(mx, "save_safetensors", dies)
    with pytest.raises(KeyboardInterrupt):
        kv.load("tiny")
    assert all(name.endswith(".lock") for name in _visible(tmp_path))


def test_concurrent_builds_share_one_folder(tmp_path):
    env = dict(os.environ, KVLAB_HOME=str(tmp_path))
    code = "import kvlab as kv; print(kv.load('tiny').fingerprint)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0][-1] == outs[1][-1]
    folders = [n for n in _visible(tmp_path) if not n.endswith(".lock")]
    assert len(folders) == 1 and folders[0].startswith("tiny-qwen3-")  # no temp dirs left


# -- errors ---------------------------------------------------------------------------------

def test_unknown_name_and_missing_path(tmp_path, monkeypatch):
    with pytest.raises(kv.ModelNotFoundError, match="known names: smollm2, tiny, tiny-hybrid"):
        kv.load("llama-70b")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache, not the user's
    with pytest.raises(kv.ModelNotFoundError, match="never downloads"):
        kv.load("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id not in the cache is not fetched
    with pytest.raises(kv.ModelNotFoundError):
        kv.load(tmp_path / "nope")
    with pytest.raises(kv.ModelNotFoundError, match="config.json"):
        kv.load(tmp_path)  # exists, but is not a model folder


def test_bad_dtype():
    with pytest.raises(kv.KvlabError, match="float16, bfloat16, float32"):
        kv.load("tiny", dtype="int8")


def test_repr(tiny):
    text = repr(tiny)
    assert "\n" not in text and "qwen3" in text and tiny.fingerprint[:12] in text
    html = tiny._repr_html_()
    for field in ("arch", "layers", "params", "dtype", "context", "fingerprint", "path"):
        assert f">{field}<" in html


def test_deprecated_names_still_work_and_warn(tiny):
    """Renamed for clarity, kept for one release: Model.model (now Model.module) and kv.load_test
    (now kv.generate_load). Mutant caught: an alias without its warning."""
    with pytest.warns(FutureWarning, match="Model.model is deprecated"):
        assert tiny.model is tiny.module is tiny.net
    # the alias reaches generate_load, whose own argument check answers (no request is sent)
    with pytest.warns(FutureWarning, match="kv.load_test is deprecated"), \
            pytest.raises(kv.RequestError, match="pass concurrency=N"):
        kv.load_test("http://127.0.0.1:9", "multi_turn", num_requests=1)
