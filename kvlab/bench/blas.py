"""Linux CPU BLAS: the mlx[cpu] wheel's reference BLAS against OpenBLAS preloaded by kvlab, each in
a fresh process (the preload only works before ``mlx.core`` is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .settings import Settings
from .table import Table, spread

NEEDS_MODEL = False

_PROBE = r"""
import json, os, sys
import kvlab, kvlab._blas as b
from kvlab.primitives.timing import timed
import mlx.core as mx
a, w = mx.random.normal((1024, 896)), mx.random.normal((896, 4864)); mx.eval(a, w, a @ w)
g = []
for _ in range(int(sys.argv[2])):
    t = timed(); mx.eval(a @ w); g.append(2*1024*896*4864/t.done()/1e9)
m = kvlab.load(sys.argv[1]); ids = list(range(1000, 1256))
kvlab.prefill(m, ids[:16])
p = []
for _ in range(int(sys.argv[2])):
    t = timed(); kvlab.prefill(m, ids); p.append(256/t.done())
print(json.dumps({"fast": b.fast_blas_active(), "gflops": g, "prefill_tps": p}))
"""


def bench_blas(model: str, repeats: int) -> Table:
    """GFLOP/s of a float32 matmul and prefill tokens/s, reference BLAS vs OpenBLAS.

    Example:
        >>> bench_blas("tiny", 2).columns[0]
        'BLAS'
    """
    rows, values = [], {}
    for label, env in (("reference BLAS (KVLAB_BLAS=off)", {**os.environ, "KVLAB_BLAS": "off"}),
                       ("OpenBLAS (kvlab default)", dict(os.environ))):
        env.pop("LD_PRELOAD", None)
        out = subprocess.run([sys.executable, "-c", _PROBE, model, str(max(repeats, 2))],
                             env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        g, p = spread(r["gflops"]), spread(r["prefill_tps"])
        rows.append((label, f"{g['median']:.1f} ± {g['pstdev']:.1f}", f"{p['median']:.1f} ± {p['pstdev']:.1f}"))
        values["openblas" if env.get("KVLAB_BLAS") != "off" else "reference"] = {
            "gflops": g["median"], "prefill_tokens_per_s": p["median"], "fast_blas": r["fast"]}
    return Table("Linux CPU BLAS: float32 matmul and prefill", f"kvlab bench --only blas --model {model}",
                 ("BLAS", "GFLOP/s 1024x896@896x4864", f"prefill tokens/s ({model}, 256 tokens)"),
                 tuple(rows), "Each row is a fresh process; median ± pstdev over repeats.",
                 values={**values, "model": model, "prefill_tokens": 256})


def table(s: Settings) -> Table:
    return bench_blas(s.model_name, s.repeats)
