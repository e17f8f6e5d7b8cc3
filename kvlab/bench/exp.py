"""MLX's CPU ``exp`` against NumPy's on the same float32 values: softmax inherits its speed, so it
bounds long-context prefill on this machine (the finding BENCHMARKS.md states is computed from it)."""

from __future__ import annotations


from .settings import Settings
from ..primitives import timing
from .table import Table, median_range, spread

NEEDS_MODEL = False


def bench_exp(repeats: int, n: int = 2_400_000) -> Table:
    """Seconds per ``exp`` of ``n`` float32 values in MLX and in NumPy, and values/s.

    Example:
        >>> bench_exp(2, n=1000).columns
        ('library', 'ms median (min-max)', 'M values/s median')
    """
    import mlx.core as mx
    import numpy as np

    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    a = mx.array(x)
    mx.eval(mx.exp(a))
    runs = {"mlx (mx.exp)": lambda: mx.eval(mx.exp(a)), "numpy (np.exp)": lambda: np.exp(x)}
    times = {name: [] for name in runs}
    for _ in range(max(repeats, 3)):
        for name, fn in runs.items():  # interleaved, so both see the same machine load
            t = timing.timed()
            fn()
            times[name].append(t.done())
    stats = {name: spread(xs) for name, xs in times.items()}
    rows = tuple((name, median_range(s, 1e3), f"{n / s['median'] / 1e6:.1f}") for name, s in stats.items())
    return Table(f"elementwise exp of {n:,} float32 values (softmax's cost on CPU)",
                 f"kvlab bench --only exp --repeats {repeats}",
                 ("library", "ms median (min-max)", "M values/s median"), rows,
                 "Same values, same process, interleaved.", values={"n": n, "seconds": stats})


def table(s: Settings) -> Table:
    return bench_exp(s.repeats)
