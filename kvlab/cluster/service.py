"""How long an instance takes: the prefill cost model (kvlab.experiments.cost: t = a + b·new +
c·new·cached + d·new²) for the tokens a request does not hit, and a decode time per output token.

``ServiceModel()`` is a stated default, not a measurement: 8,000 prefill tokens a second and 25 ms
a decode token (a 7B-class model on one datacentre GPU), so the Mooncake synthetic trace loads 8
instances to about 95% with no cache. ``from_cost`` takes a fitted ``kv.cost.fit`` model;
``calibrate`` fits prefill seconds to a kvlab serve run's rows (prompt, reused tokens, TTFT).

Example:
    >>> ServiceModel().prefill_s(0, 8000)
    1.0
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np

from ..errors import KvlabError


@dataclass(frozen=True)
class ServiceModel:
    """Prefill seconds ``a + b·new + c·new·cached + d·new²``; ``decode_s`` per output token."""

    a: float = 0.0
    b: float = 1 / 8000
    c: float = 0.0
    d: float = 0.0
    decode_s: float = 0.025
    source: str = "default: 8,000 prefill tokens/s, 25 ms a decode token"

    def prefill_s(self, cached, new) -> float:
        return self.a + self.b * new + self.c * new * cached + self.d * new * new

    def slots(self, block_size: int) -> list[float]:
        """decide's shared parameter slots (kvlab.cluster.decide.P_*)."""
        return [self.a, self.b, self.c, self.d, self.decode_s, float(block_size), 0.0, 0.0]

    @classmethod
    def from_cost(cls, cost, decode_s: float = 0.025) -> "ServiceModel":
        """A fitted ``kv.cost`` CostModel's prefill terms with ``decode_s`` per output token."""
        return cls(cost.a, cost.b, cost.c, cost.d, float(decode_s), f"cost model {cost.model}")

    @classmethod
    def calibrate(cls, prompt_tokens, reused_tokens, ttft_s, decode_s: float = 0.0,
                  source: str = "calibrated", robust: bool = False) -> "ServiceModel":
        """Fit ``a + b·new`` (both >= 0) to measured TTFTs of requests that did not queue (sent one
        at a time): least squares, or with ``robust`` Theil-Sen (the median of pairwise slopes, then
        the median intercept), which a few requests slowed by a busy machine do not drag.

        Example:
            >>> ServiceModel.calibrate([100, 200, 300], [0, 0, 100], [0.2, 0.3, 0.3]).b
            0.001
        """
        new = np.asarray(prompt_tokens, np.float64) - np.asarray(reused_tokens, np.float64)
        t = np.asarray(ttft_s, np.float64)
        if len(t) < 2 or not np.all(t > 0):
            raise KvlabError("calibrate needs at least two requests with a positive TTFT each")
        if robust:
            i, j = np.triu_indices(len(t), 1)
            keep = new[j] != new[i]
            b = float(np.median((t[j] - t[i])[keep] / (new[j] - new[i])[keep])) if keep.any() else 0.0
            a = float(np.median(t - b * new))
        else:
            (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(new), new], axis=1), t, rcond=None)
        if a < 0 or b < 0:  # one term alone, whichever fits better (by the same measure)
            pos = new > 0
            if robust:
                b_only = float(np.median(t[pos] / new[pos])) if pos.any() else 0.0
                a_only, loss = float(np.median(t)), np.abs
            else:
                b_only = float(new @ t / (new @ new)) if new @ new > 0 else 0.0
                a_only, loss = float(t.mean()), np.square
            a, b = ((0.0, b_only) if np.sum(loss(new * b_only - t)) < np.sum(loss(a_only - t)) else (a_only, 0.0))
        return cls(float(a), float(round(b, 12)), 0.0, 0.0, float(decode_s), source)

    def __repr__(self) -> str:
        return (f"ServiceModel({self.a * 1e3:.3g} ms + {self.b * 1e6:.3g} µs·new + {self.c * 1e9:.3g} "
                f"ns·new·cached + {self.d * 1e9:.3g} ns·new², decode {self.decode_s * 1e3:.3g} ms/token)")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code> <small>{html.escape(self.source)}</small>"
