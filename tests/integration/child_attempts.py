"""Calls that could kill the process, run in a child Python that must survive them: MLX gathers
embeddings without a bounds check, so an id past the vocabulary crashes the process (a notebook
kernel dies) instead of raising. Each attempt comes back as "no error" or "<ErrorType>: <message>"."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HARNESS = """
import json
import kvlab as kv

out = {}

def attempt(name, fn):
    try:
        fn()
        out[name] = "no error"
    except kv.KvlabError as e:
        out[name] = f"{type(e).__name__}: {e}"
"""


def run_attempts(body: str, cwd) -> dict:
    """Run ``body`` after the harness in a child (it defines ``V``, the vocabulary size, and calls
    ``attempt(name, fn)``); assert the child survived; return ``{"vocab": V, name: outcome}``."""
    code = HARNESS + textwrap.dedent(body) + '\nprint("RESULTS " + json.dumps({"vocab": V, **out}))\n'
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert proc.returncode == 0, f"the child died (returncode {proc.returncode}): {proc.stderr[-2000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])
