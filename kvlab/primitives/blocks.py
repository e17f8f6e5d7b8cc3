"""block_hashes(): chained prefix-cache block hashes, as vLLM computes them.

Block i's hash covers block i-1's hash, block i's token ids and block i's extra keys, so equal hashes
mean equal *prefixes*, not just equal blocks. Only full blocks get a hash.

Example:
    >>> hs = kv.block_hashes(range(40), block_size=16)
    >>> len(hs), short(hs[0])
    (2, 'ad0b35973b94')
"""

from __future__ import annotations

import array
import hashlib
import random
import statistics
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy as np
import xxhash

from ..errors import BlockSizeError, TokenIdError, UnknownAlgoError
from . import timing
from .tokens import check_ids, common_prefix_len


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


ALGOS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "xxh3_64": xxhash.xxh3_64_digest,
    "sha256": _sha256,
}

# The parent of block 0: fixed, so hashes agree across processes and runs. vLLM draws a random
# NONE_HASH unless PYTHONHASHSEED is set; kvlab wants notebooks to reproduce, so it is a constant.
SEED_MESSAGE = b"kvlab.blocks.NONE_HASH.v1"
NONE_HASH: dict[str, bytes] = {name: fn(SEED_MESSAGE) for name, fn in ALGOS.items()}

_EXTRA_MARK = b"\x01"
_SALT_MARK = b"\x02"
_U32 = struct.Struct("<I")


def _algo(algo: str) -> Callable[[bytes], bytes]:
    try:
        return ALGOS[algo]
    except (KeyError, TypeError):
        raise UnknownAlgoError(f"unknown hash algorithm {algo!r}; use one of {sorted(ALGOS)}") from None


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise BlockSizeError(f"block_size must be a positive int (vLLM uses 16), got {block_size!r}")
    return int(block_size)


