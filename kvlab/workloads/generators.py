"""The workload generators: the prompt shapes the seed threads measured, each a seeded
:class:`~kvlab.request.Workload` the Engine, the simulator and the trace export accept.

Example:
    >>> sorted(GENERATORS)
    ['agentic_loop', 'branching', 'fixed', 'multi_turn', 'multimodal', 'multimodal_mix', 'prefix_repetition', 'shared_system_prompt']
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from ..errors import RequestError
from ..request import Request, Workload, canonical_json
from ..primitives.tokens import hf_tokenizer
from .fixed import fixed
from .text import (check_positive, prose, question, seeded_image, system_prompt, tool_args,
                   tool_result, tool_schemas, user_turn)

BILLING_HEADER = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={cch};"
# the role each tool-schema system prompt opens with (its length sets the prompt's floor)
SYSTEM_ROLES = {"agentic_loop": "an autonomous coding agent", "shared_system_prompt": "a coding assistant"}


def multi_turn(turns: int = 3, seed: int = 0, *, system_tokens: int = 64, user_tokens: int = 40,
               reply_tokens: int = 60, max_tokens: int = 128) -> Workload:
    """A chat that grows turn by turn (seed 001): request k holds the system prompt, k user turns
    and the k-1 assistant replies before them.

    The replies are canned, seeded text standing in for the model's answers, so the workload
    replays without a model; an Engine that generates may feed its own outputs instead.

    Example:
        >>> wl = kv.workloads.multi_turn(turns=3)
        >>> [len(r.messages) for r in wl]
        [2, 4, 6]
    """
    check_positive(turns=turns)
    rng = np.random.default_rng([seed, 1])
    system = {"role": "system", "content": "You are a concise assistant for engineers. "
              + prose(rng, system_tokens)}
    history: list[dict] = [system]
    requests = []
    for k in range(turns):
        history.append({"role": "user", "content": question(rng, user_tokens)})
        requests.append(Request(messages=tuple(history), max_tokens=max_tokens, name=f"turn-{k + 1}"))
        history.append({"role": "assistant", "content": "Sure. " + prose(rng, reply_tokens)})
    return Workload("multi_turn", tuple(requests),
                    dict(turns=turns, seed=seed, system_tokens=system_tokens, user_tokens=user_tokens,
                         reply_tokens=reply_tokens, max_tokens=max_tokens),
                    "a growing chat with canned assistant replies")


def branching(turns: int = 3, seed: int = 0, *, system_tokens: int = 64, user_tokens: int = 40,
              reply_tokens: int = 60, max_tokens: int = 128) -> Workload:
    """The same history with another reply: a chat of ``turns`` turns (as ``multi_turn``), then
    for each turn k a branch that keeps the history up to user turn k, takes another assistant
    reply there and asks a new question (a user who regenerates or edits an answer). A branch can
    reuse the shared history only up to the end of user turn k: a cache restored past it would
    hold the first reply.

    Example:
        >>> wl = kv.workloads.branching(turns=2)
        >>> [r.name for r in wl]
        ['turn-1', 'turn-2', 'branch-1', 'branch-2']
        >>> wl[2].messages[:2] == wl[1].messages[:2], wl[2].messages[2] == wl[1].messages[2]
        (True, False)
    """
    main = multi_turn(turns, seed, system_tokens=system_tokens, user_tokens=user_tokens,
                      reply_tokens=reply_tokens, max_tokens=max_tokens)
    rng = np.random.default_rng([seed, 6])
    branches = []
    for k, request in enumerate(main.requests):
        reply = {"role": "assistant", "content": "Alternatively: " + prose(rng, reply_tokens)}
        follow = {"role": "user", "content": question(rng, user_tokens)}
        branches.append(Request(messages=(*request.messages, reply, follow), max_tokens=max_tokens,
                                name=f"branch-{k + 1}"))
    return Workload("branching", main.requests + tuple(branches), {**main.params},
                    "a chat, then one branch per turn: the same history with another reply")


def agentic_loop(turns: int = 4, seed: int = 0, *, system_tokens: int = 800, tools: int = 4,
                 result_tokens: int = 120, billing_header: bool = True,
                 max_tokens: int = 256) -> Workload:
    """An agent loop (seed 002): a long system prompt with JSON tool schemas, then a history of
    tool calls and tool results that grows by one call/result pair each request.

    With ``billing_header`` the system prompt's first line is a per-request
    ``x-anthropic-billing-header: ...; cch=<5 hex>;`` whose ``cch`` is derived from the request
    body's sha256 and the seed, so it changes every request and breaks reuse a few dozen tokens
    in (pitfall 1 in the README). ``system_tokens=28_000, tools=13`` reaches the seed's size.

    Example:
        >>> wl = kv.workloads.agentic_loop(turns=2)
        >>> wl[0].messages[0]["content"].splitlines()[0][:27]
        'x-anthropic-billing-header:'
    """
    check_positive(turns=turns)
    rng = np.random.default_rng([seed, 2])
    system = system_prompt(rng, system_tokens, tools, SYSTEM_ROLES["agentic_loop"])
    task = {"role": "user", "content": "Task: " + question(rng, 60)
            + " Use the tools; read before you edit and run the tests when done."}
    schemas = tool_schemas()
    names = [t["name"] for t in schemas[: max(1, min(tools, len(schemas)))]]
    history: list[dict] = [task]
    requests = []
    for k in range(turns):
        body = [{"role": "system", "content": system}, *history]
        if billing_header:
            cch = hashlib.sha256(f"{seed}:{canonical_json(body)}".encode()).hexdigest()[:5]
            body[0] = {"role": "system", "content": BILLING_HEADER.format(cch=cch) + "\n" + system}
        requests.append(Request(messages=tuple(body), max_tokens=max_tokens, name=f"step-{k + 1}"))
        tool = names[int(rng.integers(len(names)))]
        call = {"name": tool, "arguments": tool_args(rng, tool)}
        history.append({"role": "assistant",
                        "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"})
        history.append({"role": "tool", "content": tool_result(rng, tool, result_tokens)})
    return Workload("agentic_loop", tuple(requests),
                    dict(turns=turns, seed=seed, system_tokens=system_tokens, tools=tools,
                         result_tokens=result_tokens, billing_header=billing_header,
                         max_tokens=max_tokens),
                    "tool-using agent; growing call/result history; per-request billing header")


def shared_system_prompt(num_users: int = 4, seed: int = 0, *, system_tokens: int = 800,
                         tools: int = 4, question_tokens: int = 32,
                         max_tokens: int = 128) -> Workload:
    """Many users, one long system prompt with tool schemas, a different question each
    (seed 003; ``system_tokens=10_000, tools=13`` reaches its size).

    Example:
        >>> wl = kv.workloads.shared_system_prompt(num_users=2)
        >>> wl[0].messages[0] == wl[1].messages[0], wl[0].messages[1] == wl[1].messages[1]
        (True, False)
    """
    check_positive(num_users=num_users)
    rng = np.random.default_rng([seed, 3])
    system = {"role": "system", "content": system_prompt(rng, system_tokens, tools,
                                                          SYSTEM_ROLES["shared_system_prompt"])}
    requests = tuple(
        Request(messages=(system, {"role": "user", "content": question(rng, question_tokens)}),
                max_tokens=max_tokens, name=f"user-{u + 1}")
        for u in range(num_users))
    return Workload("shared_system_prompt", requests,
                    dict(num_users=num_users, seed=seed, system_tokens=system_tokens, tools=tools,
                         question_tokens=question_tokens, max_tokens=max_tokens),
                    "one shared system prompt, one question per user")


def prefix_repetition(prefix_len: int = 256, suffix_len: int = 256, num_prompts: int = 10,
                      num_prefixes: int = 10, output_len: int = 128, seed: int = 0,
                      shuffle: bool = True, tokenizer=None, vocab_size: int = 32_000) -> Workload:
    """vLLM's ``prefix_repetition`` benchmark dataset as token-id requests.

    ``num_prefixes`` random prefixes of ``prefix_len`` ids, each followed by
    ``num_prompts // num_prefixes`` random suffixes of ``suffix_len`` ids; shuffled unless
    ``shuffle=False``. With a ``tokenizer`` each random piece is adjusted as vLLM does (decode,
    re-encode, truncate or extend, up to 10 tries) and redrawn until it round-trips to exactly
    its length; without one, ids are uniform in ``[0, vocab_size)``. Seeded with numpy's
    ``default_rng(seed)``, so the ids differ from vLLM's own run with the same seed.

    Example:
        >>> wl = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
        ...                                     num_prefixes=1)
        >>> sum(len(r.ids) for r in wl)
        32000
    """
    check_positive(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
                   num_prefixes=num_prefixes)
    per_prefix = num_prompts // num_prefixes
    if per_prefix == 0:
        raise RequestError(f"num_prompts ({num_prompts}) must be >= num_prefixes ({num_prefixes}); "
                           "lower num_prefixes or raise num_prompts")
    rng = np.random.default_rng(seed)
    draw = _exact_length_sampler(rng, tokenizer, vocab_size)
    requests = []
    for p in range(num_prefixes):
        prefix = draw(prefix_len)
        for s in range(per_prefix):
            requests.append(Request(ids=prefix + draw(suffix_len), max_tokens=output_len,
                                    name=f"prefix{p}-suffix{s}"))
    if shuffle:
        requests = [requests[i] for i in rng.permutation(len(requests))]
    return Workload("prefix_repetition", tuple(requests),
                    dict(prefix_len=prefix_len, suffix_len=suffix_len, num_prompts=num_prompts,
                         num_prefixes=num_prefixes, output_len=output_len, seed=seed,
                         shuffle=shuffle, tokenizer=tokenizer is not None,
                         vocab_size=None if tokenizer is not None else vocab_size),
                    "vLLM prefix_repetition: shared random prefixes, random suffixes")


def _exact_length_sampler(rng, tokenizer, vocab_size: int):
    if tokenizer is None:
        if vocab_size < 2:
            raise RequestError(f"vocab_size must be >= 2, got {vocab_size!r}")
        return lambda n: tuple(int(i) for i in rng.integers(0, vocab_size, size=n))
    hf = hf_tokenizer(tokenizer)
    vocab = int(hf.vocab_size)

    def draw(n: int) -> tuple[int, ...]:
        # vLLM's gen_prompt_decode_to_target_len, then a fresh draw if it still misses
        for _ in range(20):
            ids = rng.integers(0, vocab, size=n).tolist()
            for _ in range(11):
                ids = list(hf.encode(hf.decode(ids), add_special_tokens=False))
                if len(ids) == n:
                    return tuple(int(i) for i in ids)
                if len(ids) < n:
                    ids.extend(rng.integers(0, vocab, size=n - len(ids)).tolist())
                else:
                    ids = ids[:n]
        raise RequestError(f"could not draw {n} random token ids that decode and re-encode to "
                           f"exactly {n} tokens with this tokenizer; try another seed or length")
    return draw


def multimodal_mix(num_requests: int = 4, seed: int = 0, *, image_every: int = 2,
                   image_size: tuple[int, int] = (32, 32), system_tokens: int = 48,
                   same_text: bool = True, max_tokens: int = 64) -> Workload:
    """Text-only and image requests mixed (seed 000): every ``image_every``-th request carries a
    seeded ``uint8`` HxWx3 image as a content part ``{"type": "image", "image": array}``.

    With ``same_text`` all image requests ask the same question, so their token ids are
    identical and only the image differs: a cache keyed on ids alone replays the wrong KV
    (pitfall 2 in the README). ``image_size=(448, 448)`` is a realistic size.

    Example:
        >>> wl = kv.workloads.multimodal_mix(num_requests=4)
        >>> [r.has_images for r in wl]
        [False, True, False, True]
    """
    check_positive(num_requests=num_requests, image_every=image_every)
    h, w = image_size
    rng = np.random.default_rng([seed, 0])
    system = {"role": "system", "content": "You describe images and answer questions. "
              + prose(rng, system_tokens)}
    requests = []
    for i in range(num_requests):
        if (i + 1) % image_every == 0:
            text = "Describe this image in one sentence." if same_text else question(rng, 16)
            user, name = user_turn(i, text, seeded_image(seed, i, h, w))
        else:
            user, name = user_turn(i, question(rng, 24))
        requests.append(Request(messages=(system, user), max_tokens=max_tokens, name=name))
    return Workload("multimodal_mix", tuple(requests),
                    dict(num_requests=num_requests, seed=seed, image_every=image_every,
                         image_size=(h, w), system_tokens=system_tokens, same_text=same_text,
                         max_tokens=max_tokens),
                    "text-only and image requests mixed")


from .multimodal import multimodal  # noqa: E402  (it imports only .text: no cycle)

GENERATORS = {f.__name__: f for f in (multi_turn, branching, agentic_loop, shared_system_prompt,
                                      prefix_repetition, multimodal_mix, multimodal, fixed)}
