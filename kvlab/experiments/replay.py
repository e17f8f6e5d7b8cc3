"""Model-free replay through a real store: what each prompt would reuse, by the store's own code.

Every prompt's KV is a synthetic snapshot (one mlx-lm ``KVCache`` layer of shape [1, 1, n, 1],
float32: 8 bytes a token), and the store is driven exactly as the Engine drives it: ``lookup``
with ``limit = n - 1`` (the last token is always computed), then ``insert`` of the prompt's
snapshot. So RadixStore's subsumption and LRU, PagedStore's free queue, or any other store's
policy decide, not a second model of them. A budget in real bytes is scaled to synthetic bytes,
``floor(budget_bytes * 8 / bytes_per_token)``, which keeps every "does it fit" comparison exact
when an entry costs ``bytes_per_token`` per token (attention KV does).

``kv.simulate`` replays block LRU over traces of millions of blocks (numba); the tests check it
equals this replay through PagedStore for block-aligned capacities.

Example:
    >>> r = replay([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4]], "radix",
    ...            budget_bytes=8 * 4096, bytes_per_token=4096)
    >>> r.reused, r.matches
    ((0, 3, 3), ('miss', 'lcp', 'exact'))
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import BudgetError, KvlabError
from ..keys import CacheKey, cache_key
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import Snapshot, snapshot
from ..stores import STORE_NAMES, make_store
from ..primitives.tokens import Tokens, as_tokens
from ..primitives.units import fmt_bytes
from ..result import hit_rates

SYNTHETIC_BYTES_PER_TOKEN = 8  # keys and values of one float32 each


@dataclass(frozen=True, eq=False)
class Replay:
    """One replay: per prompt the tokens reused, the match kind, whether the store kept the
    entry (False: larger than the whole budget, which a live store refuses with BudgetError),
    and the evictions made for room; ``store`` is the synthetic store after the last prompt."""

    reused: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    matches: tuple[str, ...]
    stored: tuple[bool, ...]
    evictions: tuple[int, ...]
    store: Any
    budget_bytes: int | None
    bytes_per_token: float | None

    @property
    def token_hit_rate(self) -> float:
        return hit_rates(zip(self.prompt_tokens, self.reused))["token_hit_rate"]

    @property
    def request_hit_rate(self) -> float:
        return hit_rates(zip(self.prompt_tokens, self.reused))["request_hit_rate"]

    def rates(self) -> dict:
        """Both hit rates (named as in ``engine.stats()``), the reuse per prompt and the total."""
        return {"token_hit_rate": self.token_hit_rate, "request_hit_rate": self.request_hit_rate,
                "reused_tokens": list(self.reused), "prompt_tokens": sum(self.prompt_tokens)}

    def __repr__(self) -> str:
        budget = "store default" if self.budget_bytes is None else fmt_bytes(self.budget_bytes)
        name = self.store.name
        return (f"Replay({name} at {budget}: {len(self.reused)} prompts, token hit "
                f"{self.token_hit_rate:.1%}, request hit {self.request_hit_rate:.1%})")

    def _repr_html_(self) -> str:
        rows = [(i, m, f"{r} / {n}", "" if s else "too big", e) for i, (r, n, m, s, e) in enumerate(
            zip(self.reused, self.prompt_tokens, self.matches, self.stored, self.evictions))]
        table = table_html(("#", "match", "reused / prompt", "kept", "evictions"), rows)
        return summary_html("Replay", repr(self), body=table)


def scaled_budget(budget_bytes, bytes_per_token) -> int:
    """A real byte budget in synthetic bytes: ``floor(budget * 8 / bytes_per_token)``, at least 1.

    Exact, not rounded: an entry of n tokens fits (8n <= scaled) exactly when n * bytes_per_token
    <= budget_bytes.

    Example:
        >>> scaled_budget(10 * 4096, 4096)
        80
    """
    if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, (int, float)) \
            or not bytes_per_token > 0:
        raise BudgetError(f"bytes_per_token must be a positive number (the real KV bytes a token "
                          f"costs), got {bytes_per_token!r}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or budget_bytes < 0:
        raise BudgetError(f"budget_bytes must be a number of bytes >= 0, got {budget_bytes!r}")
    scaled = Fraction(budget_bytes) * SYNTHETIC_BYTES_PER_TOKEN / Fraction(bytes_per_token)
    return max(1, int(scaled))  # int() floors a non-negative Fraction


def synthetic_snapshot(n: int) -> Snapshot:
    """KV of n tokens for one KVCache layer of shape [1, 1, n, 1] float32 (zeros: stores never
    read the values)."""
    cache = KVCache()
    z = mx.zeros((1, 1, n, 1), dtype=mx.float32)
    cache.state = (z, z, n)
    return snapshot([cache])


def _keyed(prompt, i: int) -> tuple[CacheKey, Tokens]:
    if isinstance(prompt, CacheKey):
        return prompt, Tokens(prompt.ids, "")
    if isinstance(prompt, Tokens):
        return cache_key(prompt), prompt
    toks = as_tokens(prompt, name=f"prompt {i}")
    return cache_key(toks), toks


def _make(store, budget: int | None, block_size: int):
    if callable(store):
        return store(budget)
    if store not in STORE_NAMES or store == "none":
        raise KvlabError(f"replay needs a store name ({', '.join(n for n in STORE_NAMES if n != 'none')}) "
                         f"or a callable budget_bytes -> store; got {store!r}")
    return make_store(store, budget_bytes=budget, block_size=block_size)


def replay(prompts: Sequence, store: str | Callable = "radix", *, budget_bytes=None,
           bytes_per_token=None, block_size: int = 16, entries: Sequence | None = None) -> Replay:
    """Replay ``prompts`` through a fresh store without a model (see the module docstring).

    ``prompts``: token-id sequences, ``Tokens`` or ``CacheKey``s (a salt or extra keys kept).
    ``store``: a store name (``"radix"``, ``"paged"``, ...) or a callable that takes the
    synthetic budget (None: the store's default) and returns a store, e.g.
    ``lambda b: kv.RadixStore(b, subsume=False)``. ``budget_bytes`` (real bytes) needs
    ``bytes_per_token``; ``block_size`` is the paged store's. ``entries``: what each request
    inserted instead of its prompt (``keying="prompt+output"``: prompt + output ids).

    Example:
        >>> r = replay(prompts, "paged", budget_bytes=8 << 20, bytes_per_token=3072)
        >>> r.reused, r.store.blocks_frame().height
    """
    if budget_bytes is not None and bytes_per_token is None:
        raise BudgetError("budget_bytes is in real bytes: pass bytes_per_token too (the KV bytes "
                          "one token costs, e.g. engine events' bytes / tokens)")
    budget = None if budget_bytes is None else scaled_budget(budget_bytes, bytes_per_token)
    target = _make(store, budget, block_size)
    prompts = list(prompts)
    if entries is not None and len(entries) != len(prompts):
        raise KvlabError(f"{len(prompts)} prompts but {len(entries)} entries; pass one entry per prompt")
    snaps: dict[int, Snapshot] = {}  # immutable, so one per length serves every prompt of it
    reused, lengths, matches, stored, evictions = [], [], [], [], []
    for i, prompt in enumerate(prompts):
        key, toks = _keyed(prompt, i)
        n = len(key.ids)
        lengths.append(n)
        if n == 0:
            raise KvlabError(f"prompt {i} has no tokens; every request needs at least one")
        match = target.lookup(key, toks, limit=n - 1)
        hit = match.tokens if match.snapshot is not None and match.tokens > 0 else 0
        reused.append(hit)
        matches.append(match.kind if hit else "miss")
        kind = "prompt"
        if entries is not None and entries[i] is not None:
            key, kind = CacheKey(tuple(int(t) for t in entries[i]), key.extra_keys, key.salt), "prompt+output"
        m = len(key.ids)
        if m not in snaps:
            snaps[m] = synthetic_snapshot(m)
        try:
            target.insert(key, toks, snaps[m], kind=kind)
            stored.append(True)
        except BudgetError:
            stored.append(False)
        evictions.append(sum(ev.capacity for ev in target.drain_events()))
    return Replay(tuple(reused), tuple(lengths), tuple(matches), tuple(stored), tuple(evictions), target,
                  None if budget_bytes is None else int(budget_bytes), bytes_per_token)
