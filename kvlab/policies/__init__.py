"""Eviction and admission policies as research objects, defined once (plain Python, readable).

``POLICIES`` maps a name to its definition, source and one-line semantics. The same classes
drive RadixStore / PagedStore eviction (``policy=``) and are the reference the simulator's
compiled kernels are tested against. The interface (``Policy``, ``Unit``) is in
``kvlab.policies.base``; why tokens miss (``MISS_REASONS``) in ``kvlab.policies.reasons``.

Example:
    >>> from kvlab.policies import POLICIES, make_policy
    >>> list(POLICIES)[:4]
    ['lru', 'fifo', 'lfu', 'slru']
    >>> make_policy("arc", capacity=1024)
    ARC(0 units, size 0 of 1,024)
"""

from .base import NEVER, Policy, Unit
from .reasons import ALL_REASONS, MISS_REASONS
from .table import ONLINE, POLICIES, PolicyInfo, make_policy, policies_frame, store_policy
from .weighted import KIND_PRIORITY, LINEAR_TOKENS, PINNED, recompute_cost

__all__ = ["POLICIES", "ONLINE", "PolicyInfo", "Policy", "Unit", "NEVER", "make_policy",
           "policies_frame", "store_policy", "MISS_REASONS", "ALL_REASONS", "KIND_PRIORITY", "LINEAR_TOKENS",
           "PINNED", "recompute_cost"]
