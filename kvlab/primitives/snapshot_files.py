"""Snapshot files: ``save`` writes a snapshot to safetensors (never pickle, atomically), and
``load_snapshot`` reads it back, refusing another model's file, the same model's file in another
dtype (each said as such), a corrupt or truncated one, a newer format or KV of another format.

Example:
    >>> kv.save(snap, "system.safetensors", model=m)
    >>> kv.load_snapshot("system.safetensors", m).offset
"""

from __future__ import annotations

import json
import os
import tempfile

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import SnapshotError, SnapshotFileError
from .cache_parts import window_kv
from .kv_format import kv_format as format_of
from .snapshots import FORMAT_VERSION, LayerState, Snapshot, ids_of
from .statefile import digest, rebuild, structure


def _canonical(layer: LayerState):
    """A layer's state as written: a sliding window in temporal order (the ring's write index is
    where mlx-lm happened to stop, not content), so equal windows make equal files."""
    if layer.kind != "RotatingKVCache" or layer.state[0] is None:
        return layer.state
    keys, values, _ = window_kv(layer.state)
    return (keys, values, *layer.state[2:5], int(keys.shape[2]))


def save(snap: Snapshot, path, tokens=None, *, model=None) -> str:
    """Write the snapshot to a safetensors file (never pickle); atomic: a failed save leaves no file.

    Metadata: format version, model fingerprint, the dtype the model ran in and its dtype-free
    fingerprint (``content``), token ids, layer classes, the KV format ("float32", "q4g64": quantized
    arrays, scales and biases are written as they are), a digest of it all.

    Example:
        >>> kv.save(snap, "system.safetensors", tokens=toks, model=m)
    """
    fingerprint = getattr(model, "fingerprint", None) or snap.fingerprint
    if fingerprint is None:
        raise SnapshotError("save() needs to know the model: pass model=... (or snapshot with "
                            "model=...) so the file can refuse to load into another model")
    ids = ids_of(tokens) if tokens is not None else snap.token_ids
    arrays, layers_meta = {}, []
    for i, layer in enumerate(snap.layers):
        flat = tree_flatten(_canonical(layer))
        scalars = {}
        for key, value in flat:
            if isinstance(value, mx.array):
                arrays[f"{i}.{key}"] = value
            else:
                scalars[key] = value
        layers_meta.append({"kind": layer.kind, "tokens": layer.tokens, "nbytes": layer.nbytes,
                            "keys": [k for k, _ in flat], "scalars": scalars,
                            "structure": structure(layer.state)})
    metadata = {
        "kvlab_format": str(FORMAT_VERSION),
        "fingerprint": fingerprint,
        "offset": str(snap.offset),
        "token_ids": json.dumps(list(ids) if ids is not None else None),
        "layers": json.dumps(layers_meta),
        "kv_format": format_of(snap),
    }
    dtype = getattr(model, "dtype", None) or float_dtype(metadata["kv_format"])
    if dtype:
        metadata["dtype"] = dtype
    if getattr(model, "content_fingerprint", None):
        metadata["content"] = model.content_fingerprint
    metadata["digest"] = digest(arrays, json.dumps(metadata, sort_keys=True))
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SnapshotFileError(f"cannot save to {path}: the folder {folder} does not exist; create it "
                            "first (os.makedirs) or pick another path")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvlab-", suffix=".safetensors", dir=folder)
    except OSError as e:
        raise SnapshotFileError(f"cannot save to {path}: {e.strerror} in {folder}") from e
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, metadata)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise SnapshotFileError(f"cannot save to {path}: {e}") from e
        raise
    return path


def load_snapshot(path, model, *, kv_format: str | None = None) -> Snapshot:
    """Read a snapshot written by ``kv.save``; refuse another model's file, a corrupt or truncated
    file, a newer format and (given ``kv_format``, e.g. "q4g64" or "float32") KV of another
    format, each with a clear error.

    Example:
        >>> snap = kv.load_snapshot("system.safetensors", m, kv_format="float32")
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise SnapshotError(f"no snapshot file at {path}")
    try:
        arrays, meta = mx.load(path, return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError for unreadable files
        raise SnapshotError(f"{path} is not a readable safetensors file (corrupt or truncated?): {e}") from e
    if "kvlab_format" not in meta:
        raise SnapshotError(f"{path} is a safetensors file but not a kvlab snapshot (no kvlab_format)")
    version = int(meta["kvlab_format"])
    if version > FORMAT_VERSION:
        raise SnapshotError(f"{path} has snapshot format {version}, newer than this kvlab's "
                            f"{FORMAT_VERSION}: upgrade kvlab to read it")
    why = refusal(meta, model)
    if why:
        raise SnapshotError(f"{path} {why}")
    signed = json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True) if version > 1 else ""
    if digest(arrays, signed) != meta.get("digest"):
        raise SnapshotError(f"{path} is corrupt: its data does not match the digest written with it")
    layers = []
    for i, lm in enumerate(json.loads(meta["layers"])):
        flat = {k: arrays[f"{i}.{k}"] for k in lm["keys"] if f"{i}.{k}" in arrays}
        flat.update(lm["scalars"])
        state = rebuild(lm["structure"], flat, "")
        layers.append(LayerState(lm["kind"], state, lm["tokens"], lm["nbytes"]))
    ids = json.loads(meta["token_ids"])
    snap = Snapshot(tuple(layers), int(meta["offset"]), tuple(ids) if ids is not None else None,
                    meta["fingerprint"])
    if kv_format is not None and format_of(snap) != kv_format:
        raise SnapshotError(f"{path} holds {format_of(snap)} KV, not the {kv_format} asked for: float "
                            "and quantized KV of one model are not interchangeable")
    return snap


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def float_dtype(kv_format: str | None) -> str | None:
    """The dtype a float KV format names ("bfloat16"), None for a quantized or empty one."""
    return kv_format if kv_format in FLOAT_DTYPES else None


def refusal(meta: dict, model) -> str:
    """Why a snapshot file with header ``meta`` cannot load into ``model`` ("" if it can): the same
    model in another dtype, or another model, each said as such. Files older than the ``dtype``
    header give their dtype by their KV format.

    Example:
        >>> refusal({"fingerprint": "ab..", "dtype": "bfloat16", "content": m.content_fingerprint}, m)
        'was saved from this model in bfloat16, and the model you passed runs in float32: ...'
    """
    expected = getattr(model, "fingerprint", None)
    if meta.get("fingerprint") == expected:
        return ""
    saved = meta.get("dtype") or float_dtype(meta.get("kv_format"))
    runs = getattr(model, "dtype", None)
    content = getattr(model, "content_fingerprint", None)
    if saved and runs and saved != runs and content and meta.get("content") == content:
        return (f"was saved from this model in {saved}, and the model you passed runs in {runs}: KV of "
                f"another dtype does not restore the same logits; load the model with "
                f"dtype=\"{saved}\" (kv.load(..., dtype=\"{saved}\")) or make the snapshot again")
    dtypes = f" ({saved} vs {runs})" if saved and runs and saved != runs else ""
    return (f"was made by model {str(meta.get('fingerprint'))[:12]}, not by the model you passed "
            f"({str(expected)[:12]}){dtypes}: KV from another model is meaningless")
