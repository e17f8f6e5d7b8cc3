"""A source (trace, workload, token-id lists) as flat arrays every replay reads."""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

from ..errors import BlockSizeError, BudgetError, RequestError, TraceError

WORKLOAD_BLOCK_SIZE = 16


@dataclass(frozen=True)
class PreparedTrace:
    """A source ready to replay: every request's blocks as dense ids, and what each may hit.

    The simulator, the compiled kernels (kvlab.sim) and the benchmarks all read it.

    Example:
        >>> rep = prepare_replay([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], 2, 1, None)
        >>> rep.hittable.tolist(), rep.n_blocks
        ([2, 2], 4)
    """

    flat: np.ndarray       # int64 [blocks]: dense block ids 0..n_blocks-1, all requests back to back
    offsets: np.ndarray    # int64 [requests + 1]
    tokens: np.ndarray     # int64 [requests]: prompt tokens
    hittable: np.ndarray   # int64 [requests]: full blocks within the first n - 1 tokens
    inserted: np.ndarray   # int64 [requests]: full blocks, cached after the request
    request: np.ndarray    # int64 [requests]: index in the source
    pass_no: np.ndarray    # int64 [requests]: 1-based pass
    n_blocks: int
    block_size: int
    label: str
    priority: np.ndarray | None = None   # int64 [requests]: for the priority policy (0 if None)
    unkeyed: np.ndarray | None = None    # int64 [blocks]: ids without salt/extra keys (None: same)

    def priorities(self) -> np.ndarray:
        return np.zeros(len(self.tokens), np.int64) if self.priority is None else self.priority

    def unkeyed_flat(self) -> tuple[np.ndarray, int]:
        """Block ids with salts and extra keys dropped, and how many distinct there are."""
        if self.unkeyed is None:
            return self.flat, self.n_blocks
        return self.unkeyed, int(self.unkeyed.max()) + 1 if self.unkeyed.size else 0

    def __repr__(self) -> str:
        return (f"PreparedTrace({self.label}: {len(self.tokens)} requests, {int(self.offsets[-1])} block "
                f"references, {self.n_blocks} distinct, block_size={self.block_size})")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def prepare_replay(source, block_size, passes, tokenizer, priorities=None) -> PreparedTrace:
    """Any source ``simulate`` takes, as a PreparedTrace (``passes`` copies back to back).

    ``priorities`` (one int per source request) feed the ``priority`` policy; without them a
    trace's ``priority`` column is used when its frame has one, else 0.

    Example:
        >>> prepare_replay(kv.traces.read(), None, 2, None).block_size
        512
    """
    from ..experiments import traces
    from ..workloads import Request, Workload

    if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
        raise RequestError(f"passes must be a positive int, got {passes!r}")
    if isinstance(source, (str, Path)):
        # the file does not record its block size: trust the caller's, else Mooncake's 512
        source = traces.read(source, block_size=block_size or traces.MOONCAKE_BLOCK_SIZE)
    unkeyed_trace = None
    if isinstance(source, traces.Trace):
        if block_size is not None and int(block_size) != source.block_size:
            raise BlockSizeError(f"this trace's hash_ids cover {source.block_size}-token blocks; "
                                 f"block_size must be {source.block_size} or None, got {block_size!r}")
        trace, label = source, source.source or "trace"
    else:
        bs = WORKLOAD_BLOCK_SIZE if block_size is None else block_size
        if isinstance(source, (list, tuple)) and source and all(isinstance(r, Request) for r in source):
            source = Workload("requests", tuple(source))
        if isinstance(source, Workload):
            trace = traces.from_workload(source, tokenizer, bs)
            label = "requests" if source.name == "requests" else f"workload:{source.name}"
            if any(r.salt is not None or r.extra_keys for r in source.requests):
                bare = tuple(dataclasses.replace(r, salt=None, extra_keys=()) for r in source.requests)
                unkeyed_trace = traces.from_workload(Workload(source.name, bare), tokenizer, bs)
        elif isinstance(source, (list, tuple)):
            trace, label = traces.from_requests(source, 0, bs), "token ids"
        else:
            raise TraceError(f"cannot simulate a {type(source).__name__}; pass a Trace, a trace "
                             "path, a Workload or a list of token-id sequences")
    flat, offsets = trace.block_arrays()
    flat, n_blocks = _dense(flat)
    lengths = np.diff(offsets)
    _check_no_repeats(flat, offsets, n_blocks)
    tokens = trace.frame["input_length"].to_numpy().astype(np.int64)
    bs = trace.block_size
    hittable = np.minimum(lengths, (tokens - 1) // bs)
    inserted = np.minimum(lengths, tokens // bs)
    prio = _priorities(priorities, trace)
    unkeyed = None if unkeyed_trace is None else _dense(unkeyed_trace.block_arrays()[0])[0]
    r = len(tokens)
    if passes > 1:
        flat = np.tile(flat, passes)
        offsets = np.concatenate([offsets[:-1] + k * offsets[-1] for k in range(passes)]
                                 + [offsets[-1:] * passes])
        tokens, hittable, inserted = (np.tile(a, passes) for a in (tokens, hittable, inserted))
        prio = None if prio is None else np.tile(prio, passes)
        unkeyed = None if unkeyed is None else np.tile(unkeyed, passes)
    return PreparedTrace(flat, offsets, tokens, hittable, inserted, np.tile(np.arange(r, dtype=np.int64), passes),
                  np.repeat(np.arange(1, passes + 1, dtype=np.int64), r), n_blocks, bs, label, prio, unkeyed)


def _check_no_repeats(flat: np.ndarray, offsets: np.ndarray, n_blocks: int) -> None:
    """Chained hash ids never repeat within a request (each covers a different prefix); a trace
    where one does is not a prefix-cache trace, and the replay's parent links would loop."""
    r, b = _first_repeat(flat, offsets, n_blocks)
    if r >= 0:
        raise TraceError(f"request {r} holds block id {b} twice; chained hash ids are unique within a "
                         "request (each one covers a longer prefix), so this is not a prefix-cache trace")


@numba.njit(cache=True)
def _first_repeat(flat, offsets, n_blocks):
    last = np.full(max(1, n_blocks), -1, np.int64)  # the last request that held each block
    for r in range(len(offsets) - 1):
        for i in range(offsets[r], offsets[r + 1]):
            if last[flat[i]] == r:
                return r, flat[i]
            last[flat[i]] = r
    return -1, -1


def _priorities(priorities, trace) -> np.ndarray | None:
    n = len(trace)
    if priorities is None:
        if "priority" not in trace.frame.columns:
            return None
        priorities = trace.frame["priority"].to_list()
    try:
        out = np.array([int(p) for p in priorities], dtype=np.int64)
    except (TypeError, ValueError):
        raise RequestError("priorities must be integers, one per request (higher = kept longer)") from None
    if out.shape != (n,):
        raise RequestError(f"{len(out)} priorities for {n} requests; pass one int per request")
    return out


def _dense(flat: np.ndarray) -> tuple[np.ndarray, int]:
    """Block ids as 0..k-1; Mooncake's are already small non-negative ints, so skip the sort."""
    if flat.size == 0:
        return flat.astype(np.int64), 0
    lo, hi = int(flat.min()), int(flat.max())
    if lo >= 0 and hi < 4 * flat.size + 1024:
        return np.ascontiguousarray(flat, dtype=np.int64), hi + 1
    uniq, inv = np.unique(flat, return_inverse=True)
    return inv.astype(np.int64), len(uniq)


@dataclass(frozen=True)
class Replayed:
    """What one replay produced: hit blocks per request, the eviction log and, when asked,
    why each missed token missed (columns in kvlab.policies.MISS_REASONS order).

    Example:
        >>> out = run_python(prepare_replay([[1, 2, 3], [1, 2, 4]], 1, 1, None), "lru", 1)
        >>> out.hits.tolist(), out.evictions
        ([0, 1], 3)
    """

    hits: np.ndarray                  # int64 [requests]: hit blocks
    evicted: np.ndarray               # int64 [evictions]: block ids, in eviction order
    evicted_at: np.ndarray            # int64 [evictions]: the replay row whose insertion evicted it
    reasons: np.ndarray | None = None     # int64 [requests, 6]: missed tokens per reason
    evicted_by: np.ndarray | None = None  # int64 [requests]: evictor of the first evicted missed block

    @property
    def evictions(self) -> int:
        return len(self.evicted)

    def __repr__(self) -> str:
        return f"Replayed({len(self.hits)} requests, {int(self.hits.sum())} hit blocks, {self.evictions} evictions)"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def parse_capacity(capacity_tokens, policy: str) -> int | None:
    """Capacity in tokens as an int, or None for unbounded (None, inf, "inf"); BudgetError otherwise.

    Example:
        >>> parse_capacity("inf", "lru"), parse_capacity(4096.0, "lru")
        (None, 4096)
    """
    c = capacity_tokens
    if isinstance(c, str):
        text = c.strip().lower()
        if text in ("inf", "none", "unbounded"):
            c = None
        else:
            try:
                c = float(text)
            except ValueError:
                raise BudgetError(f"capacity {capacity_tokens!r} is not a number of tokens; pass an "
                                  "int or 'inf'") from None
    if c is None or (isinstance(c, (float, np.floating)) and c == float("inf")):
        return None
    if policy == "infinite":
        raise BudgetError(f"policy='infinite' never evicts; drop capacity_tokens={capacity_tokens!r} "
                          "or use a policy such as 'lru'")
    if (isinstance(c, bool) or not isinstance(c, (int, float, np.integer, np.floating))
            or not float(c).is_integer() or c < 0):
        raise BudgetError(f"capacity_tokens must be an int >= 0 or None (unbounded), "
                          f"got {capacity_tokens!r}")
    return int(c)
