"""A proxy's recording: kvlab's trace format (kvlab.serving.record: Mooncake's four fields first,
whole lines written once, O_APPEND) for requests the proxy saw but did not run.

``input_length`` and the hash ids come from the prompt's token ids when the proxy has a tokenizer;
without one, ``input_length`` is the upstream's reported prompt tokens and both hash id lists are
empty (pass ``--model`` for hash ids a simulator can replay). ``output_length`` is the upstream's
reported output tokens (or, without usage, the output events counted). The proxy's own fields
follow: the row of ``/kvlab/requests`` (``extends``, ``common_prefix``, ``diverged_at``, ...), the
``upstream`` URL and ``status`` (``ok`` or ``disconnected``).

Example:
    >>> with kv.proxy(upstream_url, record="runs/proxy.jsonl", tokenizer="tiny") as p: ...
    >>> kv.traces.read("runs/proxy.jsonl").frame["input_length"]
"""

from __future__ import annotations

from ..experiments.traces import MOONCAKE_BLOCK_SIZE
from ..serving.record import Recorder, hash_ids


class ProxyRecorder(Recorder):
    """``Recorder`` whose lines are built from a proxy row plus the prompt's ids (None without a
    tokenizer) and, with ``record_text``, its messages."""

    def line(self, rec: dict) -> dict:
        ids, messages = rec.pop("prompt_ids", None), rec.pop("messages", None)
        key = rec.pop("key", None)  # a user's salt when the proxy injects it: hashed as cached upstream
        n = len(ids) if ids is not None else (rec.get("upstream_prompt_tokens") or 0)
        out = {"timestamp": int(rec["arrival"] * 1000), "input_length": n,
               "output_length": rec.get("output_tokens") or 0,
               "hash_ids": hash_ids(ids, MOONCAKE_BLOCK_SIZE, key) if ids else [],
               "kvlab_block_size": self.block_size,
               "kvlab_hash_ids": hash_ids(ids, self.block_size, key) if ids else [],
               "request": rec.get("id"), "finish": rec["arrival"] + rec["e2e_s"], **rec}
        if self.record_text:
            out.update(prompt_ids=list(ids) if ids is not None else None, messages=messages)
        return out

    def __repr__(self) -> str:
        return "Proxy" + super().__repr__()
