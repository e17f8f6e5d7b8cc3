"""The offline optimum: checkpoint exactly the prefixes later requests reuse, chosen with the whole
request sequence in view, under a byte budget.

A checkpoint is a prefix P of p tokens, taken while prefilling the first request that holds P
with p <= its length - 1 (a prompt's last token is always recomputed, so a request cannot
checkpoint its own end). It serves every later request that starts with P and is longer than p.
The candidates are the prefixes where two requests part: min(lcp(i, j), n_i - 1, n_j - 1) for
every pair i < j. ``plan_optimal`` takes them greedily by tokens saved per byte (the marginal
tokens: a request served by a deeper checkpoint gains only the difference) until the budget is
spent: the greedy bound of the knapsack, exact when the budget holds every useful checkpoint.

Example:
    >>> policy = plan_optimal([r1_ids, r2_ids, r3_ids], StateBytes(11264, ((None, 512),)), budget=1 << 20)
    >>> policy.planned_reuse, policy.planned_bytes
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvlabError
from ..primitives.tokens import common_prefix_len
from .simple import CheckpointPolicy


def reachable(seqs) -> list[int]:
    """Per request, the most any checkpoint policy could let it reuse (no budget): the longest
    prefix it shares with an earlier request that the earlier one could checkpoint."""
    seqs = [tuple(s) for s in seqs]
    return [max((min(common_prefix_len(seqs[i], s), len(s) - 1, len(seqs[i]) - 1)
                 for i in range(j)), default=0) for j, s in enumerate(seqs)]


@dataclass(frozen=True, repr=False)
class Optimal(CheckpointPolicy):
    """The offline optimum for one workload (``plan_optimal``): it sees the whole request
    sequence, so no server can run it; it is the bound the others are measured against."""

    keep: frozenset = frozenset()  # the planned prefixes (tuples of ids)
    budget: int | None = None
    planned_reuse: tuple[int, ...] = ()
    planned_bytes: int = 0
    name = "optimal"
    server = "none: the offline optimum (sees every later request)"

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(sorted({len(p) for p in self.keep}))

    def ends(self, toks, tokenizer):
        ids = toks.ids
        return [p for p in self.lengths if p < len(ids) and ids[:p] in self.keep]

    def __repr__(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget} B"
        return (f"CheckpointPolicy(optimal: {len(self.keep)} checkpoints, {self.planned_bytes} B of "
                f"{budget}, {sum(self.planned_reuse)} tokens reused)")


def plan_optimal(seqs, state_bytes, budget: int | None = None) -> Optimal:
    """The optimal policy for the requests ``seqs`` (token ids, in order) when a checkpoint of p
    tokens holds ``state_bytes(p)`` bytes and all checkpoints together at most ``budget``."""
    seqs = [tuple(int(i) for i in s) for s in seqs]
    if budget is not None and budget < 0:
        raise KvlabError(f"budget must be >= 0 bytes (None: no budget), got {budget!r}")
    cands: dict[tuple, list[int]] = {}  # prefix -> the requests it serves
    for j, s in enumerate(seqs):
        for i in range(j):
            q = min(common_prefix_len(seqs[i], s), len(s) - 1, len(seqs[i]) - 1)
            if q >= 1 and s[:q] not in cands:
                prefix = s[:q]
                holders = [k for k, t in enumerate(seqs) if len(t) > q and t[:q] == prefix]
                cands[prefix] = holders[1:]  # the first holder takes it; the later ones reuse it
    best = [0] * len(seqs)
    left = float("inf") if budget is None else budget
    keep, spent = set(), 0
    while True:
        pick, pick_key = None, None
        for prefix, served in cands.items():
            if prefix in keep:
                continue
            cost = state_bytes(len(prefix))
            gain = sum(max(0, len(prefix) - best[j]) for j in served)
            if gain == 0 or cost > left:
                continue
            key = (gain / max(cost, 1), gain, -len(prefix))
            if pick_key is None or key > pick_key:
                pick, pick_key = prefix, key
        if pick is None:
            break
        keep.add(pick)
        cost = state_bytes(len(pick))
        left -= cost
        spent += cost
        for j in cands[pick]:
            best[j] = max(best[j], len(pick))
    return Optimal(frozenset(keep), budget, tuple(best), spent)
