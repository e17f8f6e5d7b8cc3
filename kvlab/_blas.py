"""Load a fast BLAS before MLX on Linux.

The Linux mlx[cpu] wheel bundles netlib's reference BLAS (~5 GFLOP/s for float32 matmul).
Debian's OpenBLAS loaded into the process *before* ``mlx.core`` is imported makes it 40-50x
faster; loading it afterwards has no effect, so this module must run before anything imports MLX.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)

_state = {"loaded": None, "warned": False}


def openblas_path() -> str | None:
    """The first OpenBLAS library found on this machine, or None."""
    override = os.environ.get("KVLAB_BLAS")
    if override:
        return override if os.path.exists(override) else None
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def load_fast_blas() -> str | None:
    """Load OpenBLAS globally if on Linux, found, and MLX not yet imported. Returns its path."""
    if _state["loaded"] is not None or not sys.platform.startswith("linux"):
        return _state["loaded"]
    if os.environ.get("KVLAB_BLAS") == "off":
        return None
    path = openblas_path()
    if path is None or "mlx.core" in sys.modules:
        return None
    ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    _state["loaded"] = path
    return path


def fast_blas_active() -> bool:
    """True when MLX in this process runs on OpenBLAS (or not on Linux, where this does not apply)."""
    if not sys.platform.startswith("linux"):
        return True
    if _state["loaded"]:
        return True
    preload = os.environ.get("LD_PRELOAD", "")
    return "openblas" in preload


def slow_message() -> str:
    """The warning for MLX on the reference BLAS, with the fix (``kvlab.device`` says when it applies)."""
    why = ("mlx.core was imported before kvlab" if "mlx.core" in sys.modules and openblas_path()
           else "OpenBLAS is not installed")
    return (f"kvlab: MLX is using the reference BLAS ({why}); float32 matmuls run ~40x slower. "
            "Fix: `apt-get install libopenblas0-pthread` and `import kvlab` before mlx, "
            "or start Python with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3, "
            "or use the `kvlab` Jupyter kernel.")


def warn_once(message: str) -> None:
    """Warn with ``message`` the first time only. Whether it applies (Linux CPU, not CUDA or a
    Mac) is ``kvlab.device.warn_if_slow_blas``'s decision: this module must not import MLX."""
    if _state["warned"]:
        return
    _state["warned"] = True
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def env_with_fast_blas(env: dict | None = None) -> dict:
    """A copy of ``env`` that makes a child process preload OpenBLAS (for kernels and papermill)."""
    env = dict(os.environ if env is None else env)
    path = openblas_path()
    if path and sys.platform.startswith("linux") and path not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    return env
