"""kvlab proxy: forward OpenAI and Anthropic routes to any compatible server unchanged, record the
traffic in kvlab's trace format and say, per request, which earlier request it extends, where the
prompts part and what the upstream reported reused.

``kv.proxy`` is this package and also starts a proxy when called: ``kv.proxy(upstream, ...)`` is
``kv.proxy.proxy(upstream, ...)`` (kvlab.proxy.server).

Example:
    >>> with kv.proxy("http://127.0.0.1:8080", tokenizer="tiny", record="runs/p.jsonl") as p:
    ...     ...                                  # point clients at p.url
    >>> p.requests_frame()
"""

from __future__ import annotations

import importlib
import sys
import types

__all__ = ["proxy", "Proxy", "Tracker", "Exchange", "Prompt", "prompt_of", "Watch", "ProxyRecorder"]

_LAZY = {"proxy": "server", "Proxy": "server", "Tracker": "conversation", "Exchange": "conversation",
         "Prompt": "prompt", "prompt_of": "prompt", "Watch": "usage", "ProxyRecorder": "recording"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvlab.proxy' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    # importing kvlab.proxy.* sets the attribute kvlab.proxy to this package, whatever kvlab's lazy
    # names say, so the package itself must start a proxy when called
    def __call__(self, upstream, port=0, record=None, tokenizer=None, **kwargs):
        return self.proxy(upstream, port=port, record=record, tokenizer=tokenizer, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
