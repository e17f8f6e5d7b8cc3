"""``kv.load``: any model kvlab runs, by name or folder — text models through
``kvlab.models.loading``, vision-language models through ``kvlab.vlm`` — so a notebook, the CLI
and ``kvlab serve`` accept the same names. It sits above both layers: kvlab.models never imports
kvlab.vlm (which builds on it).

Example:
    >>> kv.load("tiny").kind, kv.load("tiny-vlm:qwen3_5").kind
    ('text', 'vlm')
    >>> is_vlm_name("tiny-vlm:gemma4"), is_vlm_name("tiny")
    (True, False)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VLM_NAMES = ("tiny-vlm",)  # and "tiny-vlm:<arch>"


def is_vlm_name(name) -> bool:
    """Whether ``name`` names a vision-language model: ``tiny-vlm``, ``tiny-vlm:<arch>`` or a local
    folder whose config.json has a ``vision_config`` (an mlx-vlm folder)."""
    key = os.fspath(name)
    if key in VLM_NAMES or key.startswith("tiny-vlm:"):
        return True
    config = Path(key).expanduser() / "config.json"
    try:
        return config.is_file() and "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load(name_or_path: str | os.PathLike = "smollm2", *, dtype: str | None = None):
    """A VLM name or folder through ``kv.load_vlm`` (``kvlab.vlm``), anything else through
    ``kvlab.models.loading.load`` ("smollm2", "tiny", "tiny:<model_type>", an mlx-lm folder, a
    repo id in the local Hugging Face cache). Never downloads."""
    if is_vlm_name(name_or_path):
        from .vlm import load_vlm

        return load_vlm(name_or_path, dtype=dtype)
    from .models.loading import load as load_text

    return load_text(name_or_path, dtype=dtype)


def model_folder(model) -> Path:
    """The model folder of a kvlab model name, a loaded kvlab model, or a folder path (what a peer
    in another environment loads: vllm-mlx, kvpress's transformers).

    Example:
        >>> (model_folder("tiny") / "config.json").is_file()
        True
    """
    if hasattr(model, "path"):
        return Path(model.path)
    p = Path(os.fspath(model)).expanduser()
    if p.is_dir():
        return p.resolve()
    return Path(load(os.fspath(model)).path)
