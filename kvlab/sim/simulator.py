"""Model-free prefix-cache replay: how many prompt tokens a policy would have reused, why the
rest missed, and how far the policy is from the offline optimum.

Semantics (the same for every policy and engine):

- A request of ``n`` tokens can hit only the full blocks inside its first ``n - 1`` tokens
  (the last token is always computed, as in vLLM), and only the leading run of resident
  blocks counts: ``hit_blocks <= (n - 1) // block_size``, ``hit_tokens = hit_blocks * block_size``.
- After the lookup, the request's full blocks (``n // block_size``; a trailing partial block is
  never cached, as in vLLM) become resident: each is *accessed*, tail first, so the request's
  head is the most recent. Then blocks are evicted, one victim at a time, until at most
  ``capacity_tokens // block_size`` remain.
- Which victim is the policy's: every name in ``kvlab.policies.POLICIES`` (lru, fifo, lfu, slru,
  s3fifo, arc, tinylfu, length_aware, cost_aware, priority, and belady, the offline optimum);
  ``infinite`` never evicts. The definitions and their sources are in that table.
- Every missed token gets one reason (``kvlab.policies.reasons``): columns of ``requests``.

Checked against published numbers: seed 004's vLLM run (cold 25088/32000, warm 31200/32000,
exact) and the Mooncake synthetic trace's unbounded cache ratio (65.0% here, 66% in FAST'25).

Example:
    >>> r = kv.simulate(kv.traces.read(), policy="lru", capacity_tokens=None)
    >>> round(r.summary["token_hit_rate"], 3)
    0.65
"""

from __future__ import annotations

import html
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from ..errors import BudgetError, KvlabError
from ..policies import MISS_REASONS
from ..policies import POLICIES as _TABLE
from .dispatch import replay_kernel, run_kernel, sweep_kernel
from .kernels_ceiling import UNBOUNDED, belady_ceiling_kernel
from .kernels_stack import lru_stack_kernel
from .prepare import WORKLOAD_BLOCK_SIZE, PreparedTrace, Replayed, parse_capacity, prepare_replay
from .reference import replay_python, run_python

__all__ = ["simulate", "sweep", "SimResult", "POLICIES", "ENGINES", "MISS_REASONS", "PreparedTrace",
           "Replayed", "prepare_replay", "replay_python", "replay_kernel", "run_kernel", "sweep_kernel",
           "one_pass", "ONE_PASS", "run_python", "capacity_label", "WORKLOAD_BLOCK_SIZE"]

POLICIES = ("infinite",) + tuple(_TABLE)
ENGINES = ("auto", "numba", "python")
ONE_PASS = {"lru": lru_stack_kernel, "belady": belady_ceiling_kernel}  # every capacity in one pass


