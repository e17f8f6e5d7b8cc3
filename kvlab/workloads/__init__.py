"""Seeded, deterministic request workloads: the prompt shapes the seed threads measured.

Every generator returns a :class:`Workload` of :class:`Request` s the Engine accepts; the same
arguments give identical requests in any process. Sizes marked ``*_tokens`` are approximate for
text (calibrated on the Qwen3 tokenizer: about 5.5 characters a token for the seeded prose, 3.8
for JSON) and exact for token ids.

- ``generators``: multi_turn, branching, agentic_loop, shared_system_prompt, prefix_repetition,
  multimodal_mix, fixed (and ``GENERATORS`` by name);
- ``multimodal``: the image-bearing load workload (text, mixed or image traffic);
- ``fixed``: prompts of exactly N rendered tokens (chat template counted) for cross-tool runs,
  and the ``safe_ids`` / ``rendered_ids`` they are made and measured with;
- ``text``: the seeded prose, questions, images and tool schemas they are made of (the schemas
  are package data, ``kvlab/data/tool_schemas.json``);
- ``fit``: ``fit_to_context``, a workload shrunk to a model's context;
- ``agent_causes``: ``CAUSES``, the reported causes of agent cache misses, each a ``Cause`` with
  its workload, diagnostics type and fix (``agent_traffic`` holds their generators).

Example:
    >>> wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
    ...                                     num_prefixes=1)
    >>> len(wl), len(wl.requests[0].ids)
    (50, 640)
"""

from __future__ import annotations

from ..request import Request, Workload
from .agent_causes import CAUSES, Cause, Fix, StructuralChange, structural_change
from .fit import fit_to_context
from .fixed import fixed, rendered_ids, safe_ids
from .generators import (BILLING_HEADER, GENERATORS, agentic_loop, branching, multi_turn, multimodal_mix,
                         prefix_repetition, shared_system_prompt)
from .multimodal import multimodal
from .text import JSON_CHARS_PER_TOKEN, PROSE_CHARS_PER_TOKEN, tool_schemas

__all__ = ["BILLING_HEADER", "CAUSES", "Cause", "Fix", "GENERATORS", "JSON_CHARS_PER_TOKEN",
           "PROSE_CHARS_PER_TOKEN", "Request", "StructuralChange",
           "Workload", "agentic_loop", "branching", "fit_to_context", "fixed", "multi_turn", "multimodal",
           "multimodal_mix",
           "prefix_repetition", "rendered_ids", "safe_ids", "shared_system_prompt", "structural_change",
           "tool_schemas"]
