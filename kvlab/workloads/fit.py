"""fit_to_context(): a workload shrunk until every request fits the model's context (the seeds'
10k-28k-token prompts exceed the small models' contexts).

Example:
    >>> from kvlab.workloads import agentic_loop
    >>> wl, used = fit_to_context(agentic_loop, m, system_tokens=28_000, turns=2)
    >>> used < 28_000
    True
"""

from __future__ import annotations

from ..errors import RequestError
from ..request import Workload


def fit_to_context(generator, model, *, size: str = "system_tokens", **params) -> tuple[Workload, int]:
    """``generator(**params)``, with ``params[size]`` shrunk until every request plus its
    ``max_tokens`` fits the model's context. Returns the workload and the size it used (say so
    beside the result).

    Example:
        >>> wl, used = kv.workloads.fit_to_context(kv.workloads.shared_system_prompt, m,
        ...                                        system_tokens=800, num_users=2)
        >>> used, len(wl)
        (800, 2)
    """
    if size not in params:
        raise RequestError(f"fit_to_context shrinks {size!r}, so pass it: {size}=...")
    limit = model.context_length
    want = params[size]
    for _ in range(12):
        wl = generator(**params)
        longest = max(len(model.tokenise(list(r.messages)) if r.messages is not None else r.ids)
                      + r.max_tokens for r in wl)
        if not limit or longest <= limit:
            return wl, params[size]
        params[size] = int(params[size] * limit / longest * 0.95)
        if params[size] < 1:
            break
    raise RequestError(f"{generator.__name__} does not fit {model.name}'s context of {limit} tokens "
                       f"even with {size} shrunk from {want}; lower the other sizes or max_tokens")