@dataclass(frozen=True, eq=False)
class SimResult:
    """One replay: ``requests`` (polars, one row a request and pass) and ``summary`` (a dict).

    ``summary`` holds both hit rates, named (pitfall 10 in the README): ``token_hit_rate`` = hit
    tokens / prompt tokens (vLLM), ``request_hit_rate`` = requests with any hit / requests,
    and ``miss_reasons`` (missed tokens per reason). ``requests`` has a column per reason
    (they sum to ``prompt_tokens - hit_tokens``) and ``evicted_by``: the row whose insertion
    evicted the first evicted block the request missed (null: none).

    Example:
        >>> r = kv.simulate(kv.workloads.prefix_repetition(), block_size=16, passes=2)
        >>> r.by_pass()["token_hit_rate"].to_list()
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
                .with_columns((pl.col("hit_tokens") / pl.col("prompt_tokens")).alias("token_hit_rate"),
                              (pl.col("requests_hit") / pl.col("requests")).alias("request_hit_rate"))
                .sort("pass"))

    def __repr__(self) -> str:
        s = self.summary
        return (f"SimResult({self.policy} capacity={capacity_label(self.capacity_tokens)} "
                f"block_size={self.block_size}: token hit {s['token_hit_rate']:.1%}, request hit "
                f"{s['request_hit_rate']:.1%}, {s['requests']} requests)")

    def _repr_html_(self) -> str:
        s = self.summary
        rows = "".join(f"<tr><td>{k}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in s.items())
        src = f" · <code>{html.escape(self.source)}</code>" if self.source else ""
        return (f"<div><b>SimResult</b> {html.escape(self.policy)} · capacity "
                f"{capacity_label(self.capacity_tokens)} tokens · block {self.block_size}{src}"
                f"<table>{rows}</table></div>")


def simulate(source, policy: str = "lru", capacity_tokens: int | None = None,
             block_size: int | None = None, *, passes: int = 1, tokenizer=None,
             engine: str = "auto", priorities=None, policy_params: dict | None = None,
             cost=None, instances: int | None = None, **cluster) -> SimResult:
    """Replay a trace or workload through a cache policy; no model involved.

    ``source`` is a ``Trace``, a trace path, a ``Workload`` or a list of token-id sequences.
    ``capacity_tokens=None`` (or ``inf``) is unbounded. ``block_size`` defaults to the trace's
    (512 for Mooncake) or 16 for workloads. ``passes`` replays the source that many times into
    the same cache (pass 2 on is "warm"). ``engine="python"`` runs the plain reference replay.
    ``priorities`` (one int per source request, or a trace's ``priority`` column) and
    ``policy_params`` (e.g. ``{"pin_tokens": 1024}``) feed the policy's definition.
    ``cost`` (a ``kv.cost.fit`` model) adds estimated prefill seconds and TTFT saved.

    Example:
        >>> wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
        ...                                     num_prefixes=1)
        >>> r = kv.simulate(wl, block_size=16, passes=2)
        >>> r.by_pass()["hit_tokens"].to_list()
        [25088, 31200]

    ``instances=N`` replays a cluster instead (kvlab.cluster.simulate: ``router``, ``view``,
    ``load``, ``service``, ``requests``, ``router_params``, ``seed``) and returns its
    ClusterResult; ``instances=1`` hits what the single cache above hits.
    """
    if instances is not None:
        from ..cluster.simulate import simulate_cluster

        if passes != 1 or priorities is not None or policy_params or cost is not None:
            raise KvlabError("instances= replays one pass of the source without priorities, policy_params "
                             "or cost (the cluster's service times come from service=)")
        return simulate_cluster(source, instances, capacity_tokens=capacity_tokens, policy=policy,
                                block_size=block_size, tokenizer=tokenizer, engine=engine, **cluster)
    if cluster:
        raise KvlabError(f"{', '.join(sorted(cluster))} apply to a cluster replay: pass instances=N")
    _check_choice("policy", policy, POLICIES)
    _check_choice("engine", engine, ENGINES)
    tokens = _parse_capacity(capacity_tokens, policy)
    rep = prepare_replay(source, block_size, passes, tokenizer, priorities)
    cap = _blocks_of(tokens, rep.block_size)
    run = run_python if engine == "python" else run_kernel
    result = _result(rep, policy, tokens, run(rep, policy, cap, policy_params))
    return result if cost is None else cost.annotate(result)


def sweep(source, policy: str = "lru", capacities: Sequence = (), block_size: int | None = None,
          *, passes: int = 1, tokenizer=None, engine: str = "auto", priorities=None,
          policy_params: dict | None = None, reasons: bool = False) -> pl.DataFrame:
    """Hit ratios for many capacities at once: one row per capacity, in the order given.

    Every sweep also reports the ceiling: ``belady_hit_tokens`` / ``belady_token_hit_rate``
    (the offline optimum at that capacity) and ``gap_to_belady`` (its token hit rate minus
    the policy's). ``reasons=True`` adds the missed tokens per reason (one column each).
    LRU uses one pass of Mattson's stack-distance algorithm for all capacities, and belady (the
    ceiling included) one pass of its own (kvlab.sim.kernels_ceiling); other policies (and
    ``engine="numba"`` / ``"python"``, and ``reasons``) replay each capacity, compiled replays in
    parallel threads (``engine="python"`` replays the ceiling too); the ceiling's pass runs in a
    thread beside the policy's.
    ``capacity_tokens`` is null for an unbounded entry.

    Example:
        >>> kv.sweep(kv.traces.read(), "lru", [2**20, 2**24, None]).columns[:3]
        ['capacity_tokens', 'token_hit_rate', 'request_hit_rate']
    """
    _check_choice("policy", policy, POLICIES)
    _check_choice("engine", engine, ENGINES)
    if policy == "infinite":
        raise BudgetError("policy='infinite' has no capacity to sweep; use a policy such as 'lru'")
    capacities = list(capacities)
    if not capacities:
        raise BudgetError("sweep needs at least one capacity (tokens, or None for unbounded)")
    tokens = [_parse_capacity(c, policy) for c in capacities]
    rep = prepare_replay(source, block_size, passes, tokenizer, priorities)
    caps = [_blocks_of(c, rep.block_size) for c in tokens]
    why = None
    # the ceiling's pass runs beside the policy's own (its kernel releases the GIL)
    ceiling = None if policy == "belady" or engine == "python" else _beside(one_pass, rep, "belady", caps)
    if policy in ONE_PASS and engine == "auto" and not reasons:
        hit_blocks = one_pass(rep, policy, caps)
    elif engine != "python" and not reasons:
        hit_blocks = sweep_kernel(rep, policy, caps, policy_params)
    else:
        run = run_python if engine == "python" else run_kernel
        outs = [run(rep, policy, c, policy_params, reasons=reasons) for c in caps]
        hit_blocks = _stack([o.hits for o in outs], len(rep.hittable))
        why = [o.reasons.sum(axis=0) for o in outs] if reasons else None
    if policy == "belady":
        ceiling = hit_blocks
    elif engine == "python":
        ceiling = _stack([run_python(rep, "belady", c, reasons=False).hits for c in caps], len(rep.hittable))
    else:
        ceiling = ceiling.result()
    prompt, n, bs = int(rep.tokens.sum()), len(rep.tokens), rep.block_size
    hit_tokens = hit_blocks.sum(axis=0) * bs
    best = ceiling.sum(axis=0) * bs
    ratio = [float(h) / prompt if prompt else 0.0 for h in hit_tokens]
    best_ratio = [float(h) / prompt if prompt else 0.0 for h in best]
    cols = {"capacity_tokens": tokens, "token_hit_rate": ratio,
            "request_hit_rate": [float(x) / n if n else 0.0 for x in (hit_blocks > 0).sum(axis=0)],
            "hit_tokens": [int(h) for h in hit_tokens], "prompt_tokens": [prompt] * len(caps),
            "belady_hit_tokens": [int(h) for h in best], "belady_token_hit_rate": best_ratio,
            "gap_to_belady": [b - a for a, b in zip(ratio, best_ratio)]}
    schema = {"capacity_tokens": pl.Int64, "token_hit_rate": pl.Float64, "request_hit_rate": pl.Float64,
              "hit_tokens": pl.Int64, "prompt_tokens": pl.Int64, "belady_hit_tokens": pl.Int64,
              "belady_token_hit_rate": pl.Float64, "gap_to_belady": pl.Float64}
    for i, name in enumerate(MISS_REASONS if why is not None else ()):
        cols[name] = [int(w[i]) for w in why]
        schema[name] = pl.Int64
    return pl.DataFrame(cols, schema=schema)


# ---------------------------------------------------------------------------------------------
# helpers


def one_pass(rep: PreparedTrace, policy: str, caps) -> np.ndarray:
    """Hit blocks per request (rows) of ``policy`` (one of ``ONE_PASS``: lru, belady) at every
    capacity in ``caps`` (blocks, None: unbounded; columns, in the order given), in one pass.

    Example:
        >>> one_pass(prepare_replay([[1, 2, 3], [1, 2, 4]], 1, 1, None), "belady", [0, 1, None]).tolist()
        [[0, 0, 0], [0, 1, 2]]
    """
    kernel = ONE_PASS[policy]
    caps_arr = np.array([UNBOUNDED if c is None else c for c in caps], dtype=np.int64)
    order = np.argsort(caps_arr, kind="stable")
    per = kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps_arr[order])
    hit_blocks = np.empty(per.shape, dtype=np.int64)
    hit_blocks[:, order] = per
    return hit_blocks


_parse_capacity = parse_capacity


def _beside(fn, *args):
    """``fn(*args)`` started in a thread of its own (a new one each time: a pool's thread would
    not survive a fork); its future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvlab-beside")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends when the job does
    return future


