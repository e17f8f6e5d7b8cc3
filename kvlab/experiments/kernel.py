"""The `kvlab` Jupyter kernel: this Python, with OpenBLAS preloaded before MLX.

On Linux the mlx[cpu] wheel's reference BLAS is ~40x slower than OpenBLAS, and OpenBLAS only helps
when it is loaded before ``mlx.core``. A kernel spec whose ``env`` sets ``LD_PRELOAD`` makes every
notebook (and every papermill run) fast even if a cell imports mlx before kvlab.

The spec also declares CurveZMQ support when this ipykernel and libzmq have it, so the runner can
ask jupyter_client for encrypted kernel channels (:func:`manager_config`): the kernel then has no
reason to warn that it "is running over TCP without encryption" on every run.

Example:
    >>> from kvlab.experiments.kernel import install_kernelspec
    >>> install_kernelspec(prefix=sys.prefix)      # `kvlab prepare` does this
    '/work/main/.venv/share/jupyter/kernels/kvlab'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

from .. import _blas

KERNEL_NAME = "kvlab"
DISPLAY_NAME = "Python (kvlab)"


def kernel_spec() -> dict:
    """The kernel.json kvlab installs: this interpreter, ipykernel, OpenBLAS preloaded when found."""
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "metadata": {"debugger": True, "kvlab": True},
    }
    if curve_supported():
        spec["metadata"]["supported_encryption"] = ["curve"]
    blas = _blas.openblas_path() if sys.platform.startswith("linux") else None
    if blas:
        spec["env"] = {"LD_PRELOAD": blas}
    return spec


def curve_supported() -> bool:
    """True when libzmq has CurveZMQ and this ipykernel reads Curve keys from its connection file.

    Example:
        >>> curve_supported()
        True
    """
    try:
        import zmq
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return False
    return bool(zmq.has("curve")) and "curve_secretkey" in IPKernelApp.class_trait_names()


def manager_config() -> dict:
    """Keyword arguments for papermill/nbclient: encrypted kernel channels where the kernel spec
    declares support (jupyter_client >= 8.10 provisions the Curve keys); empty otherwise.

    Example:
        >>> papermill.execute_notebook(src, out, kernel_name="kvlab", **manager_config())
    """
    from jupyter_client.manager import KernelManager

    if not curve_supported() or "transport_encryption" not in KernelManager.class_trait_names():
        return {}
    from traitlets.config import Config

    return {"config": Config({"KernelManager": {"transport_encryption": "auto"}})}


def install_kernelspec(prefix: str | None = None, *, user: bool = False,
                       name: str = KERNEL_NAME) -> str:
    """Register the kernel inside this environment (``prefix`` defaults to ``sys.prefix``, i.e. the
    venv; ``user=True`` installs it for the user instead). Returns its folder.

    Idempotent: reinstalling overwrites the previous spec of the same name.

    Example:
        >>> install_kernelspec(prefix=sys.prefix)
    """
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / name
        folder.mkdir()
        (folder / "kernel.json").write_text(json.dumps(kernel_spec(), indent=2))
        return KernelSpecManager().install_kernel_spec(
            str(folder), name, user=user, prefix=None if user else (prefix or sys.prefix))


def installed_spec(name: str = KERNEL_NAME) -> dict | None:
    """The installed kernel.json of ``name``, or None when Jupyter does not find it."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        folder = KernelSpecManager().get_kernel_spec(name).resource_dir
    except NoSuchKernel:
        return None
    try:
        return json.loads((Path(folder) / "kernel.json").read_text())
    except (OSError, ValueError):
        return None


def is_current(name: str = KERNEL_NAME) -> bool:
    """True when ``name`` is installed and runs this interpreter with this machine's preload."""
    spec = installed_spec(name)
    want = kernel_spec()
    if not spec or not spec.get("argv") or spec.get("env", {}) != want.get("env", {}):
        return False
    if spec.get("metadata", {}).get("supported_encryption") != want["metadata"].get("supported_encryption"):
        return False
    # .venv/bin/python and .venv/bin/python3 are the same interpreter in the same environment
    have, exe = Path(spec["argv"][0]), Path(sys.executable)
    same = have.parent == exe.parent and os.path.realpath(have) == os.path.realpath(exe)
    return same and spec["argv"][1:] == want["argv"][1:]


def ensure_kernelspec(name: str = KERNEL_NAME) -> str | None:
    """The kvlab kernel's name, installing or refreshing it under ``sys.prefix`` when needed.

    Returns None when it cannot be installed (read-only prefix); callers then fall back to the
    current Python with :func:`kvlab._blas.env_with_fast_blas` in the environment.
    """
    if is_current(name):
        return name
    try:
        with FileLock(Path(sys.prefix) / ".kvlab-kernelspec.lock"):  # parallel runs (pytest -n, sweeps) must not install at once
            if not is_current(name):
                install_kernelspec(prefix=sys.prefix, name=name)
    except OSError:
        return None
    return name if is_current(name) else None


def launch_env(env: dict | None = None) -> dict:
    """Environment for a child process (kernel, papermill, worker) with OpenBLAS preloaded."""
    return _blas.env_with_fast_blas(env if env is not None else dict(os.environ))
