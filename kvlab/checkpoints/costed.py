"""The cost-aware checkpoint policy: checkpoint where the expected prefill seconds saved per byte
held is highest, learning from the prompts it has seen which prefixes come back.

What a checkpoint at position p costs and is worth:

- bytes: ``StateBytes`` of the model, fixed recurrent state plus KV per token (a sliding window's
  layers only up to the window), measured once from the model's own cache objects;
- seconds: what the next request would not prefill, ``cost.predict(0, p + 1) - cost.predict(p, 1)``
  with ``cost`` a fitted ``kv.cost`` model (a ``NominalCost`` of the same shape until one is given);
- the chance a later request restores exactly there: for the tip (n - 1), the share of earlier
  prompts that a later prompt continued (Laplace-smoothed: 1/2 before any evidence); for a message
  end, k/(k+1) after k earlier prompts held the same prefix, and 0 before any: **the policy waits
  for a repeated sighting**, and says so in ``why_missed`` when a request misses for that reason
  (a policy that caches only what it saw again, as vLLM #45238 asks, must say why it missed).

It checkpoints the best position and every other whose value per byte is at least ``within`` of
the best. Its memory of sightings (``Sightings``) is the one mutable part, owned by whoever owns the
policy (an Engine); prompts are told apart by their ids, so asking twice about one prompt counts once.

Example:
    >>> policy = CostAware(bytes=StateBytes(11264, ((None, 512),)))
    >>> policy.positions(toks)      # first request: the tip only; its system end waits
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..primitives.display import summary_html
from ..primitives.snapshots import advance, make_cache, snapshot
from .simple import CheckpointPolicy


@dataclass(frozen=True)
class NominalCost:
    """A prefill cost model of kvlab's shape (``kv.cost``: t = a + b·new + c·new·cached + d·new²)
    with nominal coefficients (a small model on CPU, in seconds): only ratios matter to a policy's
    choice, so it stands in until a fitted ``kv.cost.fit(model)`` is passed."""

    a: float = 2e-3
    b: float = 1e-3
    c: float = 2e-8
    d: float = 2e-8

    def predict(self, cached, new):
        return self.a + self.b * new + self.c * new * cached + self.d * new * new

    def __repr__(self) -> str:
        return f"NominalCost(a={self.a}, b={self.b}, c={self.c}, d={self.d})"

    def _repr_html_(self) -> str:
        return summary_html("NominalCost", repr(self)[12:-1])


@dataclass(frozen=True)
class StateBytes:
    """Bytes a snapshot of a model's cache holds after p tokens: ``fixed`` (recurrent state, conv
    windows) plus, per term ``(cap, per_token)``, per_token·min(p, cap) (cap: a sliding window's
    size; None: full KV).

    Example:
        >>> StateBytes(11264, ((None, 512), (32, 256)))(100)
        70656
    """

    fixed: int
    terms: tuple[tuple[int | None, int], ...] = ()

    def __call__(self, p: int) -> int:
        return self.fixed + sum(per * (p if cap is None else min(p, cap)) for cap, per in self.terms)

    @classmethod
    def of(cls, model) -> "StateBytes":
        """Measured from ``model``'s own cache after one and two tokens, layer by layer."""
        ids = (1, 2)
        cache = make_cache(model)
        advance(model, ids[:1], cache)
        one = snapshot(cache, tokens=ids[:1], model=model)
        advance(model, ids[1:], cache)
        two = snapshot(cache, tokens=ids, model=model)
        layers = model.layout.layers
        fixed, terms = 0, {}
        for i, (a, b) in enumerate(zip(one.layers, two.layers)):
            per = b.nbytes - a.nbytes
            fixed += a.nbytes - per
            cap = layers[i].window if i < len(layers) and layers[i].kind == "window" else None
            if per:
                terms[cap] = terms.get(cap, 0) + per
        return cls(fixed, tuple(sorted(terms.items(), key=lambda t: (t[0] is not None, t[0] or 0))))

    def __repr__(self) -> str:
        parts = " + ".join(f"{per} B/token" + (f" (first {cap})" if cap else "") for cap, per in self.terms)
        return f"StateBytes({self.fixed} B fixed" + (f" + {parts})" if parts else ")")

    def _repr_html_(self) -> str:
        return summary_html("StateBytes", repr(self)[11:-1])


