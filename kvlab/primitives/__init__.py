"""kvlab's primitives at a glance: pure functions over frozen dataclasses, no engine, no store.

- ``tokens``: ``Tokens`` (ids, rendered text, per-message spans, images) from messages, text or ids
- ``chat_template``: the tokenizer inside a model, its chat template, where each message sits
- ``boundary``: where a reusable prefix ends (system prompt, message boundaries)
- ``snapshots``: immutable, copy-free snapshots of mlx-lm caches; trim, restore, save/load, prefill
- ``layout``: what each layer of a model's cache is and what it can do at a position
- ``kv_format``: which KV format (float, quantized bits/group) a snapshot holds, and whether it may be reused
- ``blocks``: chained block hashes (vLLM's scheme)
- ``divergence``: where two prompts stop sharing tokens, and why
- ``volatile`` / ``normalisation``: fields that change per request, and the rules that strip them
- ``units`` / ``statefile``: byte and token formatting; the safetensors state file format
- ``display`` / ``files``: the summary line and table every ``_repr_html_`` is made of; atomic writes
- ``timing``: every clock read: ``timed()`` (evaluate, synchronise, then read), the plain clock, deadlines
"""
