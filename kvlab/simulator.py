"""Model-free prefix-cache replay: how many prompt tokens a policy would have reused.

Semantics (the same for every policy and engine):

- A request of ``n`` tokens can hit only the full blocks inside its first ``n - 1`` tokens
  (the last token is always computed, as in vLLM), and only the leading run of resident
  blocks counts: ``hit_blocks <= (n - 1) // block_size``, ``hit_tokens = hit_blocks * block_size``.
- After the lookup, the request's full blocks (``n // block_size``; a trailing partial block is
  never cached, as in vLLM) become resident and most recently used, earlier blocks more recent
  than later ones, so a request's tail is evicted before its head. Then blocks are evicted until
  at most ``capacity_tokens // block_size`` remain.
- ``lru`` evicts the least recently used block, ``fifo`` the longest resident (hits do not
  refresh), ``lfu`` the least often used (ties: least recently used; the count restarts when a
  block is evicted), ``infinite`` never evicts.

Checked against published numbers: seed 004's vLLM run (cold 25088/32000, warm 31200/32000,
exact) and the Mooncake synthetic trace's unbounded cache ratio (65.0% here, 66% in FAST'25).

Example:
    >>> r = kv.simulate(kv.traces.read(), policy="lru", capacity_tokens=None)
    >>> round(r.summary["token_hit_ratio"], 3)
    0.65
"""

from __future__ import annotations

import html
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import polars as pl

from .errors import BlockSizeError, BudgetError, KvlabError, RequestError, TraceError
from .sim_kernels import lru_stack_kernel, replay_kernel

