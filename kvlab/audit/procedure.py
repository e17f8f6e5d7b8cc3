"""``kvlab audit``: Gu et al.'s prompt-cache audit ("Auditing Prompt Caching in Language Model
APIs", ICML 2025) against any OpenAI-compatible server, or a kvlab proxy in front of one.

Per level (``same-key``: the attacker is the victim's key; ``same-tenant`` / ``cross-tenant``: the
attacker's key, which the caller says is of the victim's tenant or of another), as published:

- hit samples: a fresh victim prompt (``prompt_letters`` random letters) sent ``repeats`` times
  with the victim's key, then the attacker's prompt, sharing its first ``fraction`` of the letters
  and random after, timed; miss samples: a fresh random prompt, timed. ``samples`` of each, in one
  shuffled order, every request ``max_tokens=1``;
- a one-sided two-sample KS test (kvlab.audit.ks: hit times smaller) at ``alpha`` on the client's
  time to first byte and on the streamed time to first token; the smaller p, doubled (Bonferroni
  over the two), decides: ``shared`` or ``not detected``;
- escalation: each fraction (100%, then 95%), each repeat count (1, 5, 25), until one is shared.

Plus the metadata verdict, from the same probes: does the ``cached_tokens`` each reported, or a
counter the attacker's key can read (``/v1/cache/stats``, ``/kvlab/stats``; read around the first
``metadata_pairs`` hit and miss probes), come out larger for every hit probe than for any miss?
And the smallest shared length the timing test could detect:
the measured hit times moved toward the misses by the measured time saved per shared token, for
every token less shared, until the test stops rejecting (``smallest_shared``).

Profiles: ``faithful`` is the paper's (5000 letters, 250 + 250, fractions 1.0 and 0.95, repeats 1,
5, 25); ``fast`` runs in well under a minute a level on a tiny model here (2000 letters, 30 + 30,
95% shared, one victim request): it rejects only at D+ >= 0.73 (``critical_d(30, 30, 5e-9)``)
where faithful rejects at 0.27, so it detects a sharing server only when the hit probes' CDF rises
0.73 above the misses' somewhere (measured here at 1000 letters, tiny model, load average 6-8 on
2 cores: D+ 0.90 to 1.0 against mlx_lm.server, vllm-mlx and kvlab serve; at 2000, 1.0 at load ~9). Random delays hit both kinds alike (one
shuffled order), so a loaded machine lowers D+ but cannot raise it: "not detected" needs nothing
from the machine, "shared" needs hits to stay well ahead of misses. On the tiny model with kvlab's
CPU attention, at load average ~9 on 2 cores: at 2000 letters the slowest hit took 255 ms and the
fastest miss 340 ms (quiet: hits ~25 ms, misses ~180 ms); at 1000 letters the two overlapped (334
against 230 ms) and two test suites at once hid the positive control; at 500 letters a quiet
machine's gap was 16 ms.

Each run draws fresh prompts (``seed=None``: a new seed, recorded in the report): a second run
with the prompts of the first would find its miss probes cached by the first and read "not
detected" against a sharing server.

Example:
    >>> report = audit("http://127.0.0.1:8080", "victim-key", "attacker-key", profile="fast")
    >>> report.to_json()["levels"][0]["verdict"]
    'shared'
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from .ks import KS, ks_less
from .probe import Probe, letters, text

LEVELS = ("same-key", "same-tenant", "cross-tenant")
JSON_LEVEL_KEYS = ("level", "verdict", "ks_d", "p", "hit_median_s", "miss_median_s", "samples", "metadata_leak")


@dataclass(frozen=True)
class Profile:
    """How much of the published procedure runs (module docstring)."""

    name: str
    prompt_letters: int
    samples: int
    fractions: tuple[float, ...]
    repeats: tuple[int, ...]
    alpha: float = 1e-8
    metadata_pairs: int = 4

    def __repr__(self) -> str:
        return (f"Profile({self.name}: {self.prompt_letters} letters, {self.samples}+{self.samples} samples, "
                f"fractions {self.fractions}, repeats {self.repeats}, alpha {self.alpha:g})")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


PROFILES = {"faithful": Profile("faithful", 5000, 250, (1.0, 0.95), (1, 5, 25)),
            "fast": Profile("fast", 2000, 30, (0.95,), (1,))}


@dataclass
class Level:
    """One level's outcome; ``to_json()`` has exactly the issue's keys. ``tried``: every
    (fraction, repeats, measure, KS) run, in order; ``hit``/``miss``: the deciding run's times."""

    level: str
    verdict: str = "not detected"
    ks: KS | None = None
    measure: str = ""
    fraction: float = 0.0
    repeats: int = 0
    hit: list = field(default_factory=list)
    miss: list = field(default_factory=list)
    metadata_leak: bool = False
    metadata: dict = field(default_factory=dict)
    smallest_tokens: int | None = None
    tried: list = field(default_factory=list)
    observed: dict = field(default_factory=dict)  # what the attacker read, per probe kind

    def to_json(self) -> dict:
        return {"level": self.level, "verdict": self.verdict, "ks_d": self.ks.d if self.ks else None,
                "p": self.p, "hit_median_s": _median(self.hit), "miss_median_s": _median(self.miss),
                "samples": len(self.hit) + len(self.miss), "metadata_leak": self.metadata_leak}

    @property
    def p(self) -> float | None:
        return None if self.ks is None else min(1.0, 2 * self.ks.p)  # two measures: Bonferroni

    def __repr__(self) -> str:
        return (f"Level({self.level}: {self.verdict}, D+ {self.ks.d if self.ks else float('nan'):.2f}, "
                f"p {self.p if self.p is not None else float('nan'):.2g}, metadata leak {self.metadata_leak})")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


