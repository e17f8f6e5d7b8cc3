"""Block hashing throughput of each algorithm (kvlab.primitives.blocks.bench_hashing) as a table."""

from __future__ import annotations

from .settings import Settings
from .table import Table

NEEDS_MODEL = False


def bench_hashing_table(repeats: int) -> Table:
    """M tokens/s per hashing algorithm over a 32k-token prompt.

    Example:
        >>> bench_hashing_table(3).columns
        ('algorithm', 'M tokens/s median', 'min-max')
    """
    from ..primitives.blocks import bench_hashing

    r = bench_hashing(repeats=repeats)["algos"]
    rows = tuple((algo, f"{v['median_tokens_per_s'] / 1e6:.1f}",
                  f"{v['min_tokens_per_s'] / 1e6:.1f}-{v['max_tokens_per_s'] / 1e6:.1f}") for algo, v in r.items())
    return Table("block hashing throughput (32k-token prompt, block size 16)",
                 f"kvlab bench --only hashing --repeats {repeats}",
                 ("algorithm", "M tokens/s median", "min-max"), rows,
                 "Target: xxh3_128 >= 20M tokens/s (vLLM reports 31-80M tokens/s on GPU servers).",
                 values={algo: {"median": v["median_tokens_per_s"], "min": v["min_tokens_per_s"],
                                "max": v["max_tokens_per_s"]} for algo, v in r.items()})


def table(s: Settings) -> Table:
    return bench_hashing_table(s.repeats)