def _stack(columns, n_requests: int) -> np.ndarray:
    return np.stack(columns, axis=1) if n_requests else np.zeros((0, len(columns)), dtype=np.int64)


def _blocks_of(capacity_tokens: int | None, block_size: int) -> int | None:
    """Whole blocks: a partial block's worth of capacity holds nothing."""
    return None if capacity_tokens is None else capacity_tokens // block_size


def _result(rep: PreparedTrace, policy, capacity_tokens, out: Replayed) -> SimResult:
    hit_blocks = np.asarray(out.hits, dtype=np.int64)
    cols = {"request": rep.request, "pass": rep.pass_no, "prompt_tokens": rep.tokens,
            "hit_blocks": hit_blocks, "hit_tokens": hit_blocks * rep.block_size, "hit": hit_blocks > 0}
    for i, name in enumerate(MISS_REASONS):
        cols[name] = out.reasons[:, i]
    frame = pl.DataFrame(cols).with_columns(
        pl.Series("evicted_by", out.evicted_by, dtype=pl.Int64).replace(-1, None))
    prompt = int(rep.tokens.sum())
    hit_tokens = int(hit_blocks.sum()) * rep.block_size
    n = len(rep.tokens)
    summary = {
        "policy": policy, "capacity_tokens": capacity_tokens, "block_size": rep.block_size,
        "requests": n, "passes": int(rep.pass_no.max()) if n else 0,
        "prompt_tokens": prompt, "hit_tokens": hit_tokens, "hit_blocks": int(hit_blocks.sum()),
        "token_hit_rate": hit_tokens / prompt if prompt else 0.0,
        "request_hit_rate": int((hit_blocks > 0).sum()) / n if n else 0.0,
        "evictions": int(out.evictions),
        "miss_reasons": {name: int(out.reasons[:, i].sum()) for i, name in enumerate(MISS_REASONS)},
    }
    return SimResult(frame, summary, policy, capacity_tokens, rep.block_size, rep.label)


def _check_choice(name, value, choices):
    if value not in choices:
        raise KvlabError(f"unknown {name} {value!r}; use one of {', '.join(choices)}")


def capacity_label(capacity) -> str:
    """A capacity for people: ``None`` -> "unbounded", 65536 -> "65,536"."""
    return "unbounded" if capacity is None else f"{capacity:,}"


def _fmt(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {n:,}" for k, n in v.items() if n)
    return f"{v:.4f}" if isinstance(v, float) else ("unbounded" if v is None else str(v))


def __getattr__(name):
    if name == "Replay":  # renamed: kv.replay's Replay is a replay's outcome, this is its input
        import warnings

        warnings.warn("kvlab.sim.simulator.Replay is deprecated: use PreparedTrace", FutureWarning, stacklevel=2)
        return PreparedTrace
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
