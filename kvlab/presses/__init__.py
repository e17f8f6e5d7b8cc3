"""KV-cache compression inside a request: presses, compressed caches, and the exact oracle.

A press (``kv.press(name, ratio, **options)``) picks which rows of each full-attention layer's KV
to keep, per KV head, with kvpress's semantics (``ratio`` = fraction removed). ``kv.compress``
prefills a prompt, compresses once, and returns the cache (full-attention layers become
``KeptKVCache``: position-preserving, ``kvlab.primitives.kept_cache``) with what each layer kept.
``kvlab.presses.kvpress_peer`` asks kvpress (its own venv) which positions it keeps, on the same
weights, to compare.

Example:
    >>> kv.presses.names()
    ('random', 'streaming_llm', 'knorm', 'snapkv', 'expected_attention', 'tova', ...)
    >>> c = kv.compress(m, msgs, kv.press("knorm", 0.5))
    >>> c.kept[0].shape                                   # [kv_heads, n_kept]
"""

from .base import Needs, Press, View, n_kept
from .compress import Compressed, Prefilled, compress
from .custom import FunctionPress, from_function
from .oracle import continue_logits, masked_attention, oracle_logits
from .registry import names, parse, press, register

__all__ = ["Compressed", "Prefilled", "FunctionPress", "Needs", "Press", "View", "compress", "continue_logits",
           "from_function", "masked_attention", "n_kept", "names", "parse", "oracle_logits", "press", "register"]
