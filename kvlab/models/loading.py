"""Load a model: the embedded SmolLM2, a tiny random-weight model, a local mlx-lm folder or a
Hugging Face cache repo id, in its stored dtype unless asked (``kvlab.models.dtypes``).

    import kvlab as kv
    m = kv.load()                  # SmolLM2-135M-Instruct, converted once into $KVLAB_HOME
    t = kv.load("tiny")            # random-weight qwen3 with the real Qwen3 tokenizer
    o = kv.load("mlx-community/SmolLM2-135M-Instruct-bf16")   # from the local HF cache, offline
    m.fingerprint[:12], m.context_length, m.make_cache()
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from . import attention, gguf, hub  # noqa: E402
from .dtypes import DTYPES, cast, check_dtype, choose, default_dtype, stored_dtype  # noqa: E402,F401
from ..errors import ModelNotFoundError  # noqa: E402
from .folders import (TOKENIZER_FILES, digest_files, ensure_folder,  # noqa: E402
                      kvlab_home, read_manifest, sha256_json)
from ..primitives import timing  # noqa: E402
from ..primitives.display import table_html  # noqa: E402
from ..primitives.layout import CacheLayout  # noqa: E402
from ..primitives.tokens import Tokens, check_ids, tokenise_text, vocab_limit  # noqa: E402
# qwen_tokenizer(_dir) and tiny_config stay importable from here
from .families import MODEL_TYPES, PREFIX, ensure_family, is_family_name  # noqa: E402
from .tiny import ensure_tiny, qwen_tokenizer, qwen_tokenizer_dir, tiny_config  # noqa: E402,F401

NAMES = ("smollm2", "tiny", "tiny-hybrid")
_HOW = ("pass a local mlx-lm model folder (config.json + *.safetensors, e.g. one made by "
        "`mlx_lm.convert`) or one of the known names: " + ", ".join(NAMES) +
        ", tiny:<model_type> (a tiny model of any cache family: " +
        ", ".join(PREFIX + t for t in MODEL_TYPES) + "), or an \"org/name\" repo id in the local "
        "Hugging Face cache; kvlab never downloads models")


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded mlx-lm model with its tokenizer and a content fingerprint.

        >>> m = kv.load("tiny"); m.arch, m.dtype, len(m.make_cache())
        ('qwen3', 'float32', 4)
    """

    name: str
    module: Any           # the loaded mlx-lm nn.Module (``net`` is what runs ids: the same, for text)
    tokenizer: Any        # mlx_lm.tokenizer_utils.TokenizerWrapper
    fingerprint: str      # sha256 hex over config, weights and tokenizer files
    path: Path
    config: dict
    dtype: str            # what it runs in
    context_length: int
    kind: str = "text"
    stored_dtype: str = dataclasses.field(default="", kw_only=True)  # what its folder holds
    dtype_note: str = dataclasses.field(default="", kw_only=True)    # why it runs in ``dtype``
    # sha256 over config, weights (or the source they were built from) and tokenizer, without the
    # dtype: equal for one model in two dtypes, so a snapshot refusal can say "another dtype"
    content_fingerprint: str = dataclasses.field(default="", kw_only=True)

    @property
    def arch(self) -> str:
        return self.config.get("model_type", "?")

    @property
    def num_layers(self) -> int:
        return len(self.module.layers)

    @functools.cached_property  # writes the instance __dict__ directly, so frozen is fine
    def num_params(self) -> int:
        from mlx_lm.utils import get_total_parameters

        return get_total_parameters(self.module)

    @property
    def net(self):
        """The mlx-lm module that runs ids: ``net(ids[1, L], cache=...) -> logits``."""
        return self.module

    @property
    def model(self):
        """Deprecated: ``module`` (the loaded mlx-lm module) or ``net`` (what runs ids)."""
        warnings.warn("Model.model is deprecated: use Model.module (the mlx-lm module) or Model.net "
                      "(what runs ids)", FutureWarning, stacklevel=2)
        return self.module

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: the token ids this model can run, [0, vocab_size)."""
        for cfg in (self.config, self.config.get("text_config") or {}):
            if isinstance(cfg.get("vocab_size"), int):
                return cfg["vocab_size"]
        return vocab_limit(self.tokenizer)

    def make_cache(self) -> list:
        """A fresh mlx-lm prompt cache (one entry per layer)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.module)

    @functools.cached_property
    def layout(self) -> CacheLayout:
        """What each layer's cache is and what it can do (``kvlab.primitives.layout``), read once
        from mlx-lm's own cache objects for this model."""
        return CacheLayout.of(self.make_cache(), self.num_layers)

    def tokenise(self, messages_or_text, *, add_generation_prompt: bool = True, **template_kwargs) -> Tokens:
        """The conversation (or text, or token ids) as ``Tokens``; ids outside the vocabulary raise
        TokenIdError. ``kv.tokenise(model, x)`` calls this."""
        toks = tokenise_text(self.tokenizer, messages_or_text,
                             add_generation_prompt=add_generation_prompt, **template_kwargs)
        self.check_ids(toks.ids)
        return toks

    def check_ids(self, ids, what: str = "token ids") -> tuple[int, ...]:
        """``ids`` as ints, or TokenIdError naming the first one outside ``[0, vocab_size)``."""
        return check_ids(ids, self.vocab_size, what)

    def for_request(self, tokens: Tokens):
        """The net that runs this request's ids (``net(ids[1, L], cache=...) -> logits``): a text
        model's own net; a VLM's net bound to the request's images (kv.VLModel)."""
        return self.net

    def _fields(self) -> dict:
        return {"name": self.name, "arch": self.arch, "layers": self.num_layers,
                "params": f"{self.num_params / 1e6:.1f}M", "dtype": self.dtype_label,
                "context": self.context_length, "fingerprint": self.fingerprint[:12],
                "path": str(self.path)}

    @property
    def dtype_label(self) -> str:
        """The dtype and why, e.g. "float32 (built for CPU speed)"."""
        return f"{self.dtype} ({self.dtype_note})" if self.dtype_note else self.dtype

    def __repr__(self) -> str:
        f = self._fields()
        return (f"{type(self).__name__}({f['name']!r}, {f['arch']}, {f['layers']} layers, {f['params']} "
                f"params, {f['dtype']}, context {f['context']}, fingerprint {f['fingerprint']})")

    def _repr_html_(self) -> str:
        return table_html(None, self._fields().items(), row_headers=True,
                          caption=f"kvlab {type(self).__name__}")


