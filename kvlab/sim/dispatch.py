"""Which compiled kernel replays which policy, with the definition's parameters.

Every policy in kvlab.policies.POLICIES has a kernel here (a test checks it); the parameters
a kernel needs are read off a reference instance of the definition, so defaults and derived
sizes (SLRU's protected share, TinyLFU's sample) are computed in one place.
"""

from __future__ import annotations

import numpy as np

from ..policies import make_policy
from .kernels_heap import run_heap, sweep_heap
from .kernels_lists import run_lists, sweep_lists
from .kernels_priority import run_priority, sweep_priority
from .kernels_reasons import explain
from .prepare import PreparedTrace, Replayed


def _arg(name: str, ref) -> int:
    """The one derived parameter a kernel takes (-1: none / unbounded)."""
    value = {"slru": lambda: ref.protected_cap, "s3fifo": lambda: ref.small_percent,
             "tinylfu": lambda: ref.sample, "priority": lambda: ref.pin_tokens,
             "cost_aware": lambda: ref.linear}.get(name, lambda: None)()
    return -1 if value is None else int(value)


KERNELS = {name: run_lists for name in ("lru", "fifo", "slru", "s3fifo", "arc", "tinylfu")}
KERNELS.update({name: run_heap for name in ("lfu", "length_aware", "belady", "cost_aware")})
KERNELS["priority"] = run_priority
SWEEPS = {name: {run_lists: sweep_lists, run_heap: sweep_heap, run_priority: sweep_priority}[run]
          for name, run in KERNELS.items()}


def run_kernel(rep: PreparedTrace, policy: str, cap: int | None, params: dict | None = None, *,
               reasons: bool = True) -> Replayed:
    """One compiled replay (``policy="infinite"``: LRU without a capacity).

    Example:
        >>> run_kernel(prepare_replay([[1, 2, 3], [1, 2, 4]], 1, 1, None), "arc", 1).hits.tolist()
        [0, 1]
    """
    name = "lru" if policy == "infinite" else policy
    ref = make_policy(name, cap, **(params or {}))
    c = -1 if cap is None else int(cap)
    arg = _arg(name, ref)
    hits, evb, evr = KERNELS[name](name, rep, c, arg)
    if not reasons:
        return Replayed(hits, evb, evr)
    why, by = explain(rep, cap, hits, evb, evr)
    return Replayed(hits, evb, evr, why, by)


def replay_kernel(rep: PreparedTrace, policy: str, cap: int | None, params: dict | None = None
                  ) -> tuple[np.ndarray, int]:
    """Hit blocks per request and the eviction count, from the policy's compiled kernel."""
    out = run_kernel(rep, policy, cap, params, reasons=False)
    return out.hits, out.evictions


def sweep_kernel(rep: PreparedTrace, policy: str, caps, params: dict | None = None) -> np.ndarray:
    """Hit blocks per request (rows) at each capacity in ``caps`` (blocks, None: unbounded;
    columns): one compiled replay per capacity, run in parallel threads.

    Example:
        >>> sweep_kernel(prepare_replay([[1, 2, 3], [1, 2, 4]], 1, 1, None), "arc", [0, 1, None]).tolist()
        [[0, 0, 0], [0, 1, 2]]
    """
    name = "lru" if policy == "infinite" else policy
    args = [_arg(name, make_policy(name, c, **(params or {}))) for c in caps]
    c = [-1 if x is None else int(x) for x in caps]
    if not len(rep.hittable) or not c:
        return np.zeros((len(rep.hittable), len(c)), np.int64)
    return SWEEPS[name](name, rep, c, args)
