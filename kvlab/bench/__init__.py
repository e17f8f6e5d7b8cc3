"""Side-by-side benchmarks: every contender runs in the same process, interleaved over repeats, and
each table reports the median and spread (pstdev, min-max) plus ratios against a reference.

    kvlab bench --model smollm2 --repeats 5 --write BENCHMARKS.md      # every section
    kvlab bench --only vlm_peers --repeats 3 --write BENCHMARKS.md     # one section, the others kept

One module per section; each has ``NEEDS_MODEL`` and ``table(settings) -> Table`` (its raw numbers
in ``Table.values``); a module holding several sections registers ``families.Section`` objects
instead. A new section is a new module plus one line in ``REGISTRY``, then written alone with
``kvlab bench --only NAME --write BENCHMARKS.md`` (``kvlab.bench.report``: a unit test requires a
block for every section); a new target is one ``Target`` in ``summary.TARGETS``, whose row the
summary of BENCHMARKS.md and the README shows from its section's run.

Example:
    >>> tables = kv.bench.run("tiny", repeats=2, only=["hashing"])
    >>> tables[0]
    Table('block hashing throughput (32k-token prompt, block size 16)', 3 rows)
"""

from __future__ import annotations

import os
import platform
from dataclasses import replace

from .. import device
from ..errors import KvlabError
from . import (attention, blas, cluster, exp, hashing, memory, policies, prefill, press_agreement, proxy,
               quantization, route, served_checkpoints, serving, simulator, snapshot, tenants, tiers, ttft,
               vlm_peers)
from .families import checkpoint_policies, conformance
from .families_cache import hybrid_ttft, sliding_bytes
from .presses import press_bytes, press_decode, press_quality, press_time
from .settings import Settings
from .table import Table, median_range, ms, spread

__all__ = ["REGISTRY", "SECTIONS", "Settings", "Table", "machine", "median_range", "ms", "run", "spread"]

# section name -> its module; the order here is the order the tables are run and written
REGISTRY = {
    "blas": blas,
    "ttft": ttft,
    "snapshot": snapshot,
    "memory": memory,
    "hashing": hashing,
    "simulator": simulator,
    "cluster": cluster,
    "exp": exp,
    "attention": attention,
    "prefill": prefill,
    "quantization": quantization,
    "policies": policies,
    "serving": serving,
    "served_checkpoints": served_checkpoints,
    "proxy": proxy,
    "route": route,
    "tiers": tiers,
    "conformance": conformance,
    "checkpoint_policies": checkpoint_policies,
    "hybrid_ttft": hybrid_ttft,
    "sliding_bytes": sliding_bytes,
    "vlm_peers": vlm_peers,
    "tenants": tenants,
    "press_bytes": press_bytes,
    "press_time": press_time,
    "press_decode": press_decode,
    "press_quality": press_quality,
    "press_agreement": press_agreement,
}
SECTIONS = tuple(REGISTRY)


def run(model_name: str = "smollm2", repeats: int = 5, only=None, *, on_table=None,
        ttft_system_tokens: int = 1000, dtype: str | None = None) -> list[Table]:
    """Run the chosen benchmarks on the model in ``dtype`` (None: its stored dtype); ``on_table(table)``
    is called as each one finishes. Sections that run peer servers (``PEERS``) refuse, before
    anything runs, a ``dtype`` the peers cannot load the folder in.

    Example:
        >>> [t.title for t in run("tiny", 2, only=["hashing"])]
        ['block hashing throughput (32k-token prompt, block size 16)']
    """
    only = set(only or REGISTRY)
    unknown = only - set(REGISTRY)
    if unknown:
        raise KvlabError(f"unknown benchmark(s) {sorted(unknown)}; choose from {tuple(REGISTRY)}")
    settings = Settings(model_name, repeats, ttft_system_tokens, dtype=dtype)
    if any(REGISTRY[name].NEEDS_MODEL for name in only):
        from ..models.dtypes import require_stored_dtype
        from ..models.loading import load

        settings.model = load(model_name, dtype=dtype)
        peers = sorted(name for name in only if getattr(REGISTRY[name], "PEERS", False))
        if peers:  # fail now, not after the sections before them (half an hour)
            require_stored_dtype(settings.model, f"the {', '.join(peers)} section's peers")
    tables = []
    for name, section in REGISTRY.items():
        if name in only:
            tables.append(replace(section.table(settings), section=name))
            if on_table is not None:
                on_table(tables[-1])
    return tables


def machine(dev: device.Device | None = None) -> str:
    """One line naming the machine a run was measured on (OS, cores, Python, and from
    ``kvlab.device``: backend, device name, BLAS).

    Example:
        >>> machine(device.Device.for_backend("metal", info={"device_name": "Apple M2"}))  # doctest: +ELLIPSIS
        '... cores, Python ..., metal (Apple M2), BLAS Accelerate, attention mlx'
    """
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, {(dev or device.current()).label}")