POLICIES = ("infinite", "lru", "fifo", "lfu")
ENGINES = ("auto", "numba", "python")
WORKLOAD_BLOCK_SIZE = 16
_UNBOUNDED = np.int64(1) << 62


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True, eq=False)
class SimResult:
    """One replay: ``requests`` (polars, one row a request and pass) and ``summary`` (a dict).

    ``summary`` holds both hit rates, named (DESIGN pitfall 10): ``token_hit_ratio`` = hit
    tokens / prompt tokens (vLLM), ``request_hit_ratio`` = requests with any hit / requests.

    Example:
        >>> r = kv.simulate(kv.workloads.prefix_repetition(), block_size=16, passes=2)
        >>> r.by_pass()["token_hit_ratio"].to_list()
        [..., ...]
    """

    requests: pl.DataFrame
    summary: dict
    policy: str
    capacity_tokens: int | None
    block_size: int
    source: str = ""

    def by_pass(self) -> pl.DataFrame:
        """Hit counts and both ratios for each pass over the source."""
        return (self.requests.group_by("pass", maintain_order=True)
                .agg(pl.len().alias("requests"), pl.col("prompt_tokens").sum(),
                     pl.col("hit_tokens").sum(), pl.col("hit").sum().alias("requests_hit"))
                .with_columns((pl.col("hit_tokens") / pl.col("prompt_tokens")).alias("token_hit_ratio"),
                              (pl.col("requests_hit") / pl.col("requests")).alias("request_hit_ratio"))
                .sort("pass"))

    def __repr__(self) -> str:
        s = self.summary
        return (f"SimResult({self.policy} capacity={capacity_label(self.capacity_tokens)} "
                f"block_size={self.block_size}: token hit {s['token_hit_ratio']:.1%}, request hit "
                f"{s['request_hit_ratio']:.1%}, {s['requests']} requests)")

    def _repr_html_(self) -> str:
        s = self.summary
        rows = "".join(f"<tr><td>{k}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in s.items())
        src = f" · <code>{html.escape(self.source)}</code>" if self.source else ""
        return (f"<div><b>SimResult</b> {html.escape(self.policy)} · capacity "
                f"{capacity_label(self.capacity_tokens)} tokens · block {self.block_size}{src}"
                f"<table>{rows}</table></div>")


# ---------------------------------------------------------------------------------------------
# public API


def simulate(source, policy: str = "lru", capacity_tokens: int | None = None,
             block_size: int | None = None, *, passes: int = 1, tokenizer=None,
             engine: str = "auto", cost=None) -> SimResult:
    """Replay a trace or workload through a cache policy; no model involved.

    ``source`` is a ``Trace``, a trace path, a ``Workload`` or a list of token-id sequences.
    ``capacity_tokens=None`` (or ``inf``) is unbounded. ``block_size`` defaults to the trace's
    (512 for Mooncake) or 16 for workloads. ``passes`` replays the source that many times into
    the same cache (pass 2 on is "warm"). ``engine="python"`` runs the plain reference replay.
    ``cost`` (a ``kv.cost.fit`` model) adds estimated prefill seconds and TTFT saved.

    Example:
        >>> wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
        ...                                     num_prefixes=1)
        >>> r = kv.simulate(wl, block_size=16, passes=2)
        >>> r.by_pass()["hit_tokens"].to_list()
        [25088, 31200]
    """
    _check_choice("policy", policy, POLICIES)
    _check_choice("engine", engine, ENGINES)
    tokens = _parse_capacity(capacity_tokens, policy)
    rep = prepare_replay(source, block_size, passes, tokenizer)
    cap = _blocks_of(tokens, rep.block_size)
    run = replay_python if engine == "python" else replay_kernel
    hits, evictions = run(rep, policy, cap)
    result = _result(rep, policy, tokens, hits, evictions)
    return result if cost is None else cost.annotate(result)


def sweep(source, policy: str = "lru", capacities: Sequence = (), block_size: int | None = None,
          *, passes: int = 1, tokenizer=None, engine: str = "auto") -> pl.DataFrame:
    """Hit ratios for many capacities at once: one row per capacity, in the order given.

    LRU uses one pass of Mattson's stack-distance algorithm for all capacities; fifo and lfu
    (and ``engine="numba"`` / ``"python"``) loop the per-capacity replay. ``capacity_tokens`` is
    null for an unbounded entry.

    Example:
        >>> kv.sweep(kv.traces.read(), "lru", [2**20, 2**24, None]).columns[:3]
        ['capacity_tokens', 'token_hit_ratio', 'request_hit_ratio']
    """
    _check_choice("policy", policy, POLICIES)
    _check_choice("engine", engine, ENGINES)
    if policy == "infinite":
        raise BudgetError("policy='infinite' has no capacity to sweep; use 'lru', 'fifo' or 'lfu'")
    capacities = list(capacities)
    if not capacities:
        raise BudgetError("sweep needs at least one capacity (tokens, or None for unbounded)")
    tokens = [_parse_capacity(c, policy) for c in capacities]
    rep = prepare_replay(source, block_size, passes, tokenizer)
    caps = [_blocks_of(c, rep.block_size) for c in tokens]
    caps_arr = np.array([_UNBOUNDED if c is None else c for c in caps], dtype=np.int64)
    if policy == "lru" and engine == "auto":
        order = np.argsort(caps_arr, kind="stable")
        per = lru_stack_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks,
                                caps_arr[order])
        hit_blocks = np.empty(per.shape, dtype=np.int64)
        hit_blocks[:, order] = per
    else:
        run = replay_python if engine == "python" else replay_kernel
        hit_blocks = np.stack([run(rep, policy, c)[0] for c in caps], axis=1) if len(rep.hittable) \
            else np.zeros((0, len(caps)), dtype=np.int64)
    hit_tokens = hit_blocks.sum(axis=0) * rep.block_size
    prompt = int(rep.tokens.sum())
    n = len(rep.tokens)
    return pl.DataFrame({
        "capacity_tokens": tokens,
        "token_hit_ratio": [float(h) / prompt if prompt else 0.0 for h in hit_tokens],
        "request_hit_ratio": [float(x) / n if n else 0.0 for x in (hit_blocks > 0).sum(axis=0)],
        "hit_tokens": [int(h) for h in hit_tokens],
        "prompt_tokens": [prompt] * len(caps),
    }, schema={"capacity_tokens": pl.Int64, "token_hit_ratio": pl.Float64,
               "request_hit_ratio": pl.Float64, "hit_tokens": pl.Int64, "prompt_tokens": pl.Int64})


