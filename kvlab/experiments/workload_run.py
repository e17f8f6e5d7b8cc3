"""run_workload(): a workload through an Engine, and what the run says about itself: both hit
rates, every request's result and, when most missed tokens diverge at one place, the
``dominant_miss`` (where, the volatile field there, the rule that fixes it). ``kvlab workload``
prints it; ``%kvlab run`` shows the same sentence.

Example:
    >>> run = run_workload(kv.load("tiny"), "agentic_loop", store="paged", turns=3, max_tokens=2)
    >>> run.stats["reused_tokens"], run.dominant_miss.field
    (64, 'cch')
    >>> run_workload(kv.load("tiny"), "agentic_loop", store="paged", turns=3, max_tokens=2,
    ...              normalise=True).dominant_miss is None
    True
"""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from typing import Any

from ..diagnostics.dominant import DominantMiss, dominant_miss, request_why
from ..engine import Engine
from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from ..primitives.normalisation import DEFAULT_RULES, normalise as normalise_messages
from ..request import Request
from ..stores import make_store


@dataclass(frozen=True, eq=False)
class WorkloadRun:
    """One workload run: ``results`` (one ``Result`` per request), ``stats`` (the engine's, both hit
    rates named) and ``dominant_miss`` (None when no place holds most missed tokens)."""

    workload: str
    store: str
    normalised: bool
    results: tuple
    stats: dict
    dominant_miss: DominantMiss | None
    engine: Any = dataclasses.field(repr=False, default=None)

    def lines(self, surface: str = "cli") -> list[str]:
        """The report: one line per request, the hit rates, and the cause and fix when there is one."""
        s = self.stats
        out = [f"#{r.request_id}: reused {r.reused_tokens}/{r.prompt_tokens} · {request_why(r) or 'hit'}"
               for r in self.results]
        out.append(f"token hit rate {s['token_hit_rate']:.1%} ({s['reused_tokens']}/{s['prompt_tokens']} "
                   f"tokens) · request hit rate {s['request_hit_rate']:.1%}")
        if self.dominant_miss is not None:
            out.append(f"why: {self.dominant_miss.sentence(surface)}")
        return out

    def __repr__(self) -> str:
        s = self.stats
        why = f", dominant miss at token {self.dominant_miss.token_index}" if self.dominant_miss else ""
        return (f"WorkloadRun({self.workload} on {self.store}{' normalised' if self.normalised else ''}: "
                f"{s['requests']} requests, token hit {s['token_hit_rate']:.1%}{why})")

    def _repr_html_(self) -> str:
        rows = [(f"#{r.request_id}", f"{r.reused_tokens}/{r.prompt_tokens}", request_why(r))
                for r in self.results]
        why = "" if self.dominant_miss is None else self.dominant_miss._repr_html_()
        return summary_html("WorkloadRun", html.escape(self.workload), self.store,
                            f"token hit {self.stats['token_hit_rate']:.1%}",
                            body=table_html(("request", "reused", "why"), rows) + why)


def run_workload(model, workload, *, store: str = "radix", normalise: bool = False,
                 max_tokens: int | None = None, **params) -> WorkloadRun:
    """Run ``workload`` (a generator name with its ``params``, or a ``Workload``) through a fresh
    ``Engine(model, make_store(store))``; ``normalise`` applies ``kv.DEFAULT_RULES`` to every
    request's messages first (the fix ``dominant_miss`` names)."""
    from .. import workloads

    if isinstance(workload, str):
        gen = workloads.GENERATORS.get(workload.replace("-", "_"))
        if gen is None:
            raise KvlabError(f"unknown workload {workload!r}; use one of {sorted(workloads.GENERATORS)}")
        workload = gen(**params)
    engine = Engine(model, make_store(store, model=model))
    prompts = []
    for request in workload:
        if normalise and isinstance(request, Request) and request.messages is not None:
            request = dataclasses.replace(
                request, messages=tuple(normalise_messages(list(request.messages), DEFAULT_RULES)))
        engine.run(request, max_tokens)
        prompts.append(engine.tokens_of(request)[0])
    results = tuple(engine.results)
    return WorkloadRun(getattr(workload, "name", "workload"), store, normalise, results, engine.stats(),
                       dominant_miss(results, prompts), engine)


__all__ = ["WorkloadRun", "run_workload"]
