"""Prefix-cache stores: one protocol (stores.base.Store), four designs, made by name.

Example:
    >>> store = kv.stores.make_store("paged", block_size=16)
    >>> kv.stores.STORE_NAMES
    ('radix', 'paged', 'system', 'mlx-lru', 'none')
"""

from .base import Match, Store, StoreEvent
from .radix import RadixStore

__all__ = ["Match", "Store", "StoreEvent", "RadixStore", "PagedStore", "SystemPromptStore",
           "MlxLmLRUStore", "STORE_NAMES", "make_store"]

STORE_NAMES = ("radix", "paged", "system", "mlx-lru", "none")


def make_store(name: str, *, budget_bytes: int | None = None, block_size: int = 16,
               max_size: int = 10):
    """A fresh store by its short name (``"none"``: no store, the cold baseline).

    ``budget_bytes`` caps every store's bytes (default 25% of RAM; for ``mlx-lru`` unbounded
    bytes, ``max_size`` entries as in mlx-lm's server); ``block_size`` is the paged store's.

    Example:
        >>> make_store("radix", budget_bytes=64 << 20)
        RadixStore(0 entries, 0.0 of 64 MiB, 0 evictions)
    """
    from ..errors import KvlabError

    if name == "none":
        return None
    if name == "radix":
        return RadixStore(budget_bytes)
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
    if name == "PagedStore":
        from .paged import PagedStore

        return PagedStore
    if name == "SystemPromptStore":
        from .system_prompt import SystemPromptStore

        return SystemPromptStore
    if name == "MlxLmLRUStore":
        from .mlx_lm_lru import MlxLmLRUStore

        return MlxLmLRUStore
    raise AttributeError(name)
