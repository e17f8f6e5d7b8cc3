"""The policy table: every eviction/admission policy kvlab knows, defined once, with its source.

``kv.simulate`` / ``kv.sweep`` (compiled kernels checked equal to these definitions) and
RadixStore / PagedStore (``policy=``) all take their policies from here.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..errors import KvlabError
from ..primitives.display import Html, summary_html
from .adaptive import ARC, S3FIFO
from .base import Policy
from .belady import Belady
from .frequency import LFU, TinyLFU, LengthAware
from .recency import FIFO, LRU, SLRU
from .weighted import CostAware, Priority


@dataclass(frozen=True)
class PolicyInfo:
    """One row of the table: the definition (a Policy class), where it comes from, what it does."""

    name: str
    definition: type
    source: str
    semantics: str

    @property
    def offline(self) -> bool:
        return self.definition.offline

    def __repr__(self) -> str:
        return f"PolicyInfo({self.name}: {self.semantics})"

    def _repr_html_(self) -> str:
        return summary_html(self.name, self.semantics,
                            Html(f"<a href='{html.escape(self.source)}'>source</a>"))


_ROWS = [
    (LRU, "https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/kv_cache_utils.py",
     "evict the least recently used (vLLM's free-block queue, SGLang's default)"),
    (FIFO, "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/mem_cache/evict_policy.py",
     "evict the oldest resident; hits do not refresh"),
    (LFU, "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/mem_cache/evict_policy.py",
     "evict the least used since it became resident; ties least recent"),
    (SLRU, "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/mem_cache/evict_policy.py",
     "probation LRU + protected LRU (80%); a hit promotes, victims from probation first"),
    (S3FIFO, "https://jasony.me/publication/sosp23-s3fifo.pdf",
     "small FIFO (10%) filters one-hit units, main FIFO with 2-bit reinsertion, ghost FIFO"),
    (ARC, "https://www.usenix.org/conference/fast-03/arc-self-tuning-low-overhead-replacement-cache",
     "recency list T1 and frequency list T2 with ghost lists steering T1's target size"),
    (TinyLFU, "https://arxiv.org/abs/1512.00727",
     "admission in front of LRU: a new unit displaces LRU's victim only if used more often"),
    (LengthAware, "https://arxiv.org/abs/2407.00079",
     "Mooncake's LengthAwareCache: LFU, ties evict blocks later in the request first"),
    (CostAware, "https://www.usenix.org/conference/usits-97/cost-aware-www-proxy-caching-algorithms",
     "GreedyDual-Size-Frequency on prefill compute per byte (deeper costs more); leaves only"),
    (Priority, "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/mem_cache/evict_policy.py",
     "lowest priority first, then LRU; pin_tokens pins a shared system prompt's blocks"),
    (Belady, "https://doi.org/10.1147/sj.52.0078",
     "offline optimum: evict the farthest next hittable use, descendants first"),
]

POLICIES: dict[str, PolicyInfo] = {cls.name: PolicyInfo(cls.name, cls, src, text) for cls, src, text in _ROWS}
ONLINE = tuple(n for n, p in POLICIES.items() if not p.offline)


def make_policy(name: str, capacity: int | None = None, **params) -> Policy:
    """A fresh policy by name; ``params`` are the definition's keyword options
    (``slru``: protected_percent, ``s3fifo``: small_percent, ``tinylfu``: sample_factor,
    ``cost_aware``: linear, ``priority``: pin_tokens).

    Example:
        >>> make_policy("slru", 100, protected_percent=50).protected_cap
        50
    """
    info = POLICIES.get(name) if isinstance(name, str) else None
    if info is None:
        raise KvlabError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    try:
        return info.definition(capacity, **params)
    except TypeError as e:
        raise KvlabError(f"policy {name!r} does not take {sorted(params)}: {e}") from None


def policies_frame():
    """The table as a polars frame: name, online/offline, semantics, source."""
    import polars as pl

    return pl.DataFrame([{"policy": p.name, "offline": p.offline, "semantics": p.semantics,
                          "source": p.source} for p in POLICIES.values()])


def store_policy(policy, capacity: int | None, params: dict | None = None, *, store: str = "store") -> Policy:
    """The policy a store evicts with: a name from POLICIES (made with ``capacity`` and
    ``params``) or a ready Policy instance. Offline policies are refused: a store cannot know
    the future.

    Example:
        >>> store_policy("arc", 1 << 20, store="radix")
        ARC(0 units, size 0 of 1,048,576)
    """
    if isinstance(policy, Policy):
        if params:
            raise KvlabError(f"{store}: policy_params apply to a policy name; configure the "
                             f"{type(policy).__name__} instance itself")
        chosen = policy
    else:
        chosen = make_policy(policy, capacity, **(params or {}))
    if chosen.offline:
        raise KvlabError(f"{store}: policy {chosen.name!r} is offline (it ranks by each unit's next "
                         "use, which only a replay knows); use it in kv.simulate / kv.sweep, or "
                         f"give the store one of {', '.join(ONLINE)}")
    return chosen
