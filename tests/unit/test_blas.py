"""The fast-BLAS path on Linux: loaded before MLX by `import kvlab`, and a single warning otherwise."""

import subprocess
import sys

import pytest

from kvlab import _blas


def linux_with_openblas(test):
    """Linux only (a platform skip elsewhere: macOS runs Accelerate/Metal, no OpenBLAS); on Linux a
    missing OpenBLAS is a setup failure under strict mode (scripts/setup.sh installs it)."""
    test = pytest.mark.skipif(sys.platform.startswith("linux") and _blas.openblas_path() is None,
                              reason="needs Debian's libopenblas0-pthread (make test installs it)")(test)
    return pytest.mark.skipif(not sys.platform.startswith("linux"),
                              reason="platform: Linux only (OpenBLAS; macOS uses Accelerate)")(test)


def run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVLAB_BLAS")}
    full.update(env)
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                          env=full, check=True)


@linux_with_openblas
def test_import_kvlab_maps_openblas_before_mlx():
    out = run("import kvlab, mlx.core, kvlab._blas as b;"
              "maps = open('/proc/self/maps').read();"
              "print(b.fast_blas_active(), 'openblas' in maps)")
    assert out.stdout.split() == ["True", "True"]


@linux_with_openblas
def test_mlx_first_warns_once_with_the_fix():
    out = run("import mlx.core; import kvlab._blas as b; b.load_fast_blas();"
              "import kvlab.device as d; d.warn_if_slow_blas(); d.warn_if_slow_blas();"
              "print(b.fast_blas_active())")
    assert out.stdout.strip() == "False"
    assert out.stderr.count("kvlab: MLX is using the reference BLAS") == 1
    assert "mlx.core was imported before kvlab" in out.stderr
    assert "LD_PRELOAD=" in out.stderr


@linux_with_openblas
def test_env_for_children_preloads_openblas():
    env = _blas.env_with_fast_blas({"PATH": "/usr/bin"})
    assert env["LD_PRELOAD"] == _blas.openblas_path()
    again = _blas.env_with_fast_blas(env)
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"]


@linux_with_openblas
def test_kvlab_blas_off_disables():
    out = run("import kvlab, kvlab._blas as b; print(b.fast_blas_active())", KVLAB_BLAS="off")
    assert out.stdout.strip() == "False"
