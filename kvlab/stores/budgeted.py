"""What the stores that hold KV under a byte budget start with (radix, shared radix, paged): the
budget, the counters, the event log and the bytes held.

Example:
    >>> kv.RadixStore(budget_bytes=1 << 20).nbytes
    0
"""

from __future__ import annotations

import itertools

from .. import device as devices
from .base import EventLog, StoreBase, check_budget


class BudgetedStore(StoreBase):
    """A store of at most ``budget_bytes`` of KV (default: 25% of the memory ``device`` can use,
    ``kvlab.device.current()`` unless given). ``on_evict(id, snapshot)``
    hears of each entry that leaves for room (a tier below could keep it); ``nbytes`` is what the
    store holds, kept in ``_bytes`` by the subclass; ``_ids`` and ``_clock`` count entries and uses."""

    def __init__(self, budget_bytes: int | None = None, on_evict=None, device: devices.Device | None = None):
        self.device = device or devices.current()
        self.budget_bytes = check_budget(budget_bytes if budget_bytes is not None else self.device.default_budget())
        self.on_evict = on_evict
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._bytes = 0
        self.evictions = 0
        self.log = EventLog()

    @property
    def nbytes(self) -> int:
        return self._bytes