def _ids_bytes(ids) -> bytes:
    """Token ids as a little-endian uint32 array: one C-level conversion, no per-token Python."""
    if isinstance(ids, (str, bytes)):
        raise TokenIdError(f"token ids must be a sequence of ints, got {type(ids).__name__}; "
                           "tokenise text first with kv.tokenise(model, text)")
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise TokenIdError(f"token ids must be a 1-d integer array, got dtype {ids.dtype} "
                               f"with shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
            raise TokenIdError("token ids must lie in [0, 2**32); found "
                               f"{int(ids.min())}..{int(ids.max())}")
        return ids.astype("<u4", copy=False).tobytes()
    if not isinstance(ids, (Sequence, array.array)):
        ids = list(ids)
    try:
        arr = array.array("I", ids)
    except (TypeError, OverflowError) as e:
        bad = next((x for x in ids if not isinstance(x, (int, np.integer))
                    or not 0 <= x <= 0xFFFFFFFF), None)
        raise TokenIdError(f"token ids must be ints in [0, 2**32); got {bad!r} "
                           f"({type(bad).__name__}): {e}") from None
    if arr.itemsize != 4:  # 'I' is 4 bytes on every platform MLX runs on; stay correct elsewhere
        return np.asarray(arr, dtype="<u4").tobytes()
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _ids_in_vocab(ids, vocab_size) -> bytes:
    """``_ids_bytes(ids)``, or TokenIdError naming the first id outside ``[0, vocab_size)``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise TokenIdError(f"vocab_size must be a positive int (a model's m.vocab_size), got {vocab_size!r}")
    try:
        data = _ids_bytes(ids)
    except TokenIdError:
        if not isinstance(ids, (str, bytes)):
            check_ids(ids.tolist() if isinstance(ids, np.ndarray) else ids, int(vocab_size))
        raise
    arr = np.frombuffer(data, dtype="<u4")
    bad = np.flatnonzero(arr >= vocab_size)  # one C pass; the loop below runs only to name it
    if bad.size:
        check_ids(arr[: bad[0] + 1].tolist(), int(vocab_size))
    return data


def _encode(key: Any) -> bytes:
    """A self-delimiting, process-independent encoding of one extra key (no Python hash())."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
        return b"b" + _U32.pack(len(data)) + data
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"s" + _U32.pack(len(data)) + data
    if isinstance(key, (bool, np.bool_)):
        return b"?" + (b"\x01" if key else b"\x00")
    if isinstance(key, (int, np.integer)):
        data = str(int(key)).encode("ascii")
        return b"i" + _U32.pack(len(data)) + data
    if isinstance(key, (float, np.floating)):
        return b"f" + struct.pack("<d", float(key))
    if key is None:
        return b"n"
    if isinstance(key, (tuple, list)):
        return b"t" + _U32.pack(len(key)) + b"".join(_encode(k) for k in key)
    raise TokenIdError(f"cannot hash extra key {key!r:.60} of type {type(key).__name__}; "
                       "use str, bytes, int, float, None or tuples of those")


def _as_keys(keys) -> tuple:
    return tuple(keys) if isinstance(keys, (tuple, list)) else (keys,)


def _block_keys(extra_keys, block_size: int, n_blocks: int) -> dict[int, tuple]:
    """{block index: extra keys} for full blocks, from a mapping or from token spans."""
    if extra_keys is None:
        return {}
    out: dict[int, tuple] = {}
    if isinstance(extra_keys, Mapping):
        for b, keys in extra_keys.items():
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
                raise TokenIdError(f"extra_keys mapping keys must be block indices (ints >= 0), "
                                   f"got {b!r}")
            if b < n_blocks:
                out[int(b)] = _as_keys(keys)
        return out
    spans = []
    for s in extra_keys:
        if hasattr(s, "token_start") and hasattr(s, "token_end"):  # e.g. tokens.ImageRef
            start, end, key = s.token_start, s.token_end, getattr(s, "hash", getattr(s, "key", None))
        elif isinstance(s, (tuple, list)) and len(s) == 3:
            start, end, key = s
        else:
            raise TokenIdError(f"extra_keys spans must be (token_start, token_end, key), got {s!r:.60}; "
                               "or pass a mapping {block_index: keys}")
        if (not isinstance(start, (int, np.integer)) or not isinstance(end, (int, np.integer))
                or not 0 <= start < end):
            raise TokenIdError(f"span ({start!r}, {end!r}) must satisfy 0 <= token_start < token_end")
        spans.append((int(start), int(end), key))
    for start, end, key in sorted(spans, key=lambda s: (s[0], s[1])):
        for b in range(start // block_size, min((end - 1) // block_size + 1, n_blocks)):
            # the offset keeps one item at two positions in identical placeholder blocks apart
            out[b] = out.get(b, ()) + ((key, start - b * block_size),)
    return out


def block_hashes(ids, block_size: int = 16, *, extra_keys=None, salt=None,
                 algo: str = "xxh3_128", vocab_size: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of ``ids``: hash(parent, block ids, block extra keys).

    ``ids`` is a sequence of ints, a 1-d integer array or a ``Tokens`` (whose images, if any,
    become extra keys). ``extra_keys`` is ``{block_index: keys}`` or spans
    ``(token_start, token_end, key)``; a span's key (with its offset in the block) joins every
    block the span overlaps. ``salt`` joins block 0, and through the chain every later block.
    With ``vocab_size`` (a model's, e.g. ``m.vocab_size``) an id outside ``[0, vocab_size)``
    raises TokenIdError naming its position, as the model itself would.

    Example:
        >>> a = kv.block_hashes(range(32), 16)
        >>> b = kv.block_hashes(range(32), 16, extra_keys=[(20, 24, "img-sha")])
        >>> a[0] == b[0], a[1] == b[1]
        (True, False)
        >>> kv.block_hashes([5, 70], 16, vocab_size=64)
        Traceback (most recent call last):
        ...
        kvlab.errors.TokenIdError: token ids: position 1 holds id 70, outside this model's vocabulary [0, 64); ...
    """
    block_size = _check_block_size(block_size)
    digest = _algo(algo)
    if extra_keys is None and getattr(ids, "images", None):
        extra_keys = ids.images
    raw = getattr(ids, "ids", ids)
    if vocab_size is None:
        data = _ids_bytes(raw)
    else:
        data = _ids_in_vocab(raw, vocab_size)
    step = 4 * block_size
    n_blocks = len(data) // step
    keys = _block_keys(extra_keys, block_size, n_blocks)
    if salt is not None and n_blocks:
        salt_suffix = _SALT_MARK + _encode(salt)
    else:
        salt_suffix = b""
    parent = NONE_HASH[algo]
    out: list[bytes] = []
    append = out.append
    start = 0
    if keys or salt_suffix:
        suffixes = {b: _EXTRA_MARK + _encode(k) for b, k in keys.items()}
        if salt_suffix:
            suffixes[0] = suffixes.get(0, b"") + salt_suffix
        for b in range(n_blocks):
            parent = digest(parent + data[start:start + step] + suffixes.get(b, b""))
            append(parent)
            start += step
        return out
    # the hot path: one slice, one concatenation, one C digest call per block
    for start in range(0, n_blocks * step, step):
        parent = digest(parent + data[start:start + step])
        append(parent)
    return out


def chained_hashes(ids: Sequence[int], block_size: int, *, key=None, extra_keys=None,
                   partial: bool = True) -> list[bytes]:
    """Chained hashes of the full blocks of ``ids`` (``block_hashes``, ``key`` as its salt,
    ``extra_keys`` its spans) and, with ``partial``, one more for a trailing partial block, chained
    on the last full one: the hash ids Mooncake-format traces carry (vLLM never caches the
    partial block itself).

    Example:
        >>> len(chained_hashes(range(40), 16)), len(chained_hashes(range(40), 16, partial=False))
        (3, 2)
    """
    ids = np.asarray(ids, dtype=np.int64)
    full = block_hashes(ids, block_size, salt=key, extra_keys=extra_keys or None)
    rest = len(ids) % block_size
    if partial and rest:
        # marked so a partial block never equals a full one; salted like block 0 when it is block 0
        parent = full[-1] if full else NONE_HASH["xxh3_128"] + repr(key).encode()
        start = len(ids) - rest
        spans = [s for s in (extra_keys or ()) if s[1] > start]  # a span reaching into the partial block
        mark = repr(spans).encode() if spans else b""
        full.append(xxhash.xxh3_128_digest(parent + b"partial" + ids[-rest:].astype("<u4").tobytes() + mark))
    return full


def short(h: bytes, n: int = 12) -> str:
    """The first ``n`` hex digits of a block hash, for tables and plots.

    Example:
        >>> short(kv.block_hashes(range(16))[0])
        'ad0b35973b94'
    """
    return h.hex()[:n]


def shared_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading block hashes two requests share: the blocks a prefix cache can reuse.

    Example:
        >>> shared_blocks(kv.block_hashes(range(64)), kv.block_hashes([*range(40), 0]))
        2
    """
    return common_prefix_len(list(a), list(b))


def bench_hashing(n_tokens: int = 32768, block_size: int = 16, repeats: int = 5,
                  algos: Sequence[str] | None = None) -> dict:
    """Hashing throughput of each algorithm over one ``n_tokens`` prompt (a tuple of ints, as in
    ``Tokens.ids``), median and spread over ``repeats`` runs.

    Example:
        >>> r = bench_hashing(n_tokens=4096, repeats=3)
        >>> sorted(r["algos"]), sorted(r["algos"]["xxh3_128"])
        (['sha256', 'xxh3_128', 'xxh3_64'],
         ['max_tokens_per_s', 'median_tokens_per_s', 'min_tokens_per_s', 'spread'])
    """
    block_size = _check_block_size(block_size)
    names = list(ALGOS) if algos is None else list(algos)
    for name in names:
        _algo(name)
    rng = random.Random(0)
    ids = tuple(rng.randrange(0, 151_936) for _ in range(n_tokens))
    results = {}
    for name in names:
        block_hashes(ids[: 4 * block_size], block_size, algo=name)  # warm up
        rates = []
        for _ in range(max(1, repeats)):
            t0 = timing.timed()
            block_hashes(ids, block_size, algo=name)
            rates.append(n_tokens / max(t0.done(), 1e-9))
        med = statistics.median(rates)
        results[name] = {"median_tokens_per_s": med, "min_tokens_per_s": min(rates),
                         "max_tokens_per_s": max(rates),
                         "spread": (max(rates) - min(rates)) / med}
    return {"n_tokens": n_tokens, "block_size": block_size, "repeats": repeats, "algos": results}
