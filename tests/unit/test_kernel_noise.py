"""`kvlab execute` shows kvlab's report, not the Jupyter kernel's log: the kernel's "running over TCP
without encryption" warning is gone because kvlab's kernel channels are CurveZMQ-encrypted (the
kernel spec declares support; the runner asks jupyter_client to provision keys), while a failing
cell's error still reaches the user."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from kvlab.experiments import kernel

pytestmark = pytest.mark.notebook

WARNING = "without encryption"


def notebook(path, body: str):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "kvlab", "display_name": "Python (kvlab)", "language": "python"}
    params = nbformat.v4.new_code_cell("x = 1")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)
    return path


def kvlab_run(path, out):
    return subprocess.run([sys.executable, "-m", "kvlab.cli", "run", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)


def test_kvlab_run_prints_no_kernel_warning_but_keeps_cell_errors(tmp_path):
    ok = kvlab_run(notebook(tmp_path / "ok.ipynb", "print(x + 1)"), tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    assert "ok.ipynb ok" in ok.stdout
    # no kernel warning at all (jupyter_client's interrupt-before-shutdown can still make ipykernel
    # log "KeyboardInterrupt caught in kernel" now and then: an upstream race, not asserted here)
    assert WARNING not in ok.stderr and "[IPKernelApp] WARNING" not in ok.stderr, ok.stderr

    bad = kvlab_run(notebook(tmp_path / "bad.ipynb", "raise ValueError(f'boom {x}')"), tmp_path / "bad")
    assert bad.returncode == 2
    assert "kvlab: error:" in bad.stderr and "raised ValueError: boom 1" in bad.stderr
    assert WARNING not in bad.stderr


def test_kvlab_kernel_channels_are_encrypted():
    """Not merely quiet: the kernel gets Curve keys and a round trip over the encrypted channels works."""
    from jupyter_client.manager import KernelManager

    assert kernel.curve_supported(), "this pyzmq/ipykernel pair has CurveZMQ (checked on this machine)"
    assert kernel.kernel_spec()["metadata"]["supported_encryption"] == ["curve"]
    km = KernelManager(kernel_name=kernel.ensure_kernelspec(), **kernel.manager_config())
    km.start_kernel()
    try:
        info = km.get_connection_info()
        assert info.get("curve_publickey") and info.get("curve_secretkey")
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        outputs = []
        reply = client.execute_interactive("print(6 * 7)", timeout=60,
                                           output_hook=lambda msg: outputs.append(msg))
        assert reply["content"]["status"] == "ok"
        assert any(m["content"].get("text") == "42\n" for m in outputs)
        client.stop_channels()
    finally:
        km.shutdown_kernel(now=True)

