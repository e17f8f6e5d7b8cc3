"""Synthetic long-context tasks, generated in code (no downloads), RULER-style.

- ``needle``: one fact ("The secret code for Oslo is 4417.") hidden at a ``depth`` (0..1) in a
  haystack of ``repetitive`` filler (RULER's noise sentences) or ``heterogeneous`` filler (varied
  sentences from word lists), optionally with ``decoys`` (the same fact for other keys) and asked
  ``exact``-ly or ``paraphrased`` (other words than the needle's);
- ``multikey``: several such facts, every key asked on the one context (several questions on one
  compressed context);
- ``vt`` (variable tracking): a chain ``VAR A = 4417.`` ... ``VAR D = VAR C.`` spread through the
  haystack; asked for the value of the last variable (RULER's hard case: SnapKV scored 0% here
  in an MLX library while passing needle tests).

Each question has an answer prefix (kvpress's ``answer_prefix``): the assistant's reply starts
with it, so a small model states the answer in its first few tokens. A question is answered when
the greedy reply contains the answer.

Example:
    >>> t = needle(words=120, depth=0.5, seed=1)
    >>> t.questions[0].answer in t.context
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..primitives.display import summary_html

KEYS = ("Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Hanoi", "Riga", "Bern", "Accra", "Seoul")
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
SUBJECTS = ("The river", "A merchant", "The old library", "Our neighbour", "The committee", "A small boat",
            "The orchestra", "The garden", "A tired engineer", "The village school", "The night train")
VERBS = ("opened", "painted", "described", "visited", "measured", "repaired", "remembered", "ignored",
         "crossed", "sold", "followed", "photographed")
OBJECTS = ("a wooden door", "the northern road", "three letters", "the harbour wall", "an empty room",
           "the winter market", "a broken clock", "the tall tower", "a copper kettle", "the long bridge")
FILLERS = ("repetitive", "heterogeneous")


@dataclass(frozen=True)
class Question:
    """A question, the answer a reply must contain, and the start of the reply (``prefix``)."""

    text: str
    answer: str
    prefix: str

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


@dataclass(frozen=True)
class Task:
    """One context and the questions asked on it; ``meta`` says how it was made."""

    kind: str
    context: str
    questions: tuple[Question, ...]
    meta: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        how = ", ".join(f"{k}={v}" for k, v in self.meta.items())
        return f"Task({self.kind}, {len(self.context.split())} words, {len(self.questions)} questions, {how})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def haystack(words: int, filler: str, rng: random.Random) -> list[str]:
    """Sentences of about ``words`` words: RULER's noise repeated, or varied random sentences."""
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {FILLERS}, got {filler!r}")
    out, n = [], 0
    while n < words:
        s = NOISE[len(out) % len(NOISE)] if filler == "repetitive" else \
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
        out.append(s)
        n += len(s.split())
    return out


def _insert(sentences: list[str], facts: list[tuple[float, str]]) -> str:
    out = list(sentences)
    for depth, fact in sorted(facts, key=lambda f: -f[0]):
        out.insert(round(depth * len(sentences)), fact)
    return " ".join(out)


def _code(rng: random.Random) -> str:
    return str(rng.randint(1000, 9999))


def _ask(key: str, value: str, paraphrased: bool) -> Question:
    text = (f"Which four-digit number was given as the hidden code of {key}?" if paraphrased
            else f"What is the secret code for {key}?")
    return Question(text + " Answer with the number only.", value, f"The secret code for {key} is")


def needle(*, words: int = 400, depth: float = 0.5, filler: str = "heterogeneous", paraphrased: bool = False,
           decoys: int = 0, seed: int = 0) -> Task:
    """One needle at ``depth`` (module docstring)."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, 1 + decoys)
    values = [_code(rng) for _ in keys]
    facts = [(depth, f"The secret code for {keys[0]} is {values[0]}.")]
    facts += [(rng.random(), f"The secret code for {k} is {v}.") for k, v in zip(keys[1:], values[1:])]
    context = _insert(haystack(words, filler, rng), facts)
    meta = {"depth": depth, "filler": filler, "paraphrased": paraphrased, "decoys": decoys}
    return Task("needle", context, (_ask(keys[0], values[0], paraphrased),), meta)


def multikey(*, words: int = 400, keys: int = 4, filler: str = "heterogeneous", seed: int = 0) -> Task:
    """``keys`` needles at spread depths; each key asked on the one context."""
    rng = random.Random(seed)
    names = rng.sample(KEYS, keys)
    values = [_code(rng) for _ in names]
    depths = [(i + 0.5) / keys for i in range(keys)]
    facts = [(d, f"The secret code for {k} is {v}.") for d, k, v in zip(depths, names, values)]
    context = _insert(haystack(words, filler, rng), facts)
    questions = tuple(_ask(k, v, False) for k, v in zip(names, values))
    return Task("multikey", context, questions, {"keys": keys, "filler": filler})


def variable_tracking(*, words: int = 400, chain: int = 4, filler: str = "heterogeneous", seed: int = 0) -> Task:
    """A chain of ``chain`` variables, each set to the one before, the first to a number."""
    rng = random.Random(seed)
    names = [f"VAR {chr(ord('A') + i)}" for i in range(chain)]
    value = _code(rng)
    facts = [((i + 0.5) / chain, f"{names[i]} = {value if i == 0 else names[i - 1]}.") for i in range(chain)]
    context = _insert(haystack(words, filler, rng), facts)
    last = names[-1]
    q = Question(f"What is the value of {last}? Answer with the number only.", value, f"The value of {last} is")
    return Task("vt", context, (q,), {"chain": chain, "filler": filler})


def suite(kind: str, n: int, *, words: int = 400, seed: int = 0) -> list[Task]:
    """``n`` tasks of ``kind`` (needle, multikey, vt) that vary what RULER varies: needles over
    depths, both fillers, exact and paraphrased questions, with and without decoys.

    Example:
        >>> [t.meta["depth"] for t in suite("needle", 3, words=60)]
        [0.1, 0.5, 0.9]
    """
    out = []
    for i in range(n):
        filler = FILLERS[i % 2]
        if kind == "needle":
            depth = (0.1, 0.5, 0.9)[i % 3]
            out.append(needle(words=words, depth=depth, filler=filler, paraphrased=bool(i // 3 % 2),
                              decoys=2 * (i // 6 % 2), seed=seed + i))
        elif kind == "multikey":
            out.append(multikey(words=words, filler=filler, seed=seed + i))
        elif kind == "vt":
            out.append(variable_tracking(words=words, filler=filler, seed=seed + i))
        else:
            raise ValueError(f"task kind must be needle, multikey or vt, got {kind!r}")
    return out
