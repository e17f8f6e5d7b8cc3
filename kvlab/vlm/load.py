"""load_vlm(): "tiny" (qwen2_vl), "tiny:<arch>" (a tiny VLM of qwen2_vl, qwen3_5 or gemma4) or a
local mlx-vlm folder of a supported architecture as a kvlab VLModel. Never downloads.
``kv.load("tiny-vlm:<arch>")`` routes here.

Example:
    >>> kv.load_vlm("tiny")
    VLModel('tiny-vlm', qwen2_vl, 4 layers, ...)
    >>> kv.load_vlm("tiny:qwen3_5").layout.summary()                    # doctest: +SKIP
    '2 x recurrent state (ArraysCache), 2 x full-attention KV'
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from pathlib import Path

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

from ..errors import ModelNotFoundError, VLMUnavailableError  # noqa: E402
from ..models.folders import TOKENIZER_FILES, digest_files, read_manifest, sha256_json  # noqa: E402
from ..models.dtypes import cast, check_dtype, choose, stored_dtype  # noqa: E402
from ..models import attention  # noqa: E402
from ..models.loading import context_length_of, materialise  # noqa: E402
from .archs import SUPPORTED_ARCHS, adapter_for  # noqa: E402
from .build import PROCESSOR_FILES, ensure_tiny_vlm  # noqa: E402
from .model import VLModel  # noqa: E402
from .tiny_archs import ensure_tiny_arch  # noqa: E402

TINY_PREFIXES = ("tiny:", "tiny-vlm:")
HOW = ("pass \"tiny\", \"tiny:<arch>\" (" + ", ".join(SUPPORTED_ARCHS) + ") or a local mlx-vlm folder "
       "of one of those architectures (config.json with a vision_config, *.safetensors, tokenizer and "
       "preprocessor_config.json); kvlab never downloads models")


def require_mlx_vlm() -> None:
    """VLMUnavailableError (saying what to install) unless mlx-vlm imports."""
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as e:
        raise VLMUnavailableError("kvlab's VLM support needs mlx-vlm: pip install 'kvlab[vlm]' "
                                  f"(mlx-vlm and pillow); import failed: {e}") from e


def load_vlm(name_or_path: str | os.PathLike = "tiny", *, dtype: str | None = None) -> VLModel:
    """Load "tiny" (a deterministic random-weight qwen2_vl, built offline into $KVLAB_HOME),
    "tiny:<arch>" / "tiny-vlm:<arch>" (the tiny VLM of qwen2_vl, qwen3_5 or gemma4:
    ``kvlab.vlm.tiny_archs``) or a local mlx-vlm folder of one of those. Never downloads.

    Example:
        >>> vlm = kv.load_vlm("tiny"); vlm
        VLModel('tiny-vlm', qwen2_vl, 4 layers, ...)
    """
    require_mlx_vlm()
    check_dtype(dtype)
    key = os.fspath(name_or_path)
    if key in ("tiny", "tiny-vlm"):
        return load_folder(ensure_tiny_vlm(), "tiny-vlm", dtype)
    if key.startswith(TINY_PREFIXES):
        arch = key.split(":", 1)[1]
        if arch not in SUPPORTED_ARCHS:
            raise ModelNotFoundError(f"no tiny VLM {key!r}: kvlab builds "
                                     + ", ".join(f"tiny-vlm:{a}" for a in SUPPORTED_ARCHS))
        if arch == "qwen2_vl":
            return load_folder(ensure_tiny_vlm(), "tiny-vlm", dtype)
        return load_folder(ensure_tiny_arch(arch), f"tiny-vlm:{arch}", dtype)
    path = Path(key).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"{key!r} is neither \"tiny\" nor a local folder: {HOW}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"{path} has no readable config.json ({e}): {HOW}") from e
    if "vision_config" not in config or not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} is not an mlx-vlm model folder (it needs a config.json with "
                                 f"a vision_config and *.safetensors): {HOW}")
    return load_folder(path.resolve(), path.name, dtype)


def load_folder(folder: Path, name: str, dtype: str | None) -> VLModel:
    """A VLModel from an existing local mlx-vlm folder (``dtype=None``: the stored dtype; another
    casts, and the repr says so: ``kvlab.models.dtypes``)."""
    import mlx_vlm
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    config = json.loads((folder / "config.json").read_text())
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"{folder} is a {arch!r} model; kvlab's image prefill supports "
                                 f"{', '.join(SUPPORTED_ARCHS)} (image features, positions and the "
                                 "language-model call are architecture-specific: kvlab.vlm.archs)")
    adapter_for(arch)
    try:
        with quiet_tiny_build(name):
            model, processor = mlx_vlm.load(str(folder))  # an existing local folder: never the hub
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ModelNotFoundError(f"mlx-vlm cannot load {folder}: {e}. {HOW}") from e
    stored = stored_dtype(model)
    dtype, note = choose(stored, dtype)
    cast(model, dtype)
    attention.install()
    materialise(model)  # served from mlx-lm's generation thread: nothing may stay lazy here
    hf = processor.tokenizer
    if not getattr(hf, "chat_template", None):
        raise ModelNotFoundError(f"{folder} has no chat template (chat_template.json or "
                                 "tokenizer_config.json): kvlab needs it to place image tokens")
    eos = config.get("eos_token_id")
    tokenizer = TokenizerWrapper(hf, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    manifest = read_manifest(folder)
    weights = (manifest["weights_sha256"] if manifest else
               digest_files(folder, sorted(p.name for p in folder.glob("*.safetensors"))))
    files = digest_files(folder, TOKENIZER_FILES + PROCESSOR_FILES)
    fp = sha256_json({"config": config, "weights": weights, "files": files, "dtype": dtype})
    return VLModel(name, model, tokenizer, fp, folder, config, dtype,
                   context_length_of(config, hf), "vlm", processor, stored_dtype=stored, dtype_note=note)


@contextlib.contextmanager
def quiet_tiny_build(name: str):
    """Silence what mlx-vlm says about a kvlab tiny VLM it loads (the tiny gemma4 has no audio tower
    and its config no audio: "Checkpoint has no weights for module(s): audio_tower", a mel-filter
    warning from the unused audio feature extractor); a user's own folder keeps every message."""
    if not name.startswith("tiny-vlm"):
        yield
        return
    root = logging.getLogger()  # mlx-vlm logs through logging.warning, the root logger

    def not_audio(record) -> bool:
        return not record.getMessage().startswith("Checkpoint has no weights for module(s): audio_tower")

    root.addFilter(not_audio)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="At least one mel filter has all zero values")
            yield
    finally:
        root.removeFilter(not_audio)
