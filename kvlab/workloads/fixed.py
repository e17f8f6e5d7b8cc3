"""Fixed-length chat requests for cross-tool runs (AIPerf's synthetic ISL/OSL, vLLM's ``random``
dataset): every prompt is exactly ``input_len`` tokens *as the server renders it* (the chat
template counted, the way mlx-lm's server calls ``apply_chat_template``), optionally behind one
shared system prompt of exactly ``system_tokens`` tokens, and asks for ``output_len`` tokens.

The text is made of *safe* tokens (a space and 3-10 lowercase letters, each its own token, so any
sequence of them decodes to text that encodes back to that sequence). Requests share nothing but
the system prompt and the template's own tokens: each user message starts with a token pair no
other request has, so a prefix cache can reuse exactly the system prompt's rendering.

Example:
    >>> wl = fixed(num_requests=2, tokenizer=m, input_len=300, output_len=64, system_tokens=100)
    >>> [len(rendered_ids(m, r.messages)) for r in wl], wl[0].max_tokens
    ([300, 300], 64)
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ..errors import RequestError
from ..primitives.tokens import hf_tokenizer
from ..request import Request, Workload
from .text import check_positive

_SAFE = re.compile(r"^[\u0120\u2581][a-z]{3,10}$")  # byte-level "Ġword" / sentencepiece "▁word"
TRIES = 12  # length corrections before giving up (one or two are the rule)


@functools.lru_cache(maxsize=4)
def _safe_ids_cached(hf) -> tuple[int, ...]:
    names = hf.convert_ids_to_tokens(list(range(int(hf.vocab_size))))
    out = []
    for i, name in enumerate(names):
        if isinstance(name, str) and _SAFE.match(name):
            if list(hf.encode(hf.decode([i]), add_special_tokens=False)) == [i]:
                out.append(i)
                if len(out) == 4096:
                    break
    return tuple(out)


def safe_ids(tokenizer) -> tuple[int, ...]:
    """Up to 4096 token ids that each decode to a space and 3-10 lowercase letters and encode back
    to themselves: any sequence of them decodes to text that encodes to exactly that sequence.

    Example:
        >>> ids, hf = list(safe_ids(m)[:5]), hf_tokenizer(m)
        >>> hf.encode(hf.decode(ids), add_special_tokens=False) == ids
        True
    """
    ids = _safe_ids_cached(hf_tokenizer(tokenizer))
    if len(ids) < 64:
        raise RequestError("this tokenizer has too few single-token lowercase words to synthesise "
                           "prompts that round-trip (trace replay, fixed-length prompts); use another "
                           "model")
    return ids


def rendered_ids(tokenizer, messages, **template_kwargs) -> list[int]:
    """The prompt ids a server built on mlx-lm's makes of ``messages``: the chat template applied
    with the generation prompt, tokenized (``tokenize=True``, no tools).

    Example:
        >>> len(rendered_ids(m, [{"role": "user", "content": "Hi"}]))
        9
    """
    hf = hf_tokenizer(tokenizer)
    if not getattr(hf, "chat_template", None):
        raise RequestError("this tokenizer has no chat template, so a chat prompt's rendered length "
                           "is unknown; use a model whose tokenizer has one")
    out = hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                 **template_kwargs)
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 may return a dict
    return [int(i) for i in ids]


def fixed(num_requests: int = 8, seed: int = 0, *, tokenizer=None, input_len: int | None = None,
          output_len: int = 128, system_tokens: int = 0) -> Workload:
    """``num_requests`` chat requests of exactly ``input_len`` rendered prompt tokens each (the
    template counted), behind a shared system message of exactly ``system_tokens`` tokens (0: no
    system message), each with ``max_tokens=output_len``.

    ``output_len`` is an upper bound: mlx-lm's server (and kvlab serve) honour neither
    ``ignore_eos`` nor ``min_tokens``, so a model may stop early at its end token; a load run
    records each request's actual ``output_tokens``. (Banning the end tokens with ``logit_bias``
    through ``extra_body`` makes the length exact on those servers.)

    Example:
        >>> wl = kv.workloads.fixed(4, tokenizer=m, input_len=64, output_len=16)
        >>> [len(rendered_ids(m, r.messages)) for r in wl]
        [64, 64, 64, 64]
    """
    if tokenizer is None:
        raise RequestError("fixed counts prompt tokens with the served model's tokenizer and chat "
                           "template: pass tokenizer= (a kvlab model, its name or a tokenizer; kvlab load: --tokenizer)")
    if input_len is None:
        raise RequestError("fixed needs input_len= (the prompt's tokens, chat template counted)")
    check_positive(num_requests=num_requests, input_len=input_len, output_len=output_len)
    if isinstance(system_tokens, bool) or not isinstance(system_tokens, (int, np.integer)) \
            or system_tokens < 0:
        raise RequestError(f"system_tokens must be an int >= 0 (0: no system prompt), got {system_tokens!r}")
    hf, safe = hf_tokenizer(tokenizer), safe_ids(tokenizer)
    rng = np.random.default_rng([seed, 17])
    head: tuple[dict, ...] = ()
    if system_tokens:
        def system_len(ids):  # the system message's tokens: its rendering's growth over empty content
            return (len(rendered_ids(hf, [_msg("system", hf, ids)]))
                    - len(rendered_ids(hf, [_msg("system", hf, [])])))
        ids = _fit(system_len, system_tokens, [safe[i] for i in rng.integers(len(safe), size=system_tokens)],
                   rng, safe, "system_tokens")
        head = (_msg("system", hf, ids),)
    floor = len(rendered_ids(hf, [*head, _msg("user", hf, [])]))
    if input_len <= floor:
        what = "the chat template and the system prompt take" if head else "the chat template takes"
        raise RequestError(f"input_len={input_len} leaves no room for a user message: {what} {floor} "
                           f"tokens; pass input_len >= {floor + 1}")
    first, second = rng.permutation(len(safe)), rng.permutation(len(safe))
    requests = []
    for i in range(num_requests):
        # a token pair no other request starts with: nothing shared past the system prompt
        lead = [safe[first[i % len(safe)]], safe[second[(i // len(safe)) % len(safe)]]]
        k = input_len - floor
        start = (lead + [safe[j] for j in rng.integers(len(safe), size=k)])[:k]
        ids = _fit(lambda ids: len(rendered_ids(hf, [*head, _msg("user", hf, ids)])), input_len,
                   start, rng, safe, "input_len")
        requests.append(Request(messages=(*head, _msg("user", hf, ids)), max_tokens=int(output_len),
                                name=f"fixed-{i + 1}"))
    return Workload("fixed", tuple(requests),
                    dict(num_requests=num_requests, seed=seed, input_len=input_len,
                         output_len=output_len, system_tokens=system_tokens),
                    "fixed-length prompts (chat template counted) behind an optional shared system prompt")


def _msg(role: str, hf, ids) -> dict:
    # the leading space stays: " word" is the safe token, "word" alone may split in two
    return {"role": role, "content": hf.decode(list(ids))}


def _fit(measure, target: int, ids: list[int], rng, safe, what: str) -> list[int]:
    """``ids`` cut or extended (random safe ids) until ``measure(ids) == target``."""
    for _ in range(TRIES):
        n = measure(ids)
        if n == target:
            return ids
        want = len(ids) + target - n
        if want < 1:
            break
        ids = ids[:want] + [safe[j] for j in rng.integers(len(safe), size=max(0, want - len(ids)))]
    raise RequestError(f"could not make text of exactly {what}={target} rendered tokens with this "
                       "tokenizer and chat template; try another length or seed")
