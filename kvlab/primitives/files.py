"""Atomic writes: a file (or a folder) appears under its name complete, or not at all.

The content goes to a temporary sibling (the same folder, so the rename stays on one file system)
that is renamed onto the target only once writing succeeded. On any error the temporary is
removed and the target is left as it was; a killed process can leave a temporary behind (named
``.<name>.<random>.tmp`` unless ``prefix``/``suffix`` say otherwise) but never half a target.
Temporaries are created with the usual permissions (``0o666`` less the umask), not mkstemp's
private ``0o600``.

Example:
    >>> atomic_write("out/summary.md", "# done\\n")
    PosixPath('out/summary.md')
    >>> atomic_write_with("out/results.parquet", frame.write_parquet)
    PosixPath('out/results.parquet')
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Callable


def atomic_write(path, data: bytes | str, *, encoding: str = "utf-8", parents: bool = True) -> Path:
    """Write ``data`` (bytes, or text in ``encoding``) to ``path`` atomically; ``parents`` creates
    missing folders.

    Example:
        >>> atomic_write(tmp / "a.txt", "hello").read_text()
        'hello'
    """
    if isinstance(data, str):
        data = data.encode(encoding)
    return atomic_write_with(path, lambda tmp: tmp.write_bytes(data), parents=parents)


def atomic_write_with(path, write: Callable[[Path], object], *, folder: bool = False,
                      parents: bool = True, prefix: str | None = None, suffix: str = ".tmp") -> Path:
    """Call ``write(tmp)`` with a temporary sibling of ``path``, then rename it onto ``path``: for
    writers that want a path (``frame.write_parquet``, ``mx.save_safetensors``). With ``folder``
    the temporary is an empty folder for ``write`` to fill, and a folder already at ``path`` is
    moved aside and deleted first (that step is two renames, not one).

    Example:
        >>> atomic_write_with(tmp / "t.jsonl", frame.write_ndjson).name
        't.jsonl'
    """
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}." if prefix is None else prefix
    tmp = _reserve(path, folder, prefix, suffix)
    try:
        write(tmp)
        if folder and path.exists():
            aside = _reserve(path, True, f"{prefix}old-", "")
            os.replace(path, aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return path


def _reserve(path: Path, folder: bool, prefix: str, suffix: str) -> Path:
    """A new, empty file (or folder) next to ``path`` that no other writer can have chosen."""
    while True:
        tmp = path.with_name(f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            if folder:
                tmp.mkdir()
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