@dataclass
class Report:
    """An audit's outcome: the target, the profile, one Level per level asked, and the seed its
    prompts and sample order were drawn with (``audit(seed=...)`` repeats them)."""

    target: str
    profile: Profile
    levels: list[Level]
    seed: int

    @property
    def smallest_detectable_tokens(self) -> int | None:
        found = [lv.smallest_tokens for lv in self.levels if lv.smallest_tokens is not None]
        return min(found) if found else None

    def to_json(self) -> dict:
        """``{"target", "profile", "seed", "levels": [...], "smallest_detectable_shared_tokens"}``."""
        return {"target": self.target, "profile": self.profile.name, "seed": self.seed,
                "levels": [lv.to_json() for lv in self.levels],
                "smallest_detectable_shared_tokens": self.smallest_detectable_tokens}

    def verdicts(self) -> dict:
        return {lv.level: lv.verdict for lv in self.levels}

    def __repr__(self) -> str:
        return f"Report({self.target}, {self.profile.name}: {self.verdicts()})"

    def _repr_html_(self) -> str:
        rows = [[lv.level, lv.verdict, lv.measure, f"{lv.ks.d:.2f}" if lv.ks else "",
                 f"{lv.p:.2g}" if lv.p is not None else "",
                 _ms(_median(lv.hit)), _ms(_median(lv.miss)), len(lv.hit) + len(lv.miss), lv.metadata_leak]
                for lv in self.levels]
        return summary_html("kvlab audit", self.target, repr(self.profile), f"seed {self.seed}", body=table_html(
            ("level", "verdict", "measure", "D+", "p", "hit median", "miss median", "samples", "metadata leak"), rows))


def audit(url: str, victim_key: str | None, attacker_key: str | None = None, *, levels=None,
          profile="fast", seed: int | None = None, model: str | None = None, progress=None) -> Report:
    """Run the audit (module docstring) against ``url``. ``levels``: default ``same-key`` (the
    positive control) and, with an attacker key that differs, ``cross-tenant``. ``profile``: a
    name in :data:`PROFILES` or a :class:`Profile`. ``seed``: of the random prompts and the sample
    order; None draws a new one (module docstring: why a rerun must not repeat its prompts).
    ``progress(message)`` hears each step."""
    prof = PROFILES.get(profile) if isinstance(profile, str) else profile
    if prof is None:
        raise KvlabError(f"unknown audit profile {profile!r}; use one of {', '.join(PROFILES)}")
    if levels is None:
        levels = ["same-key"] + (["cross-tenant"] if attacker_key and attacker_key != victim_key else [])
    for lv in levels:
        if lv not in LEVELS:
            raise KvlabError(f"unknown audit level {lv!r}; use one of {', '.join(LEVELS)}")
        if lv != "same-key" and not attacker_key:
            raise KvlabError(f"level {lv} needs --attacker-key (a second key)")
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    say = progress or (lambda msg: None)
    victim = Probe(url, victim_key, model=model)
    attacker = Probe(url, attacker_key, model=victim.model) if attacker_key else victim
    try:
        out = []
        for lv in levels:
            probe = victim if lv == "same-key" else attacker
            result = Level(lv)
            timing_verdict(result, victim, probe, prof, rng, say)
            metadata_verdict(result, prof.metadata_pairs)
            out.append(result)
        return Report(victim.url, prof, out, seed)
    finally:
        victim.close()
        if attacker is not victim:
            attacker.close()