def fingerprint(model: Model) -> str:
    """The model's fingerprint (stable across processes), e.g. to key caches and snapshots.

        >>> kv.fingerprint(kv.load("tiny")) == kv.load("tiny").fingerprint
        True
    """
    if not isinstance(model, Model):
        raise TypeError("fingerprint() takes a kvlab Model (from kv.load), "
                        f"not {type(model).__name__}")
    return model.fingerprint


def load(name_or_path: str | os.PathLike = "smollm2", *, dtype: str | None = None) -> Model:
    """Load "smollm2" (default), "tiny", "tiny-hybrid", "tiny:<model_type>" (a tiny model of any
    cache family: ``kvlab.models.families``), a local mlx-lm folder, or an "org/name" repo id from the local Hugging Face cache (``kvlab.models.hub``). Never downloads.

    ``dtype=None`` keeps the stored dtype on every platform (the tiny models are stored in float32);
    smollm2 is built from its 4-bit GGUF in ``default_dtype()`` (float32 on Linux CPU, for speed).
    Another ``dtype`` casts, and the repr says so.

        >>> kv.load("tiny").arch, kv.load("tiny", dtype="bfloat16").dtype
        ('qwen3', 'bfloat16')
    """
    check_dtype(dtype)
    key = os.fspath(name_or_path)
    if key == "smollm2":
        built = dtype or default_dtype()
        return _load_folder(_ensure_smollm2(built), "smollm2", dtype, built=True)
    if key in ("tiny", "tiny-hybrid"):
        return _load_folder(ensure_tiny(key == "tiny-hybrid"), key, dtype)
    if is_family_name(key):
        return _load_folder(ensure_family(key), key, dtype)
    if key == "tiny-vlm" or key.startswith("tiny-vlm:"):
        raise ModelNotFoundError(f"{key!r} is a vision-language model: load it with kv.load (kvlab.loader) "
                                 "or kv.load_vlm; kvlab.models.loading loads text models only")
    path = Path(key).expanduser().resolve()
    name = path.name
    if not path.is_dir() and hub.is_repo_id(key):
        path, name = hub.resolve(key).resolve(), key
    elif not path.is_dir():
        raise ModelNotFoundError(f"{key!r} is neither a known model name nor a local folder: "
                                 f"{_HOW}")
    if not (path / "config.json").is_file() or not list(path.glob("model*.safetensors")):
        raise ModelNotFoundError(f"{path} is not an mlx-lm model folder (it needs config.json and "
                                 f"model*.safetensors): {_HOW}")
    # a snapshot folder of the HF cache is named by its repo id, not its commit hash
    return _load_folder(path, hub.repo_id_of(Path(key).expanduser()) or name, dtype)


