"""Many sessions at once, as a timestamped trace the cluster simulator can route: a fleet of agents
(``kv.workloads.agentic_loop``) or chats (``multi_turn``), one seed each, their turns interleaved
in time. Session s starts at a seeded uniform time in ``[0, spread_s)`` and sends turn k + 1 an
exponential think time (mean ``think_s``) after turn k. The trace has a ``session`` column, which
the ``session`` rule hashes.

Example:
    >>> t = fleet(kv.load("tiny"), "agentic_loop", sessions=4, turns=3, system_tokens=200, tools=2)
    >>> len(t), t.frame["session"].n_unique()
    (12, 4)
"""

from __future__ import annotations

import numpy as np
import polars as pl

from ..errors import KvlabError


def fleet(tokenizer, workload: str = "agentic_loop", *, sessions: int = 32, turns: int = 6, think_s: float = 20.0,
          spread_s: float = 60.0, block_size: int = 16, seed: int = 0, **params):
    """A Trace of ``sessions`` x ``turns`` requests (module docstring); ``params`` go to the workload
    (the agent loop's billing header is off unless given: a fleet is about routing, not pitfall 1)."""
    from .. import workloads
    from ..experiments import traces

    if workload not in ("agentic_loop", "multi_turn"):
        raise KvlabError(f"a fleet runs agentic_loop or multi_turn sessions, not {workload!r}")
    if workload == "agentic_loop":
        params.setdefault("billing_header", False)
    rng = np.random.default_rng([seed, 34])
    ids, outs, at, who = [], [], [], []
    for s in range(sessions):
        wl = getattr(workloads, workload)(turns=turns, seed=seed * 100_003 + s, **params)
        t = rng.uniform(0, spread_s)
        for k, (r, x) in enumerate(zip(wl.requests, wl.token_ids(tokenizer))):
            t += rng.exponential(think_s) if k else 0.0
            ids.append(list(x))
            outs.append(r.max_tokens or 0)
            at.append(t)
            who.append(f"{workload}-{s}")
    order = np.argsort(at, kind="stable")
    t = traces.from_requests([ids[i] for i in order], [outs[i] for i in order], block_size,
                             timestamps=[int(at[i] * 1000) for i in order])
    frame = t.frame.with_columns(pl.Series("session", [who[i] for i in order]))
    return traces.Trace(frame, block_size, f"fleet:{workload}x{sessions}")
