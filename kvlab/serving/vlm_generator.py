"""Serving a vision-language model: each request runs alone on mlx-lm's generation thread.

A VLM request cannot join mlx-lm's ``BatchGenerator``: the model is bound per request
(``vlm.for_request(tokens)`` embeds that request's image features and M-RoPE positions). So a
served VLM is never batchable (``KvlabModelProvider``), mlx-lm's loop hands every request to its
sequential path, and ``KvlabResponseGenerator._serve_single`` gives it to :class:`VLMRequests`,
which does what mlx-lm's ``_serve_single`` does, with kvlab's pieces:

- the messages (OpenAI ``image_url`` parts: ``data:`` URLs, ``file://`` URLs and local paths; an
  Anthropic image block arrives translated to one) are tokenised by ``vlm.tokenise`` (images
  expanded to their placeholders, each keyed by the sha256 of its decoded pixels);
- the key is ``kv.cache_key(tokens)``, exactly the Engine's: ids plus each image's pixel hash over
  its placeholder span, so a text-only request reuses a shared system prompt, an image request
  reuses past an image only for the same pixels (vllm-mlx#718), and no answer changes;
- lookup and offers go through the StoreAdapter, i.e. the reuse core the Engine runs: restore,
  prefill to the checkpoint positions of ``--checkpoints`` (offering a snapshot at each; none inside
  an image whose tokens see each other), the rest of the prompt but its last token through kvlab's
  prefill (such an image runs in one chunk: mlx-lm's chunks could cut it), then mlx-lm's own
  ``stream_generate`` over the bound model from the last prompt token, then prompt + output is
  offered;
- the ledger, events and diagnostics see the same queue items a text request produces.

VLM requests are therefore not continuously batched: they are served one after another in
arrival order. Bad input (an unreadable image, an http URL, a prompt over the context) raises
RequestError, which the handler answers with 400.

Example:
    >>> with kv.serve("tiny-vlm", "radix") as server:   # OpenAI and Anthropic routes with images
    ...     server.model.kind
    'vlm'
"""

from __future__ import annotations

from mlx_lm.generate import make_stop_sequences, make_text_state_machine, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.server import GenerationContext, Response

from ..errors import KvlabError, RequestError
from ..keys import CacheKey, cache_key
from ..primitives.display import summary_html
from ..primitives.snapshots import advance
from ..reuse import restorable_limit


