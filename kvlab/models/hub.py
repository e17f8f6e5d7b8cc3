"""Hugging Face cache repo ids: ``kv.load("mlx-community/<repo>")`` finds the model in the local
Hugging Face cache, offline, and never downloads. The cache folder is ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; huggingface_hub's own offline lookup reads it
when installed (``snapshot_download(local_files_only=True)``), else its layout is read here
(``models--org--name/refs/main`` names the commit under ``snapshots/``).

Example:
    >>> resolve("mlx-community/SmolLM2-135M-Instruct-bf16")
    PosixPath('/root/.cache/huggingface/hub/models--mlx-community--SmolLM2-135M-Instruct-bf16/snapshots/...')
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import ModelNotFoundError

# "org/name" as the Hub spells repo ids: no leading ".", "~" or "/", exactly one slash
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def is_repo_id(text: str) -> bool:
    """True for "org/name" (which ``kv.load`` looks up in the Hugging Face cache)."""
    return bool(REPO_ID.match(text)) and ".." not in text


def hub_cache() -> Path:
    """The Hugging Face cache folder: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return Path(home).expanduser() / "hub"


def resolve(repo_id: str) -> Path:
    """The cached snapshot folder of ``repo_id`` (its ``main`` revision), or ModelNotFoundError
    naming the cache folder looked in and how to download the model. Never downloads."""
    cache = hub_cache()
    folder = _lookup(repo_id, cache)
    if folder is None or not folder.is_dir():
        raise ModelNotFoundError(
            f"{repo_id!r} is neither a local folder nor in the local Hugging Face cache (looked in {cache / repo_folder(repo_id)}; "
            "the cache is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub). kvlab never "
            f"downloads models: download it first with `huggingface-cli download {repo_id}` (or "
            "`hf download`), or pass a local mlx-lm folder")
    return folder


def repo_folder(repo_id: str) -> str:
    """The cache's folder name for a model repo: "models--org--name"."""
    return "models--" + repo_id.replace("/", "--")


def repo_id_of(path: Path) -> str | None:
    """"org/name" when ``path`` is a snapshot folder of the Hugging Face cache, else None."""
    m = SNAPSHOT.search(Path(path).as_posix())
    return f"{m['org']}/{m['name']}" if m else None


def _lookup(repo_id: str, cache: Path) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return _read_layout(repo_id, cache)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _read_layout(repo_id: str, cache: Path) -> Path | None:
    repo = cache / repo_folder(repo_id)
    try:
        commit = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    return repo / "snapshots" / commit
