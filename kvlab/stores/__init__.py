"""Prefix-cache stores: one protocol (stores.base.Store), four designs."""

from .base import CacheKey, Match, Store
from .radix import RadixStore

__all__ = ["CacheKey", "Match", "Store", "RadixStore", "PagedStore", "SystemPromptStore", "MlxLmLRUStore"]


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