class Sightings:
    """What a learning policy has seen: per prefix (at a candidate position) the prompts that held
    it, the prefixes it declined on first sight, and which prompt tips a later prompt continued."""

    def __init__(self):
        self.prompts: set[int] = set()
        self.held: dict[int, set[int]] = {}      # prefix hash -> prompts that held it
        self.declined: dict[int, int] = {}       # prefix hash -> its length, declined on first sight
        self.tips: dict[int, dict[int, bool]] = {}  # tip length -> {prefix hash: continued since}

    def before(self, h: int, prompt: int) -> int:
        """Earlier prompts (not ``prompt``) that held the prefix hashed ``h``."""
        seen = self.held.get(h, ())
        return len(seen) - (prompt in seen)

    def continuation_rate(self) -> float:
        flags = [c for by_hash in self.tips.values() for c in by_hash.values()]
        return (sum(flags) + 1) / (len(flags) + 2)

    def __repr__(self) -> str:
        return (f"Sightings({len(self.prompts)} prompts, {len(self.held)} prefixes, "
                f"{len(self.declined)} waiting for a repeat)")

    def _repr_html_(self) -> str:
        return summary_html("Sightings", repr(self)[10:-1])


@dataclass(frozen=True, repr=False)
class CostAware(CheckpointPolicy):
    """Checkpoint where expected prefill seconds saved per byte held is highest (module
    docstring): kvlab's own; the schemes of mlx-lm #1515 and vLLM's cache-after-sightings are of
    this family."""

    cost: object = field(default_factory=NominalCost)
    bytes: StateBytes | None = None
    within: float = 0.5
    memory: Sightings = field(default_factory=Sightings, compare=False)
    name = "cost_aware"
    server = "kvlab: expected prefill seconds saved per byte, learned from sightings"

    def for_model(self, model) -> "CostAware":
        if self.bytes is not None:
            return self
        return CostAware(self.cost, StateBytes.of(model), self.within, self.memory)

    def _candidates(self, toks) -> dict[int, int]:
        """Candidate positions: message ends (p -> its message index) and the tip (-1)."""
        n = len(toks.ids)
        out = {s.token_end: s.index for s in toks.spans if 0 < s.token_end < n - 1}
        if n > 1:
            out[n - 1] = -1
        return out

    def saved_s(self, p: int) -> float:
        return float(self.cost.predict(0, p + 1) - self.cost.predict(p, 1))

    def value(self, p: int, chance: float) -> float:
        """Expected seconds saved per byte held by a checkpoint at ``p``."""
        nbytes = self.bytes(p) if self.bytes is not None else p + 1
        return chance * self.saved_s(p) / max(nbytes, 1)

    def ends(self, toks, tokenizer):
        ids, mem = toks.ids, self.memory
        prompt = hash(ids)
        if prompt not in mem.prompts:
            for length, by_hash in mem.tips.items():
                if len(ids) > length:
                    h = hash(ids[:length])
                    if h in by_hash:
                        by_hash[h] = True
        cands = self._candidates(toks)
        hashes = {p: hash(ids[:p]) for p in cands}
        rate = mem.continuation_rate()
        values = {}
        for p, message in cands.items():
            k = mem.before(hashes[p], prompt)
            chance = rate if message < 0 else k / (k + 1)
            values[p] = self.value(p, chance)
            if message >= 0 and k == 0 and prompt not in mem.prompts:
                mem.declined.setdefault(hashes[p], p)
        if prompt not in mem.prompts:
            for p, h in hashes.items():
                mem.held.setdefault(h, set()).add(prompt)
            if len(ids) > 1:
                mem.tips.setdefault(len(ids) - 1, {}).setdefault(hashes[len(ids) - 1], False)
            mem.prompts.add(prompt)
        best = max(values.values(), default=0.0)
        return [p for p, v in values.items() if best > 0 and v >= self.within * best]

    def why_missed(self, toks, reused: int) -> str:
        ids, mem = toks.ids, self.memory
        prompt = hash(ids)
        for p, message in sorted(self._candidates(toks).items(), reverse=True):
            h = hash(ids[:p])
            if p > reused and message >= 0 and h in mem.declined and mem.before(h, prompt) == 1:
                return (f"cost_aware waits for a repeated sighting: the prefix of {p} tokens (to the "
                        f"end of message {message}) was seen once before and not checkpointed then, "
                        f"so {p - reused} tokens were prefilled again; it checkpoints it now that "
                        "it has seen it twice")
        return ""