def timing_verdict(result: Level, victim: Probe, probe: Probe, prof: Profile, rng: random.Random, say) -> None:
    """Gu et al.'s escalation for one level; fills ``result`` (module docstring)."""
    n_share = {f: int(round(f * prof.prompt_letters)) for f in prof.fractions}
    for fraction in prof.fractions:
        for repeats in prof.repeats:
            say(f"{result.level}: {fraction:.0%} shared, victim x{repeats}")
            plan = ["hit"] * prof.samples + ["miss"] * prof.samples
            rng.shuffle(plan)
            times = {"hit": [], "miss": []}
            observed: dict[str, dict[str, list]] = {}
            for kind in plan:
                if kind == "hit":
                    shared = letters(rng, prof.prompt_letters)
                    for _ in range(repeats):
                        victim.send(text(shared))
                    prompt = shared[:n_share[fraction]] + letters(rng, prof.prompt_letters - n_share[fraction])
                else:
                    prompt = letters(rng, prof.prompt_letters)
                watch = len(times[kind]) < prof.metadata_pairs  # counters read around the first few
                before = probe.counters() if watch else {}
                t = probe.probe(text(prompt))
                times[kind].append(t)
                moved = {k: v - before[k] for k, v in probe.counters().items() if k in before} if watch else {}
                for name, value in {"cached_tokens": t.cached, **moved}.items():
                    if name == "cached_tokens" or watch:
                        observed.setdefault(name, {"hit": [], "miss": []})[kind].append(value)
            tests = {m: ks_less([getattr(t, m) for t in times["hit"]], [getattr(t, m) for t in times["miss"]])
                     for m in ("ttfb_s", "ttft_s")}
            measure = min(tests, key=lambda m: tests[m].p)
            result.tried.append((fraction, repeats, tests))
            result.ks, result.measure, result.fraction, result.repeats = tests[measure], measure, fraction, repeats
            result.hit = [getattr(t, measure) for t in times["hit"]]
            result.miss = [getattr(t, measure) for t in times["miss"]]
            result.observed = observed
            if result.p < prof.alpha:
                result.verdict = "shared"
                result.smallest_tokens = smallest_shared(result.hit, result.miss, n_share[fraction], prof.alpha / 2)
                return


def metadata_verdict(result: Level, pairs: int) -> None:
    """Does anything the attacker reads tell a hit from a miss? From the deciding run's probes:
    their reported cached tokens (all of them), and the readable counters' moves around the
    first ``pairs`` hit and miss probes: a leak when every hit probe's value exceeds every miss
    probe's (fills ``result.metadata_leak`` and ``result.metadata``: what told)."""
    told = {}
    for name, v in result.observed.items():
        hit, miss = [x for x in v["hit"] if x is not None], [x for x in v["miss"] if x is not None]
        if hit and miss and len(hit) == len(v["hit"]) and len(miss) == len(v["miss"]) and min(hit) > max(miss):
            told[name] = {"hit": hit[:pairs], "miss": miss[:pairs]}
    result.metadata_leak, result.metadata = bool(told), told


def smallest_shared(hit, miss, shared: int, alpha: float) -> int | None:
    """The fewest shared tokens the test would still detect: hit times measured with ``shared``
    tokens shared, moved toward the misses by the measured saving per token (median miss minus
    median hit, over ``shared``) for every token less shared, until the test no longer rejects
    at ``alpha``. None when the hits were not faster.

    Example:
        >>> smallest_shared([0.05] * 30, [0.25 + 0.001 * i for i in range(30)], 500, 5e-9)
        18
    """
    saved = (_median(miss) - _median(hit)) / shared if hit and miss else 0.0
    if saved <= 0:
        return None

    def detected(k: int) -> bool:
        return ks_less([h + (shared - k) * saved for h in hit], miss).p < alpha

    if not detected(shared):
        return None
    lo, hi = 1, shared  # detection grows with the tokens shared: bisect for the fewest
    while lo < hi:
        mid = (lo + hi) // 2
        if detected(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _median(xs) -> float | None:
    return statistics.median(xs) if xs else None


def _ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.1f} ms"
