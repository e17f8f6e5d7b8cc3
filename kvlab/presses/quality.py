"""What a press costs, measured: teacher-forced divergence, task accuracy beside the baseline's,
and decode speed.

- ``divergence``: KL(full || compressed), top-1 agreement and the change in NLL of the true next
  tokens over a continuation run teacher-forced on both caches (llama.cpp's method: it works at any
  model size). ``document`` makes a context and a continuation that copies a passage of it back, so
  predicting it needs the context (an evicted passage shows).
- ``answers``: each task's questions asked on the uncompressed context (the baseline) and on the
  compressed one, the context compressed once per task (kvpress's pipeline: the question is not
  in the compressed part). Accuracy is gated on the baseline: only questions the uncompressed
  model answers count (``accuracy`` = their share still answered), beside ``baseline_accuracy``.
- ``decode_speed``: greedy tokens per second from a cache (full or compressed).

Example:
    >>> ctx, cont = document(m, 1024)
    >>> pre = Prefilled(m, ctx, [p])
    >>> divergence(m, pre, p, cont)
    {'kl': 0.012, 'top1': 0.95, 'delta_nll': 0.004}
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from ..primitives import timing
from ..primitives.snapshots import prefill, restore, snapshot
from .compress import Prefilled
from .tasks import haystack


def document(model, tokens: int, *, continuation: int = 64, seed: int = 0) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids): ``tokens`` ids of varied sentences, then ``continuation``
    ids repeating a passage from the middle of the context."""
    rng = random.Random(seed)
    sentences = haystack(tokens, "heterogeneous", rng)
    ids = model.tokenizer.encode(" ".join(sentences), add_special_tokens=False)[:tokens]
    mid = len(sentences) // 2
    passage = model.tokenizer.encode(" " + " ".join(sentences[mid: mid + continuation]), add_special_tokens=False)
    return list(ids), list(passage[:continuation])


def divergence(model, pre: Prefilled, press, continuation, *, full_logits=None, compressed=None) -> dict:
    """KL(full || compressed) (nats per token), top-1 agreement and mean NLL change over
    ``continuation`` run teacher-forced after ``pre``'s prompt, uncompressed and pressed
    (``compressed``: ``pre.compress(press)`` if you have it; its cache is run on)."""
    if full_logits is None:
        full_logits = prefill(model, continuation, restore(pre.snapshot), all_logits=True)[0]
    c = compressed if compressed is not None else pre.compress(press)
    comp = prefill(model, continuation, restore(snapshot(c.cache)), all_logits=True)[0]
    return compare(full_logits[:-1], comp[:-1], continuation[1:])  # position i predicts token i + 1


def compare(p: mx.array, q: mx.array, targets) -> dict:
    """KL(P || Q) per position averaged, top-1 agreement and mean NLL_Q - NLL_P of ``targets``
    for logits ``p`` (full) and ``q`` (compressed), both [N, vocab].

    Example:
        >>> compare(mx.array([[0.0, 0.0]]), mx.array([[0.0, 0.0]]), [1])
        {'kl': 0.0, 'top1': 1.0, 'delta_nll': 0.0}
    """
    # in NumPy, float64: over a 150k vocabulary MLX's CPU exp is the slow part (the bench's exp table)
    p, q = np.asarray(p.astype(mx.float32), np.float64), np.asarray(q.astype(mx.float32), np.float64)
    lp, lq = p - _logsumexp(p), q - _logsumexp(q)
    kl = np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1))
    top1 = np.mean(np.argmax(p, axis=-1) == np.argmax(q, axis=-1))
    rows = np.arange(len(p))
    dnll = np.mean((lp - lq)[rows, np.asarray(list(targets))])
    return {"kl": float(kl), "top1": float(top1), "delta_nll": float(dnll)}


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def render(model, task, question) -> tuple[list[int], int]:
    """(ids, context_end): the task as one user message, the question after the context, the
    assistant's reply started with the question's prefix; the compressed part ends where the
    question starts."""
    toks = model.tokenise([{"role": "user", "content": task.context + "\n\n" + question.text}])
    at = toks.text.index(question.text)
    end = next(i for i, (a, _) in enumerate(toks.offsets) if a >= at)
    prefix = model.tokenizer.encode(question.prefix, add_special_tokens=False)
    return list(toks.ids) + list(prefix), end


def reply(model, ids, cache, max_tokens: int = 8) -> str:
    """The greedy reply to ``ids`` run on ``cache`` (changed): the argmax of the logits, no
    softmax (the same tokens as greedy sampling)."""
    eos = set(model.tokenizer.eos_token_ids)
    logits, _ = prefill(model, list(ids), cache)
    out = []
    for _ in range(max_tokens):
        token = int(mx.argmax(logits).item())
        if token in eos:
            break
        out.append(token)
        logits = model.net(mx.array([[token]]), cache=cache)[0, -1]
    return model.tokenizer.decode(out)


def answers(model, tasks, presses, *, max_tokens: int = 8) -> dict:
    """{None: [baseline answered, ...], press.key: [...]} over every question of ``tasks`` (in
    order), each context prefilled once and compressed once per press."""
    out = {None: []} | {p.key: [] for p in presses}
    for task in tasks:
        rendered = [render(model, task, q) for q in task.questions]
        ids0, end = rendered[0]
        pre = Prefilled(model, ids0[:end], presses)
        compressed = {p.key: snapshot(pre.compress(p).cache) for p in presses}
        for q, (ids, e) in zip(task.questions, rendered):
            same = e == end and ids[:e] == ids0[:end]  # the context tokenised alike for every question
            base = restore(pre.snapshot) if same else prefill(model, ids[:e])[1]
            out[None].append(q.answer in reply(model, ids[e:], base, max_tokens))
            for p in presses:
                cache = restore(compressed[p.key]) if same else Prefilled(model, ids[:e], [p]).compress(p).cache
                out[p.key].append(q.answer in reply(model, ids[e:], cache, max_tokens))
    return out


def gated(baseline: list[bool], pressed: list[bool]) -> tuple[float | None, float | None]:
    """(accuracy on the questions the baseline answers, baseline accuracy); None when empty.

    Example:
        >>> gated([True, True, False, True], [True, False, True, True])
        (0.6666666666666666, 0.75)
    """
    solved = [p for b, p in zip(baseline, pressed) if b]
    return (sum(solved) / len(solved) if solved else None), (sum(baseline) / len(baseline) if baseline else None)


def decode_speed(model, cache, first: int, n: int = 32) -> float:
    """Greedy decode tokens per second from ``cache`` (a copy is run; the first step not timed)."""
    cache = restore(snapshot(cache))
    steps = generate_step(mx.array([first]), model.net, max_tokens=n + 1, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    next(steps)
    t = timing.timed()
    count = sum(1 for _ in steps)
    return count / t.done() if count else 0.0