# ---------------------------------------------------------------------------------------------
# preparing a replay: flat dense block ids and per-request counts


@dataclass(frozen=True)
class Replay:
    """A source ready to replay: every request's blocks as dense ids, and what each may hit.

    The simulator, the compiled kernels (kvlab.sim_kernels) and the benchmark all read it.

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

    def __repr__(self) -> str:
        return (f"Replay({self.label}: {len(self.tokens)} requests, {int(self.offsets[-1])} block "
                f"references, {self.n_blocks} distinct, block_size={self.block_size})")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def prepare_replay(source, block_size, passes, tokenizer) -> Replay:
    """Any source ``simulate`` takes, as a Replay (``passes`` copies back to back).

    Example:
        >>> prepare_replay(kv.traces.read(), None, 2, None).block_size
        512
    """
    from . import traces
    from .workloads import Request, Workload

    if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
        raise RequestError(f"passes must be a positive int, got {passes!r}")
    if isinstance(source, (str, Path)):
        # the file does not record its block size: trust the caller's, else Mooncake's 512
        source = traces.read(source, block_size=block_size or traces.MOONCAKE_BLOCK_SIZE)
    if isinstance(source, traces.Trace):
        if block_size is not None and int(block_size) != source.block_size:
            raise BlockSizeError(f"this trace's hash_ids cover {source.block_size}-token blocks; "
                                 f"block_size must be {source.block_size} or None, got {block_size!r}")
        trace, label = source, source.source or "trace"
    else:
        bs = WORKLOAD_BLOCK_SIZE if block_size is None else block_size
        if isinstance(source, Workload):
            trace, label = traces.from_workload(source, tokenizer, bs), f"workload:{source.name}"
        elif isinstance(source, (list, tuple)) and source and all(isinstance(r, Request) for r in source):
            wl = Workload("requests", tuple(source))
            trace, label = traces.from_workload(wl, tokenizer, bs), "requests"
        elif isinstance(source, (list, tuple)):
            trace, label = traces.from_requests(source, 0, bs), "token ids"
        else:
            raise TraceError(f"cannot simulate a {type(source).__name__}; pass a Trace, a trace "
                             "path, a Workload or a list of token-id sequences")
    flat, offsets = trace.block_arrays()
    flat, n_blocks = _dense(flat)
    lengths = np.diff(offsets)
    tokens = trace.frame["input_length"].to_numpy().astype(np.int64)
    bs = trace.block_size
    hittable = np.minimum(lengths, (tokens - 1) // bs)
    inserted = np.minimum(lengths, tokens // bs)
    r = len(tokens)
    if passes > 1:
        flat = np.tile(flat, passes)
        offsets = np.concatenate([offsets[:-1] + k * offsets[-1] for k in range(passes)]
                                 + [offsets[-1:] * passes])
        tokens, hittable, inserted = (np.tile(a, passes) for a in (tokens, hittable, inserted))
    return Replay(flat, offsets, tokens, hittable, inserted, np.tile(np.arange(r, dtype=np.int64), passes),
                   np.repeat(np.arange(1, passes + 1, dtype=np.int64), r), n_blocks, bs, label)


def _dense(flat: np.ndarray) -> tuple[np.ndarray, int]:
    """Block ids as 0..k-1; Mooncake's are already small non-negative ints, so skip the sort."""
    if flat.size == 0:
        return flat.astype(np.int64), 0
    lo, hi = int(flat.min()), int(flat.max())
    if lo >= 0 and hi < 4 * flat.size + 1024:
        return np.ascontiguousarray(flat, dtype=np.int64), hi + 1
    uniq, inv = np.unique(flat, return_inverse=True)
    return inv.astype(np.int64), len(uniq)


