"""mlx-lm's ResponseGenerator and ModelProvider, extended (not copied) to report to kvlab.

``KvlabResponseGenerator`` runs mlx-lm's own batching loop unchanged and observes it at three
seams mlx-lm already has: ``_tokenize`` (which request is about to be looked up; its prompt is
checked against the model's context, and its segments are recut where the ``--checkpoints``
policy snapshots: ``kvlab.serving.checkpointing``), ``_next_request`` (each request's response
queue is wrapped so its context, tokens and end are seen on the generation thread, in order) and the time budget
that paces ``BatchGenerator.next()`` (each step advances the event log's batch step).
``KvlabModelProvider`` hands mlx-lm the kvlab model already loaded (same weights, same dtype,
no second copy) instead of loading the folder again. A VLM is never batchable: mlx-lm's loop
sends each of its requests to ``_serve_single``, which kvlab.serving.vlm_generator serves; a text
request that cannot join the batch (Llama 4's chunked cache has no ``merge``; a seed) goes there
too, and is served with the ``--checkpoints`` snapshots (kvlab.serving.sequential) unless no
snapshot is taken.

If the generation thread dies (an exception out of mlx-lm's loop), every request it had taken
gets a ``GenerationError`` naming the cause (the handler answers 500) and a new thread takes
over; requests still queued are served by it. After ``MAX_DEATHS`` deaths with no request
finishing in between, the generator gives up: queued and later requests get 503 with the cause
and ``on_fatal(error)`` is called (``kvlab serve`` then exits non-zero).

Example:
    >>> provider = KvlabModelProvider(cli_args(model), model)
    >>> gen = KvlabResponseGenerator(provider, adapter, ledger, events)
"""

from __future__ import annotations

import argparse
import logging
import threading
from queue import Empty

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import (GenerationContext, ModelProvider, Response, ResponseGenerator,
                           TimeBudget)

from ..errors import GenerationError, KvlabError, RequestError
from .checkpointing import request_tokens
from .sequential import TextRequests
from .vlm_generator import VLMRequests

