"""Requests mlx-lm's loop serves one at a time (its sequential path), run with kvlab's checkpoints.

mlx-lm sends a request to ``ResponseGenerator._serve_single`` when it cannot join the batch: a
cache without ``merge`` (Llama 4's chunked attention), a ``seed``, quantized KV, or a VLM (bound
per request). Its own sequential path looks the prompt up, prefills it in one piece and inserts
only prompt + output, so a cache that cannot be cut back (chunked, window, recurrent) is reusable
only there, while ``kv.Engine`` and mlx-lm's batched path also snapshot the prompt where the
``--checkpoints`` policy says (``kvlab.serving.checkpointing``). :class:`SequentialRequests` does
what ``_serve_single`` does with kvlab's pieces, the Engine's way:

- lookup and offers through the StoreAdapter (the reuse core the Engine runs);
- prefill to each checkpoint position (``ServedCheckpoints.positions``: the Engine's positions for
  the same policy and store; none inside an image whose tokens see each other), offering a
  snapshot at each, then the rest of the prompt but its last token through kvlab's prefill;
- mlx-lm's own ``stream_generate`` from the last prompt token, with mlx-lm's sampler, logits
  processors and stop sequences built from the request's arguments; prompt + output is offered.

How a request becomes tokens and a key is the subclass's: :class:`TextRequests` renders it with
mlx-lm's own ``_tokenize`` (kvlab's checks and ledger included), ``VLMRequests``
(``kvlab.serving.vlm_generator``) expands and hashes its images.

Example:
    >>> seq = TextRequests(model, adapter, ledger, checkpoints, tokenize=generator._tokenize)
    >>> seq.serve(rqueue, request, args, stream)   # on mlx-lm's generation thread
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import make_stop_sequences, make_text_state_machine, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.server import GenerationContext, Response

from ..errors import KvlabError, RequestError
from ..keys import CacheKey
from ..primitives.display import summary_html
from ..primitives.snapshots import advance
from ..reuse import restorable_limit
from .checkpointing import request_tokens


class SequentialRequests:
    """Serves requests one at a time through the StoreAdapter (module docstring); a subclass says
    how a request becomes ``(Tokens, CacheKey, initial state)`` in :meth:`prepare`."""

    def __init__(self, model, adapter, ledger, checkpoints=None, *, prefill_step_size: int = 2048):
        self.model, self.adapter, self.ledger = model, adapter, ledger
        self.checkpoints = checkpoints  # a ServedCheckpoints: where prefill stops to snapshot
        self.prefill_step_size = prefill_step_size
        self.served = 0

    def prepare(self, rid, request, args):
        """(Tokens, CacheKey, the text state machine's initial state) of ``request``; the request
        is registered with the ledger and the adapter. RequestError for what cannot be served."""
        raise NotImplementedError

    def looked_up(self, rid, toks, reused: int) -> None:
        """Called after the lookup (a VLM notes which image stopped the reuse)."""

    def serve(self, rqueue, request, args, stream) -> None:
        """Serve one request: every item goes on ``rqueue`` as mlx-lm's sequential path puts them
        (the context, progress tuples, Responses, None at the end, or the exception)."""
        try:
            self._serve(rqueue, request, args, stream)
        except Exception as e:  # noqa: BLE001  the handler answers it (RequestError: 400)
            rqueue.put(e)

    def _serve(self, rqueue, request, args, stream) -> None:
        rid = getattr(request, "kvlab_rid", None)
        tok = self.model.tokenizer
        toks, key, initial_state = self.prepare(rid, request, args)
        prompt = list(toks.ids)
        stop_sequences = make_stop_sequences(tok, args.stop_words)
        cache, reused = self.adapter.lookup(rid, toks, key)
        self.looked_up(rid, toks, reused)
        ctx = GenerationContext(has_tool_calling=tok.has_tool_calling, has_thinking=tok.has_thinking,
                                tool_parser=tok.tool_parser, text_sm=make_text_state_machine(tok, args.stop_words),
                                initial_state=initial_state, prompt=prompt, prompt_cache_count=reused)
        rqueue.put(ctx)
        if args.seed is not None:
            mx.random.seed(args.seed)
        net = self.model.for_request(toks)
        cache = self.model.make_cache() if cache is None else cache
        pos = self._checkpoints(rid, toks, key, net, cache, reused)
        if len(prompt) - pos > 1:
            # kvlab's prefill, the Engine's; it runs an image in one chunk where its tokens see each
            # other (gemma4), where mlx-lm's would cut at prefill_step_size, possibly inside one
            advance(net, toks.ids[pos:-1], cache)
            pos = len(prompt) - 1
        # mlx-lm's _make_sampler and _make_logits_processors
        sampler = make_sampler(args.sampling.temperature, top_p=args.sampling.top_p, top_k=args.sampling.top_k,
                               min_p=args.sampling.min_p, xtc_probability=args.sampling.xtc_probability,
                               xtc_threshold=args.sampling.xtc_threshold,
                               xtc_special_tokens=tok.encode("\n") + list(tok.eos_token_ids))
        processors = logits_processors(args.logits, prompt[reused:pos])
        seq, matcher = list(prompt), stop_sequences.matcher()
        for gen in stream_generate(model=net, tokenizer=tok, prompt=prompt[pos:], max_tokens=args.max_tokens,
                                   stream=stream, sampler=sampler, logits_processors=processors,
                                   prompt_cache=cache, prefill_step_size=self.prefill_step_size,
                                   prompt_progress_callback=lambda done, total: rqueue.put((pos + done, pos + total))):
            finish = "stop" if matcher.advance(gen.token) else gen.finish_reason
            rqueue.put(Response(gen.text, gen.token, gen.logprobs[gen.token].item(), finish,
                                top_logprobs(gen.logprobs, args.top_logprobs, tok)))
            seq.append(gen.token)
            if ctx._should_stop or finish is not None:
                break
        rqueue.put(None)
        self.served += 1
        # the cache has run the prompt and the output (all but, perhaps, its last token): the
        # reuse core cuts the key to what the cache holds
        self.adapter.offer(rid, toks, CacheKey(tuple(seq), key.extra_keys, key.salt), cache, seq,
                           cache_type="assistant")

    def _checkpoints(self, rid, toks, key, net, cache, reused: int) -> int:
        """Prefill to each checkpoint position past ``reused`` and offer a snapshot there (the
        Engine's ``_prefill``); returns where the rest of the prompt starts."""
        plan, pos = self.checkpoints, reused
        if plan is None or not plan.active:
            return pos
        try:
            stops = plan.positions(toks)
        except KvlabError as e:
            self.adapter.note(rid, f"no checkpoints: {e}")
            return pos
        # never a stop inside an image whose tokens attend to each other (the Engine's rule)
        for b in (b for b in stops if b > reused and restorable_limit(self.model, toks, b)[0] == b):
            advance(net, toks.ids[pos:b], cache)
            self.adapter.offer(rid, toks, key.prefix(b), cache, toks.ids[:b], cache_type="user")
            pos = b
        return pos

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model.name}: {self.served} served, one at a time)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