def _parse_capacity(capacity_tokens, policy: str) -> int | None:
    """Capacity in tokens as an int, or None for unbounded (None, inf, "inf")."""
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
                          "or use 'lru', 'fifo' or 'lfu'")
    if (isinstance(c, bool) or not isinstance(c, (int, float, np.integer, np.floating))
            or not float(c).is_integer() or c < 0):
        raise BudgetError(f"capacity_tokens must be an int >= 0 or None (unbounded), "
                          f"got {capacity_tokens!r}")
    return int(c)


def _blocks_of(capacity_tokens: int | None, block_size: int) -> int | None:
    """Whole blocks: a partial block's worth of capacity holds nothing."""
    return None if capacity_tokens is None else capacity_tokens // block_size


def _result(rep: Replay, policy, capacity_tokens, hit_blocks, evictions) -> SimResult:
    hit_blocks = np.asarray(hit_blocks, dtype=np.int64)
    frame = pl.DataFrame({
        "request": rep.request, "pass": rep.pass_no, "prompt_tokens": rep.tokens,
        "hit_blocks": hit_blocks, "hit_tokens": hit_blocks * rep.block_size, "hit": hit_blocks > 0})
    prompt = int(rep.tokens.sum())
    hit_tokens = int(hit_blocks.sum()) * rep.block_size
    n = len(rep.tokens)
    summary = {
        "policy": policy, "capacity_tokens": capacity_tokens, "block_size": rep.block_size,
        "requests": n, "passes": int(rep.pass_no.max()) if n else 0,
        "prompt_tokens": prompt, "hit_tokens": hit_tokens, "hit_blocks": int(hit_blocks.sum()),
        "token_hit_ratio": hit_tokens / prompt if prompt else 0.0,
        "request_hit_ratio": int((hit_blocks > 0).sum()) / n if n else 0.0,
        "evictions": int(evictions),
    }
    return SimResult(frame, summary, policy, capacity_tokens, rep.block_size, rep.label)


# ---------------------------------------------------------------------------------------------
# the plain-Python reference replay (tests and the benchmark compare everything against it)


def replay_python(rep: Replay, policy: str, cap: int | None) -> tuple[np.ndarray, int]:
    """Hit blocks per request and the eviction count: the plain reference for every kernel.

    Example:
        >>> hits, evictions = replay_python(prepare_replay([[1, 2, 3], [1, 2, 4]], 1, 1, None), "lru", 2)
        >>> hits.tolist(), evictions
        ([0, 2], 2)
    """
    cache: OrderedDict = OrderedDict()  # oldest first; lfu values are (count, last use)
    hits = np.zeros(len(rep.tokens), dtype=np.int64)
    evictions = 0
    clock = 0
    flat = rep.flat.tolist()
    for r in range(len(rep.tokens)):
        ids = flat[rep.offsets[r]:rep.offsets[r + 1]]
        k = 0
        while k < rep.hittable[r] and ids[k] in cache:
            k += 1
        hits[r] = k
        for b in reversed(ids[:rep.inserted[r]]):  # tail first, so the head ends most recent
            if policy in ("lru", "infinite"):
                cache[b] = None
                cache.move_to_end(b)
            elif policy == "fifo":
                cache.setdefault(b, None)
            else:
                clock += 1
                cache[b] = (cache[b][0] + 1 if b in cache else 1, clock)
        if cap is not None:
            while len(cache) > cap:
                if policy == "lfu":
                    del cache[min(cache, key=cache.__getitem__)]
                else:
                    cache.popitem(last=False)
                evictions += 1
    return hits, evictions


# ---------------------------------------------------------------------------------------------
# small helpers


def _check_choice(name, value, choices):
    if value not in choices:
        raise KvlabError(f"unknown {name} {value!r}; use one of {', '.join(choices)}")


def capacity_label(capacity) -> str:
    """A capacity for people: ``None`` -> "unbounded", 65536 -> "65,536"."""
    return "unbounded" if capacity is None else f"{capacity:,}"


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("unbounded" if v is None else str(v))
