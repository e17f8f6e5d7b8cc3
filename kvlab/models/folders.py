"""Model folders kvlab builds once: where they live, how a finished one is recognised (a manifest
written last, then an atomic rename), and the content digests that fingerprint them.

Example:
    >>> kvlab_home().name
    'kvlab'
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock

from ..primitives import timing
from ..primitives.files import atomic_write_with

MANIFEST = "kvlab.json"
MANIFEST_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


def kvlab_home() -> Path:
    """Where kvlab keeps converted models: $KVLAB_HOME, default ~/.cache/kvlab."""
    return Path(os.environ.get("KVLAB_HOME") or "~/.cache/kvlab").expanduser().resolve()


def ensure_folder(folder: Path, expect: dict, build) -> tuple[Path, bool]:
    """Build `folder` once: in a temp sibling, manifest written last, then renamed into place
    (``kvlab.primitives.files.atomic_write_with``)."""
    if read_manifest(folder, expect):
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.parent / f".{folder.name}.lock"):
        if read_manifest(folder, expect):  # another process built it while we waited
            return folder, False
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

        def build_with_manifest(tmp: Path) -> None:
            start = timing.timed()
            build(tmp)
            weights = sorted(tmp.glob("model*.safetensors"))
            manifest = {"kvlab_manifest": MANIFEST_VERSION, **expect,
                        "weights_sha256": digest_files(tmp, [w.name for w in weights]),
                        "weights_bytes": {w.name: w.stat().st_size for w in weights},
                        "tokenizer_sha256": digest_files(tmp, TOKENIZER_FILES),
                        "build_seconds": round(start.done(), 2)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

        # an invalid leftover at `folder` (an older builder's) is moved aside and deleted
        atomic_write_with(folder, build_with_manifest, folder=True, prefix=f".{folder.name}.tmp-",
                          suffix="")
    return folder, True


def read_manifest(folder: Path, expect: dict | None = None) -> dict | None:
    """The folder's manifest if it is complete (and matches `expect`), else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        sizes = {n: (folder / n).stat().st_size for n in manifest["weights_bytes"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if manifest.get("kvlab_manifest") != MANIFEST_VERSION or sizes != manifest["weights_bytes"]:
        return None
    if expect and any(manifest.get(k) != v for k, v in expect.items()):
        return None
    return manifest


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def digest_files(folder: Path, names) -> str:
    """sha256 over (name, sha256 of bytes) of those `names` present in `folder`, streamed."""
    outer = hashlib.sha256()
    for name in sorted(names):
        path = Path(folder) / name
        if not path.is_file():
            continue
        inner = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                inner.update(chunk)
        outer.update(f"{name}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()
