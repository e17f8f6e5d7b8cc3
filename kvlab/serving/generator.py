"""mlx-lm's ResponseGenerator and ModelProvider, extended (not copied) to report to kvlab.

``KvlabResponseGenerator`` runs mlx-lm's own batching loop unchanged and observes it at three
seams mlx-lm already has: ``_tokenize`` (which request is about to be looked up; its prompt is
checked against the model's context), ``_next_request`` (each request's response queue is wrapped
so its context, tokens and end are seen on the generation thread, in order) and the time budget
that paces ``BatchGenerator.next()`` (each step advances the event log's batch step).
``KvlabModelProvider`` hands mlx-lm the kvlab model already loaded (same weights, same dtype,
no second copy) instead of loading the folder again.

Example:
    >>> provider = KvlabModelProvider(cli_args(model), model)
    >>> gen = KvlabResponseGenerator(provider, adapter, ledger, events)
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import (GenerationContext, ModelProvider, Response, ResponseGenerator,
                           TimeBudget)

from ..errors import RequestError

DEFAULT_MODEL = "default_model"  # mlx-lm's name for the model given on its command line


def cli_args(model, *, prompt_cache_bytes: int | None = None, prompt_cache_size: int = 10,
             max_tokens: int = 512, decode_concurrency: int = 32, prompt_concurrency: int = 8,
             prefill_step_size: int = 2048) -> argparse.Namespace:
    """The namespace ``mlx_lm.server.main`` would parse for ``--model <folder>``: its defaults."""
    return argparse.Namespace(
        model=str(model.path), adapter_path=None, host="127.0.0.1", port=0, allowed_origins=["*"],
        draft_model=None, num_draft_tokens=3, trust_remote_code=False, log_level="WARNING",
        chat_template="", use_default_chat_template=False, temp=0.0, top_p=1.0, top_k=0,
        min_p=0.0, max_tokens=max_tokens, chat_template_args={},
        decode_concurrency=decode_concurrency, prompt_concurrency=prompt_concurrency,
        prefill_step_size=prefill_step_size, prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=prompt_cache_bytes, kv_bits=None, kv_group_size=64,
        quantized_kv_start=5000, pipeline=False)


class KvlabModelProvider(ModelProvider):
    """mlx-lm's ModelProvider serving the one kvlab model it was given."""

    def __init__(self, args: argparse.Namespace, model):
        self.kv_model = model
        super().__init__(args)

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if (model_path, adapter_path, draft_model_path) != (self.cli_args.model, None, None):
            raise RequestError(f"kvlab serve serves one model ({self.kv_model.name}); adapters and "
                               "draft models are not supported")
        m = self.kv_model
        self.reset()
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.draft_model = m.net, m.tokenizer, None
        self.processor = load_processor(m.net, m.config)
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(m.net))


class StepBudget(TimeBudget):
    """mlx-lm's time budget; every step it grants is one ``BatchGenerator.next()`` call."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __next__(self):
        value = super().__next__()
        self.events.advance_step()
        return value


class ObservedQueue:
    """A request's response queue as the generation thread sees it: every item is reported to
    the ledger, then passed on unchanged."""

    def __init__(self, inner, rid, ledger, adapter, events):
        self.inner, self.rid, self.ledger, self.adapter, self.events = inner, rid, ledger, adapter, events

    def put(self, item, *args, **kwargs):
        if isinstance(item, GenerationContext):
            self.ledger.admitted(self.rid, item)
        elif isinstance(item, Response):
            self.ledger.token(self.rid, item)
        elif item is None:
            self.adapter.finishing(self.rid)  # mlx-lm's insert of prompt + output comes next
            self.ledger.done(self.rid, "ok")  # recorded before the client can see the end
        elif isinstance(item, Exception):
            self.ledger.done(self.rid, "error", f"{type(item).__name__}: {item}")
        return self.inner.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class KvlabResponseGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator over a kvlab prompt-cache adapter (see module docstring)."""

    def __init__(self, provider, adapter, ledger, events):
        self.kv_ledger, self.kv_events = ledger, events
        self.kv_context = provider.kv_model.context_length
        super().__init__(provider, adapter)
        # No request can reach the loop before the server starts listening, so the budget is
        # swapped before mlx-lm's thread first iterates it.
        self._time_budget = StepBudget(events)

    def _run_generate(self):
        try:
            super()._run_generate()
        finally:
            # MLX keeps a stream per thread; one left behind by a thread that ran compiled
            # kernels aborts the process at exit ("terminate called without an active exception")
            mx.synchronize()
            mx.clear_streams()

    def generate(self, request, generation_args, progress_callback=None):
        # the handler reads these: kvlab's refusal (-> 400, not mlx-lm's 404) and the usage
        try:
            ctx, response = super().generate(request, generation_args, progress_callback)
        except Exception as e:
            request.kvlab_error = e
            raise
        request.kvlab_prompt_tokens, request.kvlab_cached = len(ctx.prompt), ctx.prompt_cache_count
        return ctx, response

    def _next_request(self, timeout=None):
        item = super()._next_request(timeout)
        if item is None:
            return None
        rqueue, request, args = item
        rid = getattr(request, "kvlab_rid", None)
        return ObservedQueue(rqueue, rid, self.kv_ledger, self.prompt_cache, self.kv_events), request, args

    def _tokenize(self, tokenizer, request, args):
        rid = getattr(request, "kvlab_rid", None)
        out = super()._tokenize(tokenizer, request, args)
        prompt, segments = out[0], out[1]
        if not prompt:
            raise RequestError("the request renders to an empty prompt; send at least one message "
                               "with content")
        if self.kv_context and len(prompt) + args.max_tokens > self.kv_context:
            raise RequestError(f"prompt of {len(prompt)} tokens + max_tokens {args.max_tokens} exceeds "
                               f"the model's context of {self.kv_context} tokens; shorten the prompt "
                               "or lower max_tokens")
        self.kv_ledger.tokenized(rid, prompt)
        self.prompt_cache.begin(rid, prompt, segments)
        return out
