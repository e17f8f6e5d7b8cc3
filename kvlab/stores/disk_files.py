"""The files of a DiskStore: checking a kvlab snapshot file from its header alone, and cutting and
joining paged blocks (attention KV only).

A safetensors file is 8 bytes of header length, a JSON header (tensor offsets and ``__metadata__``)
and the data. ``kv.save`` writes the metadata kvlab checks: ``kvlab_format``, ``fingerprint``,
``offset``, ``token_ids``, ``digest``. The header alone tells a truncated file (its size differs
from what the header describes), a newer format or another model's file; the digest needs the data
and is checked on load.

Example:
    >>> why, meta = read_header("kv-cache/ab12.../entries/f00.safetensors")
    >>> why or int(meta["offset"])
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..errors import SnapshotError
from ..primitives.snapshot_files import float_dtype
from ..primitives.snapshots import FORMAT_VERSION, LayerState, Snapshot

SUFFIX = ".safetensors"
TEMP_PREFIX = ".kvlab-"  # kv.save's temp files
MAX_HEADER = 1 << 26


class CorruptFileWarning(UserWarning):
    """A DiskStore file failed its checks; it was moved aside (``.corrupt``) and not used."""


class FingerprintOnly:
    """What ``kv.load_snapshot`` checks a file against, when all a store knows is the fingerprint."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    def __repr__(self) -> str:
        return f"FingerprintOnly({self.fingerprint[:12]})"

    def _repr_html_(self) -> str:
        return f"<code>{repr(self)}</code>"


def read_header(p: Path) -> tuple[str, dict]:
    """(why the file is unusable, or "", its kvlab metadata) from the header alone.

    Example:
        >>> read_header(Path("x.safetensors"))[0]
        ''
    """
    try:
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > MAX_HEADER:
                return f"a header length of {n} bytes", {}
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__")
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        size = p.stat().st_size
        if size != 8 + n + end:
            return f"{size} bytes on disk, its header describes {8 + n + end} (truncated?)", {}
        version = int(meta["kvlab_format"])
        int(meta["offset"]), json.loads(meta["token_ids"])
    except (OSError, ValueError, KeyError, TypeError, struct.error, AttributeError) as e:
        return f"unreadable header ({type(e).__name__}: {e})", {}
    if version > FORMAT_VERSION:
        return f"snapshot format {version} is newer than this kvlab's {FORMAT_VERSION}", {}
    return "", meta


def check_file(p: Path, fingerprint: str, block_size: int | None) -> tuple[str, int, list | None]:
    """(why the file cannot serve a DiskStore of this model and block size, or ""; its tokens; its
    token ids, for whole-entry stores) from its header alone.

    Example:
        >>> check_file(p, m.fingerprint, None)[0]
        ''
    """
    why, meta = read_header(p)
    if why:
        return why, 0, None
    tokens = int(meta["offset"])
    ids = json.loads(meta["token_ids"]) if block_size is None else None
    if meta.get("fingerprint") != fingerprint:
        # folders are per fingerprint (which includes the dtype): the same model in another dtype
        # has its own folder, so a file here from another fingerprint was put here by hand
        saved = meta.get("dtype") or float_dtype(meta.get("kv_format"))
        why = (f"made by model {str(meta.get('fingerprint'))[:12]}{f' in {saved}' if saved else ''}, "
               f"in the folder of {fingerprint[:12]}")
    elif block_size is not None and tokens != block_size:
        why = f"a block of {tokens} tokens in a folder of {block_size}-token blocks"
    elif ids is not None and len(ids) != tokens:
        why = f"{len(ids)} token ids for {tokens} tokens"
    return why, tokens, ids


def as_ids(ids) -> np.ndarray:
    """Token ids as int64 [n] (compact to keep in an index, fast to compare)."""
    return np.asarray(ids, dtype=np.int64)


PAGEABLE = ("KVCache", "QuantizedKVCache")  # layers whose state is (keys, values, offset, ...)


def cut_block(snap: Snapshot, i: int, block_size: int, ids) -> Snapshot:
    """Block ``i`` of an attention-only snapshot: its own copy of the KV of its tokens (every
    array of keys and values has the token axis at -2: [batch, heads, tokens, dim], or packed
    words, scales and biases for quantized layers, whose group size and bits ride along).

    Example:
        >>> cut_block(snap, 0, 16, key.ids[:16]).offset
        16
    """
    s, e = i * block_size, (i + 1) * block_size
    layers = []
    for layer in snap.layers:
        kv = tree_map(lambda a: mx.contiguous(a[..., s:e, :]), tuple(layer.state[:2]))
        nbytes = sum(a.nbytes for _, a in tree_flatten(kv))
        layers.append(LayerState(layer.kind, (*kv, block_size, *layer.state[3:]), block_size, nbytes))
    return Snapshot(tuple(layers), block_size, tuple(int(t) for t in ids), snap.fingerprint)


def _cat(parts):
    if isinstance(parts[0], mx.array):
        return mx.concatenate(parts, axis=-2)
    return tuple(_cat([p[j] for p in parts]) for j in range(len(parts[0])))


def concat_blocks(blocks: list[Snapshot], ids) -> Snapshot:
    """One snapshot of consecutive block snapshots (attention KV only), in order.

    Example:
        >>> concat_blocks(disk.load_blocks(key, 64), key.ids[:64]).offset
        64
    """
    n = sum(b.offset for b in blocks)
    layers = []
    for i, first in enumerate(blocks[0].layers):
        if any(b.layers[i].kind != first.kind or tuple(b.layers[i].state[3:]) != tuple(first.state[3:])
               for b in blocks):
            raise SnapshotError(f"layer {i}: these blocks hold KV of different formats; keep one "
                                "DiskStore per KV format")
        kv = tuple(_cat([b.layers[i].state[j] for b in blocks]) for j in (0, 1))
        nbytes = sum(a.nbytes for _, a in tree_flatten(kv))
        layers.append(LayerState(first.kind, (*kv, n, *first.state[3:]), n, nbytes))
    mx.eval([a for layer in layers for _, a in tree_flatten(layer.state[:2])])
    return Snapshot(tuple(layers), n, tuple(ids), blocks[0].fingerprint)
