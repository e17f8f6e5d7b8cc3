"""Side virtual environments for peers kvlab compares against (vllm-mlx in ``.venv-peers``,
kvpress in ``.venv-kvpress``): each pins libraries kvlab's own environment cannot hold, so each
gets its own venv, made once with pip under a file lock and recorded in a stamp file.

Example:
    >>> side_venv_path(".venv-kvpress", "KVLAB_KVPRESS_VENV", "venv-kvpress")
    PosixPath('/work/kvlab/.venv-kvpress')
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from .errors import PeerError

STAMP = ".kvlab-peers-installed"


def side_venv_path(checkout_name: str, env_var: str, home_name: str) -> Path:
    """Where a side venv lives: ``$<env_var>``, else ``<checkout_name>`` in the repository checkout
    kvlab runs from, else ``$KVLAB_HOME/<home_name>``."""
    if os.environ.get(env_var):
        return Path(os.environ[env_var]).expanduser().resolve()
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").is_file():
        return repo / checkout_name
    from .models.loading import kvlab_home

    return kvlab_home() / home_name


def installed(path: Path, want: str) -> bool:
    """True when the venv at ``path`` has a Python and its stamp says ``want`` is installed."""
    stamp = path / STAMP
    return (path / "bin" / "python").exists() and stamp.is_file() and stamp.read_text() == want


def ensure_side_venv(path: Path, want: str, steps: Callable[[Path], list[list[str]]], *,
                     what: str, ready: Callable[[Path], bool] = lambda p: True,
                     quiet: bool = True) -> Path:
    """Make the venv at ``path`` hold ``want`` (a one-line description of what is installed, e.g.
    "kvpress==0.5.5 torch==2.13.0+cpu"): nothing runs when its stamp says so and ``ready(path)``;
    else the venv is created if missing and each command of ``steps(path)`` runs in order (pip
    installs, typically), then the stamp is written. Safe from several processes at once (a file
    lock). A failing step raises PeerError with its output's tail. ``steps`` may itself raise
    PeerError (e.g. when what it would install is not the build kvlab wants).

    Example:
        >>> ensure_side_venv(Path(".venv-x"), "six==1.16.0", lambda p: [pip_install(p, "six==1.16.0")],
        ...                  what="six")
        PosixPath('.venv-x')
    """
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if installed(path, want) and ready(path):
            return path
        if not quiet:
            print(f"kvlab: installing {what} into {path} (takes a minute or two)", file=sys.stderr)
        if not (path / "bin" / "python").exists():
            run_step([sys.executable, "-m", "venv", str(path)], path)
        for cmd in steps(path):
            run_step(cmd, path)
        (path / STAMP).write_text(want)
    return path


def pip_install(path: Path, *args: str) -> list[str]:
    """The command that pip-installs ``args`` into the venv at ``path``."""
    return [str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
            *args]


def run_step(cmd: list[str], path: Path) -> subprocess.CompletedProcess:
    """Run one install command; PeerError with the tail of its output if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PeerError(f"installing the venv {path} failed at `{' '.join(cmd[-3:])}` "
                        f"(exit {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}. "
                        f"Check network access to PyPI, or delete {path} and retry")
    return proc