class VLMRequests:
    """Runs VLM requests one at a time through the StoreAdapter (module docstring)."""

    def __init__(self, model, adapter, ledger, checkpoints=None, *, prefill_step_size: int = 2048):
        self.model, self.adapter, self.ledger = model, adapter, ledger
        self.checkpoints = checkpoints  # a ServedCheckpoints: where prefill stops to snapshot
        self.prefill_step_size = prefill_step_size
        self.served = self.images = 0

    # -- one request ------------------------------------------------------------------------------
    def tokens(self, request, args):
        """The request's Tokens (images hashed and expanded); RequestError for what cannot be read."""
        template = dict(args.chat_template_kwargs or {})
        try:
            if request.request_type == "chat":
                if request.tools:
                    template["tools"] = request.tools
                return self.model.tokenise([dict(m) for m in request.messages], **template)
            return self.model.tokenise(request.prompt)
        except KvlabError as e:
            raise RequestError(f"{self.model.name} cannot serve this request: {e}") from e
        except Exception as e:  # noqa: BLE001  the chat template refused what the client sent
            raise RequestError(f"the request cannot be rendered by {self.model.name}'s chat template: "
                               f"{type(e).__name__}: {e}") from e

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
        toks = self.tokens(request, args)
        prompt = list(toks.ids)
        limit = self.model.context_length
        if limit and len(prompt) + args.max_tokens > limit:
            raise RequestError(f"prompt of {len(prompt)} tokens ({len(toks.images)} images) + max_tokens "
                               f"{args.max_tokens} exceeds the model's context of {limit} tokens; send "
                               "fewer or smaller images, a shorter prompt or a lower max_tokens")
        stop_sequences = make_stop_sequences(tok, args.stop_words)
        text_sm = self._state_machine(args.stop_words)
        images = cache_key(toks).extra_keys  # the Engine's key: the images' pixel hashes over their placeholders
        self.ledger.tokenized(rid, prompt, images=images)
        self.adapter.begin(rid, prompt, [prompt])
        key = self.adapter.key_for(rid, toks)  # and the request's tenant's salt
        if key is None:
            raise KvlabError("a request no tenant owns cannot be keyed; it was not served")
        cache, reused = self.adapter.lookup(rid, toks, key)
        self.adapter.note(rid, image_miss(toks, reused, self.adapter.found(rid)))
        ctx = GenerationContext(has_tool_calling=tok.has_tool_calling, has_thinking=tok.has_thinking,
                                tool_parser=tok.tool_parser, text_sm=text_sm,
                                initial_state=tok.response_initial_state or "normal", prompt=prompt,
                                prompt_cache_count=reused)
        rqueue.put(ctx)
        net = self.model.for_request(toks)
        cache = self.model.make_cache() if cache is None else cache
        pos = self._checkpoints(rid, toks, key, net, cache, reused)
        sampler = make_sampler(args.sampling.temperature, top_p=args.sampling.top_p, top_k=args.sampling.top_k,
                               min_p=args.sampling.min_p, xtc_probability=args.sampling.xtc_probability,
                               xtc_threshold=args.sampling.xtc_threshold,
                               xtc_special_tokens=tok.encode("\n") + list(tok.eos_token_ids))
        lg = args.logits
        processors = make_logits_processors(lg.logit_bias, lg.repetition_penalty, lg.repetition_context_size,
                                            lg.presence_penalty, lg.presence_context_size,
                                            lg.frequency_penalty, lg.frequency_context_size)
        seq, matcher = list(prompt), stop_sequences.matcher()
        if len(prompt) - pos > 1:
            # kvlab's prefill runs an image in one chunk where its tokens see each other (gemma4);
            # mlx-lm's would cut at prefill_step_size, possibly inside one
            advance(net, toks.ids[pos:-1], cache)
            pos = len(prompt) - 1
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
        self.images += len(toks.images)
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

    def _state_machine(self, stop_words):
        return make_text_state_machine(self.model.tokenizer, stop_words)

    def __repr__(self) -> str:
        return f"VLMRequests({self.model.name}: {self.served} served, {self.images} images, one at a time)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def image_miss(toks, reused: int, lookup: dict) -> str:
    """Why an image request's reuse stopped at an image: the first image not covered by the reused
    tokens, when the store held the same ids under other image keys (its pixels differ).

    Example:
        >>> image_miss(toks, 20, {"miss_reasons": {"salt_or_extra_keys": 30}})
        'image 0 (tokens 21:27, message 1) differs from the cached one ...'
    """
    if not (lookup.get("miss_reasons") or {}).get("salt_or_extra_keys"):
        return ""
    for i, im in enumerate(toks.images):
        if im.token_end > reused:
            return (f"image {i} (tokens {im.token_start}:{im.token_end}, message {im.message_index}) "
                    f"differs from the cached one at these positions (pixel sha256 {im.hash[:12]}...): "
                    "the same token ids with other pixels, so the KV from its first placeholder on "
                    "is not reused")
    return ""


def top_logprobs(logprobs, top_n: int, tokenizer) -> tuple:
    """mlx-lm's top-logprobs shape: ({"id", "token", "logprob"}, ...) for the ``top_n`` best."""
    if top_n <= 0:
        return ()
    import mlx.core as mx

    idx = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n].tolist()
    probs = logprobs[idx].tolist()
    return tuple({"id": i, "token": s, "logprob": g}
                 for i, s, g in zip(idx, tokenizer.convert_ids_to_tokens(idx), probs))
