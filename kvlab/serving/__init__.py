"""Serving: mlx-lm's own server (continuous batching, OpenAI routes) with a kvlab store behind its
prompt cache, an Anthropic Messages route, live events and stats, and request recording; a load
generator for any OpenAI-compatible endpoint (``kv.generate_load``) and peer servers (vllm-mlx, plain
mlx_lm.server) to compare against.

Example:
    >>> with kv.serve("tiny", "radix") as server:
    ...     server.url, server.stats()["token_hit_rate"]
"""

from __future__ import annotations

import importlib

__all__ = ["serve", "Server", "StoreAdapter", "ServerEvents", "Recorder",
           "hash_ids", "read_records", "workload", "generate_load", "load_test"]

_LAZY = {"serve": "server", "Server": "server", "StoreAdapter": "adapter",
         "ServerEvents": "events", "Recorder": "record", "hash_ids": "record",
         "read_records": "record", "workload": "record", "generate_load": "loadgen", "load_test": "loadgen"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvlab.serving' has no attribute {name!r}")
