"""The peers' virtual environment, ``.venv-peers``: vllm-mlx 0.6.0 pins mlx-lm below 0.32, so it
cannot share kvlab's environment. Its mlx-lm follows the MLX backend kvlab's own environment runs
(mlx-cpu and mlx-cuda both ship ``mlx/lib/libmlx.so``: a CUDA machine must not get mlx[cpu])."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import PeerError  # noqa: F401  (its home is kvlab.errors; kept importable from here)
from ..venvs import ensure_side_venv, pip_install, side_venv_path

VLLM_MLX = "vllm-mlx==0.6.0"
VLLM_MLX_LM = "mlx-lm{extra}==0.31.3"
VLLM_MLX_DEPS = ("fastapi", "starlette", "uvicorn", "psutil",
                 "prometheus-client", "jsonschema", "pillow", "tqdm", "requests", "tabulate", "pytz",
                 "python-multipart")

# mlx-lm 0.31.3's extras per backend wheel (mlx[cuda] is mlx-cuda-12)
_BACKEND_EXTRAS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda12", "mlx-cuda-13": "cuda13"}


def peer_mlx_lm_requirement() -> str:
    """The mlx-lm requirement for the peers' venv, on the MLX backend kvlab's own environment runs:
    mlx-cpu and mlx-cuda both ship ``mlx/lib/libmlx.so``, so a CUDA machine must not get mlx[cpu].
    ``$KVLAB_BACKEND`` (cpu, cuda) decides first; macOS needs no extra (plain mlx is Metal).

    Example:
        >>> peer_mlx_lm_requirement()          # on Linux with mlx[cpu] installed
        'mlx-lm[cpu]==0.31.3'
    """
    from importlib import metadata

    if sys.platform == "darwin":
        return VLLM_MLX_LM.format(extra="")
    wanted = os.environ.get("KVLAB_BACKEND", "")
    if wanted:
        extras = {"cpu": "cpu", "cuda": "cuda12"}
        if wanted not in extras:
            raise PeerError(f"KVLAB_BACKEND={wanted!r}: on Linux the MLX backend is 'cpu' or 'cuda'")
        return VLLM_MLX_LM.format(extra=f"[{extras[wanted]}]")
    for dist, extra in _BACKEND_EXTRAS.items():
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return VLLM_MLX_LM.format(extra=f"[{extra}]")
    return VLLM_MLX_LM.format(extra="[cpu]")


def peers_venv() -> Path:
    """Where the peers' virtual environment lives: ``$KVLAB_PEERS_VENV``, else ``.venv-peers`` in the
    repository checkout kvlab runs from, else ``$KVLAB_HOME/venv-peers``."""
    return side_venv_path(".venv-peers", "KVLAB_PEERS_VENV", "venv-peers")


def ensure_peers_venv(path=None, *, quiet: bool = True) -> Path:
    """Create the peers' venv with vllm-mlx installed (``--no-deps``, then the packages its server
    imports); idempotent (a stamp file names what is installed) and safe to call from several
    processes at once (a file lock). Returns the venv's path.

    Example:
        >>> ensure_peers_venv()
        PosixPath('/work/kvlab/.venv-peers')
    """
    path = Path(path) if path is not None else peers_venv()
    deps = (peer_mlx_lm_requirement(), *VLLM_MLX_DEPS)
    return ensure_side_venv(path, " ".join((VLLM_MLX, *deps)),
                            lambda p: [pip_install(p, "--no-deps", VLLM_MLX), pip_install(p, *deps)],
                            what=VLLM_MLX, ready=lambda p: (p / "bin" / "vllm-mlx").exists(), quiet=quiet)
