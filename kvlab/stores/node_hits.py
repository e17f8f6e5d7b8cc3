"""Which lookups a prefix-tree node served, kept exact across the tree's splits and merges.

A node's ``hits`` count the lookups that reused at least one of its tokens, its ``last_hit`` the
clock tick of the latest; the root (no tokens) serves nothing. A lookup that reuses only the first
k tokens of an edge is recorded with its reach k, so when the edge is later split at m (a request
parts ways inside it) the head keeps every hit and the tail only those that reached past m;
merging a head back into its only child adds the head's hits that stopped at its end.

``served`` maps reach (1..len(edge)) to [count, last tick].

Example:
    >>> s = credit({}, 476, tick=3)
    >>> head, tail = split(s, 400); hits(head), hits(tail)
    (1, 1)
    >>> hits(split(s, 476)[1])
    0
"""

from __future__ import annotations


def credit(served: dict, reach: int, tick: int) -> dict:
    """``served`` with one more lookup that reused the first ``reach`` tokens of the edge."""
    out = {k: list(v) for k, v in served.items()}
    count, last = out.get(reach, (0, 0))
    out[reach] = [count + 1, max(last, tick)]
    return out


def hits(served: dict) -> int:
    """Lookups that reused at least one token of the edge."""
    return sum(c for c, _ in served.values())


def last_hit(served: dict) -> int:
    """The clock tick of the latest of them (0: never hit)."""
    return max((t for _, t in served.values()), default=0)


def split(served: dict, m: int) -> tuple[dict, dict]:
    """An edge's record cut into its first ``m`` tokens' and the rest's."""
    head: dict = {}
    tail: dict = {}
    for reach, (count, last) in served.items():
        k = min(reach, m)
        c, t = head.get(k, (0, 0))
        head[k] = [c + count, max(t, last)]
        if reach > m:
            tail[reach - m] = [count, last]
    return head, tail


def join(head: dict, length: int, tail: dict) -> dict:
    """The record of a ``length``-token head merged with its only child's (``tail``): every lookup
    that reached the tail also covered the whole head, so only the rest of the head's stay."""
    out = {k: list(v) for k, v in head.items() if k < length}
    through, last = head.get(length, (0, 0))
    stopped = through - hits(tail)
    if stopped > 0:
        out[length] = [stopped, last]
    for reach, (count, t) in tail.items():
        out[length + reach] = [count, t]
    return out
