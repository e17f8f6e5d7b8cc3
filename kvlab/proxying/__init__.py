"""kvlab proxy: forward OpenAI and Anthropic routes to any compatible server unchanged, record the
traffic in kvlab's trace format and say, per request, which earlier request it extends, where the
prompts part and what the upstream reported reused.

``kv.proxy(upstream, ...)`` (kvlab.proxying.server.proxy) starts one; ``kvlab proxy --upstream URL``
runs one from the command line.

Example:
    >>> with kv.proxy("http://127.0.0.1:8080", tokenizer="tiny", record="runs/p.jsonl") as p:
    ...     ...                                  # point clients at p.url
    >>> p.requests_frame()
"""

from __future__ import annotations

from .conversation import Exchange, Tracker
from .prompt import Prompt, prompt_of
from .recording import ProxyRecorder
from .server import Proxy, proxy
from .usage import Watch

__all__ = ["Exchange", "Prompt", "Proxy", "ProxyRecorder", "Tracker", "Watch", "prompt_of", "proxy"]
