"""scripts/setup.sh's guards (issue 20 §4), CI-free: the script runs with a fake `uname` and a fake
`python3` first on PATH (a few lines of shell printing what macOS or Linux would), VENV inside
tmp_path and KVLAB_SETUP_CHECK_ONLY=1, so it stops after its checks and installs nothing (no
network). The fakes stand for machines this Linux box is not: an Apple-silicon Mac with its stock
Python 3.9, a Rosetta Python, a CUDA machine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
CHECKED = "kvlab setup: checks passed (KVLAB_SETUP_CHECK_ONLY=1: nothing installed)\n"


def fake(bin_dir: Path, name: str, output: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(0o755)


def run_setup(tmp_path: Path, system: str, python_facts: str, *, gpu: bool = False,
              venv_facts: str | None = None, **env) -> subprocess.CompletedProcess:
    """Run setup.sh as on a machine whose `uname -s` says ``system`` and whose python3 says
    ``python_facts`` ("3.9.6 arm64": version and platform.machine())."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake(bin_dir, "uname", system)
    fake(bin_dir, "python3", python_facts)
    if gpu:
        fake(bin_dir, "nvidia-smi", "GPU 0: NVIDIA A10G (UUID: GPU-0)")
    venv = tmp_path / "venv"
    if venv_facts is not None:  # a venv left by an earlier run with another Python
        (venv / "bin").mkdir(parents=True)
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
        fake(venv / "bin", "python", venv_facts)
    full = {k: v for k, v in os.environ.items() if k not in ("KVLAB_BACKEND", "PYTHON")}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", VENV=str(venv), KVLAB_SETUP_CHECK_ONLY="1", **env)
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=full, timeout=60)


def test_macos_stock_python_39_is_refused(tmp_path):
    # mutant: the version check removed (or `-lt 11` turned into `-lt 9`) -> exit 0, pip fails later
    r = run_setup(tmp_path, "Darwin", "3.9.6 arm64")
    assert r.returncode == 3
    assert r.stderr == ("kvlab setup: ERROR: kvlab needs Python >= 3.11; 'python3' is Python 3.9.6 "
                        "(macOS ships 3.9 as python3, and pip fails with it). Install 3.11 or newer "
                        "(macOS: brew install python@3.12) and rerun with PYTHON=python3.12\n")
    assert r.stdout == ""


def test_macos_intel_or_rosetta_python_is_refused(tmp_path):
    # mutant: the arch check reads `uname -m` (arm64 in a native shell) instead of the Python's
    # platform.machine(), or is dropped -> exit 0 and pip finds no mlx wheel
    r = run_setup(tmp_path, "Darwin", "3.12.4 x86_64")
    assert r.returncode == 4
    assert "'python3' is an x86_64 Python (an Intel Mac, or Rosetta 2 on Apple silicon); MLX publishes " \
           "macOS wheels for arm64 only" in r.stderr
    assert r.stderr.startswith("kvlab setup: ERROR: ")


def test_macos_arm64_python_passes_without_backend_extra(tmp_path):
    r = run_setup(tmp_path, "Darwin", "3.12.4 arm64")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == ("kvlab setup: Python 3.12.4 arm64 (python3), MLX backend metal (macOS: plain mlx)\n"
                        + CHECKED)


def test_wrong_venv_is_rebuilt_not_reused(tmp_path):
    # mutant: an existing .venv reused whatever built it -> macOS's 3.9 venv (pip failed in it)
    # stays, and every rerun fails the same way
    r = run_setup(tmp_path, "Darwin", "3.12.4 arm64", venv_facts="3.9.6 arm64")
    assert (r.returncode, r.stderr) == (0, "")
    assert f"kvlab setup: {tmp_path / 'venv'} has Python 3.9.6 arm64, which kvlab cannot use: " \
           "rebuilding it with python3\n" in r.stdout
    assert not (tmp_path / "venv").exists()


def test_good_venv_is_kept(tmp_path):
    r = run_setup(tmp_path, "Darwin", "3.12.4 arm64", venv_facts="3.12.4 arm64")
    assert (r.returncode, r.stdout.count("rebuilding")) == (0, 0)
    assert (tmp_path / "venv" / "pyvenv.cfg").is_file()


def test_rosetta_venv_is_rebuilt(tmp_path):
    r = run_setup(tmp_path, "Darwin", "3.12.4 arm64", venv_facts="3.12.4 x86_64")
    assert r.returncode == 0
    assert "has Python 3.12.4 x86_64, which kvlab cannot use: rebuilding it" in r.stdout
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize("gpu,env,backend,why", [
    (False, {}, "cpu", "no NVIDIA GPU; KVLAB_BACKEND=cuda to override"),
    (True, {}, "cuda", "nvidia-smi found a GPU; KVLAB_BACKEND=cpu to override"),
    (False, {"KVLAB_BACKEND": "cuda"}, "cuda", "KVLAB_BACKEND=cuda"),
    (True, {"KVLAB_BACKEND": "cpu"}, "cpu", "KVLAB_BACKEND=cpu"),
])
def test_linux_backend_choice(tmp_path, gpu, env, backend, why):
    # mutant: setup always installs kvlab[cpu] -> a CUDA machine's line says "backend cpu"
    r = run_setup(tmp_path, "Linux", "3.11.7 x86_64", gpu=gpu, **env)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout == f"kvlab setup: Python 3.11.7 x86_64 (python3), MLX backend {backend} ({why})\n" + CHECKED


def test_linux_python_39_is_refused_too(tmp_path):
    r = run_setup(tmp_path, "Linux", "3.9.18 x86_64")
    assert r.returncode == 3
    assert "'python3' is Python 3.9.18" in r.stderr


@pytest.mark.parametrize("system,env,message", [
    ("Darwin", {"KVLAB_BACKEND": "cuda"}, "KVLAB_BACKEND=cuda: on macOS MLX runs on Metal (plain mlx); unset KVLAB_BACKEND"),
    ("Linux", {"KVLAB_BACKEND": "rocm"}, "KVLAB_BACKEND=rocm: on Linux use cpu or cuda"),
    ("MINGW64_NT-10.0", {}, "kvlab runs on macOS (Apple silicon) and Linux; this system is 'MINGW64_NT-10.0'"),
])
def test_unsupported_system_or_backend(tmp_path, system, env, message):
    r = run_setup(tmp_path, system, "3.12.4 arm64", **env)
    assert (r.returncode, r.stderr) == (5, f"kvlab setup: ERROR: {message}\n")