class TextRequests(SequentialRequests):
    """A text model's requests on mlx-lm's sequential path (a cache without ``merge``, a seed),
    rendered by mlx-lm's own ``_tokenize`` (``tokenize``: the generator's, which also checks the
    prompt against the context and registers it with the ledger and the adapter)."""

    def __init__(self, model, adapter, ledger, checkpoints, *, tokenize, prefill_step_size: int = 2048):
        super().__init__(model, adapter, ledger, checkpoints, prefill_step_size=prefill_step_size)
        self.tokenize = tokenize

    def prepare(self, rid, request, args):
        prompt, _, _, initial_state, _ = self.tokenize(self.model.tokenizer, request, args)
        toks = request_tokens(self.model, request, prompt)
        key = self.adapter.key_for(getattr(request, "kvlab_rid", rid), toks)  # the tenant's salt
        if key is None:
            raise RequestError("a request no tenant owns cannot be keyed; it was not served")
        return toks, key, initial_state


def logits_processors(lg, prefilled) -> list:
    """mlx-lm's logits processors for a request's logits arguments ``lg`` (its
    ``_make_logits_processors``), each shown the prompt ids kvlab ``prefilled`` itself before the
    tokens ``stream_generate`` passes it: what mlx-lm's own sequential path shows it (every prompt
    token after the cached ones), so a repetition penalty counts them.

    Example:
        >>> [p(mx.array([9]), mx.ones((1, 10)))[0, 7].item() for p in logits_processors(lg, [7, 8])]  # doctest: +SKIP
        [0.666...]
    """
    made = make_logits_processors(lg.logit_bias, lg.repetition_penalty, lg.repetition_context_size,
                                  lg.presence_penalty, lg.presence_context_size, lg.frequency_penalty,
                                  lg.frequency_context_size)
    if not prefilled:
        return made
    before = mx.array(list(prefilled))
    return [lambda tokens, logits, p=p: p(mx.concatenate([before, tokens.astype(before.dtype)]), logits)
            for p in made]


def top_logprobs(logprobs, top_n: int, tokenizer) -> tuple:
    """mlx-lm's top-logprobs shape: ({"id", "token", "logprob"}, ...) for the ``top_n`` best."""
    if top_n <= 0:
        return ()
    idx = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n].tolist()
    probs = logprobs[idx].tolist()
    return tuple({"id": i, "token": s, "logprob": g}
                 for i, s, g in zip(idx, tokenizer.convert_ids_to_tokens(idx), probs))
