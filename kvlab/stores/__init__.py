"""Prefix-cache stores: one protocol (stores.base.Store), five designs and a disk tier, made by name.

Example:
    >>> store = kv.stores.make_store("paged", block_size=16)
    >>> kv.stores.STORE_NAMES
    ('radix', 'shared-radix', 'paged', 'system', 'mlx-lru', 'disk', 'tiered', 'none')
"""

from .base import Match, Store, StoreEvent
from .radix import RadixStore

__all__ = ["Match", "Store", "StoreEvent", "RadixStore", "SharedRadixStore", "PagedStore", "SystemPromptStore",
           "MlxLmLRUStore", "DiskStore", "TieredStore", "hits_by_tier", "STORE_NAMES", "make_store"]

STORE_NAMES = ("radix", "shared-radix", "paged", "system", "mlx-lru", "disk", "tiered", "none")
TIER_RAMS = ("radix", "paged")  # the stores that hand what they evict to a disk tier


def make_store(name: str, *, budget_bytes: int | None = None, block_size: int = 16,
               max_size: int = 10, disk_path=None, disk_budget_bytes: int | None = None,
               model=None, ram: str = "radix", write_through: bool = False):
    """A fresh store by its short name (``"none"``: no store, the cold baseline).

    ``budget_bytes`` caps every store's bytes (default 25% of the memory the device can use,
    ``kvlab.device``; for ``mlx-lru`` unbounded bytes, ``max_size`` entries as in mlx-lm's server); ``block_size`` is the paged store's.
    ``disk`` and ``tiered`` need ``disk_path`` (a folder) and ``model`` (whose files it serves);
    ``disk_budget_bytes`` caps the files (default a quarter of the free disk); ``tiered`` puts a
    ``ram`` store (``radix`` or ``paged``, of ``budget_bytes``) in front of the disk.

    Example:
        >>> make_store("radix", budget_bytes=64 << 20)
        RadixStore(0 entries, 0.0 of 64 MiB, 0 evictions)
        >>> make_store("tiered", budget_bytes=64 << 20, disk_path="kv-cache", model=m)
    """
    from ..errors import KvlabError

    if name == "none":
        return None
    if name in ("disk", "tiered"):
        from .disk import DiskStore

        if disk_path is None:
            raise KvlabError(f"store {name!r} needs disk_path=<a folder for its files>")
        if name == "disk":
            return DiskStore(disk_path, disk_budget_bytes or budget_bytes, model=model)
        if ram not in TIER_RAMS:
            raise KvlabError(f"a tiered store (kvlab serve --disk) puts a disk tier behind a 'radix' or "
                             f"'paged' RAM store, not {ram!r}")
        from .tiered import TieredStore

        disk = DiskStore(disk_path, disk_budget_bytes, model=model,
                         block_size=block_size if ram == "paged" else None)
        return TieredStore(make_store(ram, budget_bytes=budget_bytes, block_size=block_size), disk,
                           write_through=write_through)
    if name == "radix":
        return RadixStore(budget_bytes)
    if name == "shared-radix":
        from .shared_radix import SharedRadixStore

        return SharedRadixStore(budget_bytes)
    if name == "paged":
        from .paged import PagedStore

        return PagedStore(block_size, budget_bytes=budget_bytes)
    if name == "system":
        from .system_prompt import SystemPromptStore

        return SystemPromptStore(budget_bytes)
    if name == "mlx-lru":
        from .mlx_lm_lru import MlxLmLRUStore

        return MlxLmLRUStore(max_size, max_bytes=budget_bytes)
    raise KvlabError(f"unknown store {name!r}; use one of {', '.join(STORE_NAMES)}")


def __getattr__(name):
    if name == "SharedRadixStore":
        from .shared_radix import SharedRadixStore

        return SharedRadixStore
    if name == "PagedStore":
        from .paged import PagedStore

        return PagedStore
    if name == "SystemPromptStore":
        from .system_prompt import SystemPromptStore

        return SystemPromptStore
    if name == "MlxLmLRUStore":
        from .mlx_lm_lru import MlxLmLRUStore

        return MlxLmLRUStore
    if name == "DiskStore":
        from .disk import DiskStore

        return DiskStore
    if name in ("TieredStore", "hits_by_tier"):
        from . import tiered

        return getattr(tiered, name)
    raise AttributeError(name)