log = logging.getLogger("kvlab.serving")
MAX_DEATHS = 3  # deaths in a row (no request finished in between) before the generator gives up
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

    def __init__(self, args: argparse.Namespace, model, *, sequential: bool = False):
        self.kv_model = model
        self.kv_sequential = sequential  # a press: compressed caches have no merge (kvlab.compressing)
        super().__init__(args)

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if (model_path, adapter_path, draft_model_path) != (self.cli_args.model, None, None):
            raise RequestError(f"kvlab serve serves one model ({self.kv_model.name}); adapters and "
                               "draft models are not supported")
        m = self.kv_model
        self.reset()
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.draft_model = m.net, m.tokenizer, None
        if m.kind == "vlm":  # bound per request: served one at a time (kvlab.serving.vlm_generator)
            self.processor, self.is_batchable = None, False
            return
        self.processor = load_processor(m.net, m.config)
        self.is_batchable = not self.kv_sequential and all(hasattr(c, "merge") for c in make_prompt_cache(m.net))


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
    the ledger, then passed on. The GenerationContext is held back until the next item: mlx-lm
    sends it before prefill (the sequential path even before its cache lookup), and the HTTP
    thread answers 200 on receiving it, so a failure in prefill could no longer become a 5xx.
    The end (None) is held back until the request's prompt + output offer is done (mlx-lm makes
    it right after the end): the client's response ends only once all its request's rows are in
    (``Server.events``)."""

    def __init__(self, inner, rid, ledger, adapter, events, owner):
        self.inner, self.rid, self.ledger, self.adapter, self.events = inner, rid, ledger, adapter, events
        self.owner, self.held, self.ending = owner, None, False
        owner.kv_open[id(self)] = self

    def put(self, item, *args, **kwargs):
        if isinstance(item, GenerationContext):
            self.held = item
            return None
        if isinstance(item, Exception):
            self.held = None
            if self.ending:  # the response was whole; what failed came after it (the final insert)
                return self._end()
            self.owner.kv_open.pop(id(self), None)
            self.ledger.done(self.rid, "error", f"{type(item).__name__}: {item}")
            return self.inner.put(item, *args, **kwargs)
        if self.held is not None:
            ctx, self.held = self.held, None
            found = self.adapter.found(self.rid)
            if "press_tokens" in found:  # mlx-lm counts a compressed context as cached: only a hit is
                ctx.prompt_cache_count = found["reused"]
            self.ledger.admitted(self.rid, ctx)
            self.inner.put(ctx)
        if isinstance(item, Response):
            self.ledger.token(self.rid, item)
        elif item is None:
            self.owner.kv_deaths = 0
            self.ending = True
            self.ledger.done(self.rid, "ok")  # the finish row, before the client can see the end
            return self.adapter.finishing(self.rid, release=self._end)
        return self.inner.put(item, *args, **kwargs)

    def _end(self) -> None:
        if self.owner.kv_open.pop(id(self), None) is not None:
            self.inner.put(None)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class KvlabResponseGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator over a kvlab prompt-cache adapter (see module docstring)."""

    def __init__(self, provider, adapter, ledger, events, on_fatal=None, checkpoints=None):
        self.kv_ledger, self.kv_events = ledger, events
        self.kv_checkpoints = checkpoints  # a ServedCheckpoints: where prefill stops to snapshot
        self.kv_context = provider.kv_model.context_length
        # read by the generation thread as soon as super().__init__ starts it
        self.kv_open: dict[int, ObservedQueue] = {}  # requests the generation thread has taken
        self.kv_deaths = self.kv_restarts = 0
        self.kv_failure: GenerationError | None = None
        self.kv_on_fatal = on_fatal
        self.kv_lock = threading.Lock()
        model = provider.kv_model
        # mlx-lm's sequential path: a VLM's requests, and (when prompts are snapshotted while
        # prefilled) a text model's that cannot join the batch, served with kvlab's checkpoints; with
        # a press, mlx-lm's own (its lookup is where the context is compressed: kvlab.serving.pressing)
        self.kv_sequential = (VLMRequests(model, adapter, ledger, checkpoints) if model.kind == "vlm" else
                              TextRequests(model, adapter, ledger, checkpoints, tokenize=self._tokenize)
                              if checkpoints is not None and checkpoints.active and adapter.press is None
                              else None)
        super().__init__(provider, adapter)
        # No request can reach the loop before the server starts listening, so the budget is
        # swapped before mlx-lm's thread first iterates it.
        self._time_budget = StepBudget(events)

    def _run_generate(self):
        try:
            self._generate()
        except Exception as e:  # noqa: BLE001  every request must hear why, and serving goes on
            self._died(e)
        finally:
            # MLX keeps a stream per thread; one left behind by a thread that ran compiled
            # kernels aborts the process at exit ("terminate called without an active exception")
            try:
                mx.synchronize()
            finally:
                mx.clear_streams()

    def _died(self, e: Exception) -> None:
        cause = f"{type(e).__name__}: {e}"
        log.error("kvlab serve: mlx-lm's generation thread died: %s", cause, exc_info=e)
        self.kv_events.add("error", detail=f"generation thread died: {cause}")
        for q in list(self.kv_open.values()):
            q.put(GenerationError(f"generation failed: mlx-lm's generation thread died ({cause}); "
                                  "the request was not completed, retry it", 500))
        with self.kv_lock:
            if self._stop:
                return
            self.kv_deaths += 1
            if self.kv_deaths <= MAX_DEATHS:
                self.kv_restarts += 1
                self.kv_events.add("restart", detail=f"generation thread restarted after: {cause}")
                # started before it is published: mlx-lm's generation_available() reads
                # is_alive(), and a request arriving between the two would be refused as "died"
                thread = threading.Thread(target=self._run_generate, name="kvlab-generation", daemon=False)
                thread.start()
                self._generation_thread = thread
                return
            self.kv_failure = GenerationError(
                f"kvlab serve stopped generating: mlx-lm's generation thread died {self.kv_deaths} "
                f"times in a row, last with {cause}; see the server log and restart it", 503)
            self._generation_failed = True
        while True:  # what is still queued will never be taken
            try:
                rqueue, request, _ = self.requests.get_nowait()
            except Empty:
                break
            ObservedQueue(rqueue, getattr(request, "kvlab_rid", None), self.kv_ledger, self.prompt_cache,
                          self.kv_events, self).put(self.kv_failure)
        if self.kv_on_fatal is not None:
            self.kv_on_fatal(self.kv_failure)

    def stop_and_join(self):
        self._stop = True
        while True:
            with self.kv_lock:
                thread = self._generation_thread
            thread.join()
            with self.kv_lock:
                if thread is self._generation_thread:
                    return

    def generate(self, request, generation_args, progress_callback=None):
        # the handler reads these: kvlab's refusal (-> 400, not mlx-lm's 404) and the usage
        try:
            if self.kv_failure is not None:
                raise self.kv_failure
            ctx, response = super().generate(request, generation_args, progress_callback)
        except Exception as e:
            request.kvlab_error = err = self.kv_error(e)
            if err is e:
                raise
            raise err from e
        request.kvlab_prompt_tokens, request.kvlab_cached = len(ctx.prompt), ctx.prompt_cache_count
        return ctx, response

    def kv_error(self, e: Exception) -> Exception:
        """A kvlab error for what ended a request: its own, or a GenerationError with the cause."""
        if isinstance(e, KvlabError):
            return e
        if self.kv_failure is not None:
            return self.kv_failure
        return GenerationError(f"generation failed: {type(e).__name__}: {e}", 500)

    def _serve_single(self, request, stream):
        if self.kv_sequential is None:
            return super()._serve_single(request, stream)
        return self.kv_sequential.serve(*request, stream)

    def _next_request(self, timeout=None):
        item = super()._next_request(timeout)
        if item is None:
            return None
        rqueue, request, args = item
        rid = getattr(request, "kvlab_rid", None)
        return ObservedQueue(rqueue, rid, self.kv_ledger, self.prompt_cache, self.kv_events, self), request, args

    def _tokenize(self, tokenizer, request, args):
        rid = getattr(request, "kvlab_rid", None)
        try:
            out = super()._tokenize(tokenizer, request, args)
        except KvlabError:
            raise
        except Exception as e:  # noqa: BLE001  the chat template refused what the client sent
            raise RequestError(f"the request cannot be rendered by the model's chat template: "
                               f"{type(e).__name__}: {e}") from e
        prompt, segments = out[0], out[1]
        if not prompt:
            raise RequestError("the request renders to an empty prompt; send at least one message "
                               "with content")
        if self.kv_context and len(prompt) + args.max_tokens > self.kv_context:
            raise RequestError(f"prompt of {len(prompt)} tokens + max_tokens {args.max_tokens} exceeds "
                               f"the model's context of {self.kv_context} tokens; shorten the prompt "
                               "or lower max_tokens")
        plan = self.kv_checkpoints
        if plan is not None and not plan.is_mlx_default:
            toks = request_tokens(plan.model, request, prompt)
            segments, types = plan.split(toks, prompt, segments, out[2])
            out = (prompt, segments, types, *out[3:])
        self.kv_ledger.tokenized(rid, prompt)
        self.prompt_cache.begin(rid, prompt, segments)
        return out