def gguf_path() -> Path:
    """The embedded SmolLM2 GGUF (see kvlab.models.gguf)."""
    return gguf.gguf_path()


convert_gguf = gguf.convert_gguf


def prepare(dtype: str | None = None) -> dict[str, Path]:
    """Convert/build the embedded and tiny models now (e.g. before tests); print one summary line.

        >>> prepare()   # kvlab: smollm2 built in 4.1s, tiny built in 1.4s, tiny-hybrid ...
    """
    t0, done, folders = timing.timed(), [], {}
    for name, ensure in (("smollm2", lambda: _ensure_smollm2(dtype or default_dtype(), True)),
                         ("tiny", lambda: ensure_tiny(False, True)),
                         ("tiny-hybrid", lambda: ensure_tiny(True, True))):
        start = timing.timed()
        folders[name], built = ensure()
        done.append(f"{name} {'built' if built else 'ready'} in {start.done():.1f}s")
    total = t0.done()
    print(f"kvlab: {', '.join(done)} ({total:.1f}s) -> {kvlab_home() / 'models'}")
    return folders


# -- building folders ----------------------------------------------------------------------------

def _ensure_smollm2(dtype: str, with_status: bool = False):
    source = gguf.gguf_path()
    expect = {"name": "smollm2", "builder": f"gguf-{gguf.CONVERTER_VERSION}", "dtype": dtype,
              "source": {"file": source.name, "bytes": source.stat().st_size}}
    folder = kvlab_home() / "models" / f"smollm2-135m-instruct-{dtype}"
    result = ensure_folder(folder, expect, lambda tmp: gguf.convert_gguf(source, tmp, dtype))
    return result if with_status else result[0]


# -- loading and fingerprints --------------------------------------------------------------------

def _load_folder(folder: Path, name: str, dtype: str | None, *, built: bool = False) -> Model:
    """``dtype``: what the user asked for (None: the stored dtype); ``built``: kvlab built the
    folder in the dtype it chose (``kvlab.models.dtypes.choose``)."""
    import mlx_lm

    try:
        model, tokenizer = mlx_lm.load(str(folder))  # an existing local folder: never the hub
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelNotFoundError(f"mlx-lm cannot load {folder}: {e}. {_HOW}") from e
    stored = stored_dtype(model)
    dtype, note = choose(stored, dtype, built=built)
    cast(model, dtype)
    materialise(model)
    attention.install()
    config = json.loads((folder / "config.json").read_text())
    manifest = read_manifest(folder)
    if manifest:
        weights, tok = manifest["weights_sha256"], manifest["tokenizer_sha256"]
    else:
        weights = digest_files(folder, sorted(p.name for p in folder.glob("model*.safetensors")))
        tok = digest_files(folder, TOKENIZER_FILES)
    fp = sha256_json({"config": config, "weights": weights, "tokenizer": tok, "dtype": dtype})
    # the dtype-free identity: a built folder's source (one GGUF, any dtype), else its weights
    plain = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    origin = (manifest or {}).get("source") or weights
    content = sha256_json({"config": plain, "weights": origin, "tokenizer": tok})
    context = context_length_of(config, tokenizer)
    return Model(name, model, tokenizer, fp, folder, config, dtype, context, stored_dtype=stored,
                 dtype_note=note, content_fingerprint=content)


def materialise(model) -> None:
    """Evaluate every array the model holds, private ones included (a RoPE's ``_freqs`` is not a
    parameter). MLX streams belong to the thread that made them: an array left lazy here cannot be
    evaluated by mlx-lm's generation thread ("There is no Stream(cpu, 0) in current thread")."""
    held = model.filter_and_map(lambda m, k, v: isinstance(v, (dict, list, mx.array)))
    mx.eval([a for _, a in tree_flatten(held) if isinstance(a, mx.array)])


def context_length_of(config: dict, tokenizer) -> int:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions",
                    "n_ctx", "context_length"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    limit = getattr(tokenizer, "model_max_length", 0)
    return limit if isinstance(limit, int) and limit < 10**9 else 0  # 0: unknown
