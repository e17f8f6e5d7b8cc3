"""vLLM's KV-event wire format, pinned to vLLM 0.10.2 (``vllm/distributed/kv_events.py`` and
``vllm/v1/core/kv_cache_utils.py`` of that release): what ``kvlab serve --kv-events`` publishes and
``kvlab route`` reads. The format changed between vLLM versions (``medium`` arrived in 0.10.2,
``lora_name`` / ``extra_keys`` / ``group_idx`` later, and later still named-field maps instead of
arrays), so one version is followed exactly and named here.

- A message is ZMQ multipart: ``(topic, sequence, payload)``; the sequence is an 8-byte
  big-endian counter from 0, one per batch.
- The payload is msgpack of a ``KVEventBatch``, a msgspec ``array_like`` struct with
  ``omit_defaults``: ``[ts, [event, ...]]`` (``data_parallel_rank`` omitted when None).
- An event is a tagged ``array_like`` struct, its tag (the class name) first:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``; ``medium`` is ``"GPU"``.
- Block hashes: with vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` an int, the hash
  bytes read big-endian masked to 64 bits (its last 8 bytes): ``external_hash``.

Example:
    >>> payload = encode_batch(1.5, [block_stored([7], None, list(range(16)), 16)])
    >>> decode_batch(payload)
    (1.5, [{'type': 'BlockStored', 'block_hashes': [7], 'parent_block_hash': None, ...}])
"""

from __future__ import annotations

import msgpack

VLLM_VERSION = "0.10.2"
MEDIUM_GPU = "GPU"
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
FIELDS = {STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
          REMOVED: ("block_hashes", "medium"), CLEARED: ()}


def external_hash(h: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash``: the hash bytes as a big-endian int, masked to 64 bits."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def block_stored(hashes, parent, token_ids, block_size: int, lora_id=None, medium: str | None = MEDIUM_GPU) -> list:
    return [STORED, [int(h) for h in hashes], None if parent is None else int(parent),
            [int(t) for t in token_ids], int(block_size), lora_id, medium]


def block_removed(hashes, medium: str | None = MEDIUM_GPU) -> list:
    return [REMOVED, [int(h) for h in hashes], medium]


def all_cleared() -> list:
    return [CLEARED]


def encode_batch(ts: float, events: list) -> bytes:
    """A KVEventBatch payload (``data_parallel_rank`` None, so omitted)."""
    return msgpack.packb([float(ts), list(events)], use_bin_type=True)


def frames(topic: str, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The multipart message vLLM's ZmqEventPublisher sends."""
    return topic.encode("utf-8"), int(seq).to_bytes(8, "big"), payload


def decode_batch(payload: bytes) -> tuple[float, list[dict]]:
    """(ts, events as dicts with a ``type``): the inverse of encode_batch, for any 0.10.2
    publisher; fields past those 0.10.2 defines (a later vLLM) are kept under ``extra``."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError(f"not a vLLM {VLLM_VERSION} KVEventBatch (an array [ts, events, ...]): {batch!r:.80}")
    out = []
    for ev in batch[1]:
        if not isinstance(ev, list) or not ev or ev[0] not in FIELDS:
            raise ValueError(f"not a vLLM {VLLM_VERSION} KV event (a tagged array): {ev!r:.80}")
        names = FIELDS[ev[0]]
        d = {"type": ev[0], **dict(zip(names, ev[1:]))}
        if len(ev) - 1 > len(names):
            d["extra"] = ev[1 + len(names):]
        out.append(d)
    return float(batch[0]), out
