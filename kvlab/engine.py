"""Engine: the one mutable object. Runs requests through a prefix-cache store and records every
state change as an event row.

Example:
    >>> engine = kv.Engine(kv.load("tiny"), kv.RadixStore(), verify=True)
    >>> r = engine.run([{"role": "user", "content": "Hi"}], max_tokens=8)
    >>> r.match, r.reused_tokens, r.verify_diff
    >>> engine.events, engine.stats()
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import polars as pl
from mlx_lm.generate import generate_step

from . import device
from .checkpoints import parse_policy, prefill_stops
from .compressing import NOT_REUSED, check_press, compress_context, context_end_of, press_key
from .errors import KvlabError, RequestError
from .keys import CacheKey, cache_key
from .policies.reasons import ALL_REASONS
from .presses.decoding import attach
from .primitives import timing
from .primitives.display import summary_html, table_html
from .primitives.kv_format import check_settings, check_start, head_dims_of
from .primitives.snapshots import advance, make_cache, prefill, snapshot
from .primitives.tokens import Tokens, common_prefix_len, is_id_sequence
from .request import Request
from .result import Result, hit_rates
from .reuse import PrefixCache, restorable_limit

KEYINGS = ("prompt", "prompt+output")
# the core's rows (kvlab.reuse: EVENT_COLUMNS, event names documented there) plus the time
EVENT_SCHEMA = {"request": pl.Int64, "event": pl.Utf8, "tokens": pl.Int64, "bytes": pl.Int64,
                "entry": pl.Utf8, "t": pl.Float64, "detail": pl.Utf8}


class _Counted:
    """A net that counts the tokens it runs."""

    def __init__(self, net):
        self.net, self.ran = net, 0

    def __call__(self, ids, *args, **kwargs):
        self.ran += ids.shape[-1]
        return self.net(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.net, name)


def _greedy(logprobs):
    return mx.argmax(logprobs, axis=-1)


class Engine:
    """Runs requests through ``store`` (None: no caching, the cold baseline).

    ``kv_bits``/``kv_group_size``/``quantized_kv_start`` quantize the KV cache with mlx-lm's meaning
    (its generate's options): in prefill and decode, the cache becomes a QuantizedKVCache once its
    offset reaches ``quantized_kv_start`` (kvlab's default 0; mlx-lm's 5000), and a restored
    quantized prefix continues quantized. The store then holds quantized snapshots; KV of another
    format (float, other bits) found in the store raises SnapshotError instead of being reused.
    ``verify`` compares with a cold run under the same settings: its diff is what reuse adds.
    ``checkpoints`` names where to snapshot a prompt while prefilling it (``kvlab.checkpoints``:
    a spec such as ``message_ends``, ``segment_ends`` as mlx-lm's server, ``every:256``, ``none``,
    or a policy object; True/False for the first and ``none``); by default ``message_ends`` for
    caches that cannot be cut back, else ``none``. A policy that declined a checkpoint a request
    needed says so in the request's ``why``.
    ``press`` (``kv.press(name, ratio)``) compresses each request's context (the prompt before its
    last message, or ``run(..., context_end=)``) once and stores it under a key that includes the
    press; the last message and the reply run on the compressed cache, and a request with the same
    context reuses it whole (``kvlab.compressing``).
    Every lookup, restore and insert goes through the reuse core (``kvlab.reuse``), the same one
    kvlab's server runs.
    """

    def __init__(self, model, store=None, *, keying: str = "prompt", verify: bool = False,
                 image_keys: bool = True, checkpoints: bool | str | None = None, max_tokens: int = 16,
                 kv_bits: int | None = None, kv_group_size: int = 64, quantized_kv_start: int = 0,
                 press=None):
        if keying not in KEYINGS:
            raise KvlabError(f"keying must be one of {KEYINGS}, got {keying!r}")
        if kv_bits is not None:
            check_settings(kv_bits, kv_group_size, head_dims_of(model))
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.quantized_kv_start = check_start(quantized_kv_start)
        self._kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size,
                    "quantized_kv_start": quantized_kv_start}
        device.warn_if_slow_blas()
        self.model = model
        self.store = store
        self.press = check_press(press, model, store)
        self.keying = keying
        self.verify = verify
        self.image_keys = image_keys
        self.max_tokens = max_tokens
        # Caches that cannot be restored at any earlier position (recurrent, sliding, chunked
        # layers) are reusable exactly where a snapshot was taken: take them at boundaries.
        if checkpoints is None:
            checkpoints = not model.layout.restores_anywhere
        if isinstance(checkpoints, bool):
            checkpoints = "message_ends" if checkpoints else "none"
        self.checkpoint_policy = parse_policy(checkpoints).for_model(model)
        self.checkpoints = self.checkpoint_policy.name != "none"
        self.core = PrefixCache(store, model, kv=self._kv, emit=self._event)
        self.results: list[Result] = []
        self._events: list[dict] = []
        self._ids = itertools.count(1)
        self._t0 = timing.now()
        self._last_cached: tuple[int, ...] | None = None  # what the last request left cached
        self._last_prompt_len = 0
        self._last_messages: tuple | None = None
        self._listeners: list = []
        self._net = model.net  # what runs the current request's ids (model.for_request)

    # -- running ----------------------------------------------------------------------------------
    def tokens_of(self, request) -> tuple[Tokens, tuple, str | None, int | None]:
        """(Tokens, extra-key spans, salt, max_tokens) of any accepted request form: chat messages,
        text, token ids, ``Tokens`` or a ``kv.workloads.Request``. Ids outside the model's
        vocabulary raise TokenIdError naming the position."""
        extra, salt, max_tokens, template = (), None, None, {}
        if isinstance(request, Request):
            extra, salt, max_tokens = request.extra_keys, request.salt, request.max_tokens
            template = request.template_kwargs  # tools reach the chat template
            request = list(request.messages) if request.messages is not None else list(request.ids)
        if isinstance(request, Tokens):
            self.model.check_ids(request.ids)
            return request, extra, salt, max_tokens
        if isinstance(request, (list, tuple, str)) or is_id_sequence(request):
            if len(request) == 0:
                raise RequestError("empty request: pass messages, text or token ids")
            return self.model.tokenise(request, **template), extra, salt, max_tokens
        raise RequestError(f"cannot run a {type(request).__name__}: pass a list of messages, "
                           "a string, token ids, Tokens or a kv.workloads.Request")

    def key_of(self, request, *, extra_keys=(), salt=None) -> CacheKey:
        """The cache key this engine gives ``request`` (its images' hashes unless image_keys=False)."""
        toks, extra, req_salt, _ = self.tokens_of(request)
        return cache_key(toks, extra_keys=tuple(extra_keys) + tuple(extra),
                         salt=salt if salt is not None else req_salt, image_keys=self.image_keys)

    def run(self, request, max_tokens: int | None = None, *, extra_keys=(), salt=None,
            context_end: int | None = None) -> Result:
        """Run one request: look up, restore, prefill the rest, decode greedily, insert, record.
        With a press, ``context_end`` says where the compressed context ends."""
        toks, extra, req_salt, req_max = self.tokens_of(request)
        self._net = self.model.for_request(toks)  # a VLM binds the request's images and positions
        max_tokens = max_tokens if max_tokens is not None else (req_max or self.max_tokens)
        ids = toks.ids
        limit = self.model.context_length
        if not ids:
            raise RequestError("empty request: it has no tokens")
        if limit and len(ids) + max_tokens > limit:
            raise RequestError(f"request of {len(ids)} tokens + {max_tokens} to generate exceeds the "
                               f"model's context of {limit} tokens; shorten it or lower max_tokens")
        key = cache_key(toks, extra_keys=tuple(extra_keys) + tuple(extra),
                        salt=salt if salt is not None else req_salt, image_keys=self.image_keys)
        rid = next(self._ids)
        drift = self._drift(toks)
        start = timing.timed()
        end = 0
        if self.press is not None:
            end = context_end_of(toks, context_end)
            key = press_key(key, self.press, end)
            found = self.core.lookup(rid, key, toks, limit=end, whole=True)
            waited = "" if self.press.reusable else NOT_REUSED.format(name=self.press.name)
        else:
            found = self.core.lookup(rid, key, toks, limit=len(ids) - 1)
            waited = self.checkpoint_policy.why_missed(toks, found.reused) if self.store is not None else ""

        t = timing.timed()
        if self.press is not None:
            (logits, cache), checkpoints, last_stop = self._pressed(rid, toks, found, key, end), 0, None
        else:
            logits, cache, checkpoints, last_stop = self._prefill(rid, toks, found.reused, found.cache, key)
        first = int(mx.argmax(logits).item())
        prefill_s = t.done(logits)
        ttft = start.done()
        if last_stop is not None:
            self.core.offer(rid, *last_stop, kind="checkpoint")
        keeps = self.store is not None and self.press is None  # a compressed context was offered whole
        prompt_snap = snapshot(cache, tokens=ids, model=self.model) if keeps else None

        t = timing.timed()
        out, ran = self._decode(first, cache, max_tokens)
        decode_s = t.done()

        seq, inserted, snap = ids, key, prompt_snap
        if self.keying == "prompt+output" and keeps:
            seq = (ids + tuple(out))[:len(ids) + ran]
            snap = snapshot(cache, tokens=seq, model=self.model)
            inserted = CacheKey(seq, key.extra_keys, key.salt)
        if keeps:
            # stores refresh (not replace) an entry they already hold for the same tokens
            self.core.offer(rid, inserted, toks, snap, kind=self.keying)
        elif self.press is not None:
            seq, inserted = ids[:end], key.prefix(end)
        self._last_cached, self._last_prompt_len, self._last_messages = seq, len(ids), toks.messages
        events = self.core.drain(rid, inserted, offered=self.press is None or self.press.reusable)
        reused = found.reused
        verify_diff = self._verify(ids, logits, end) if self.verify and reused else (0.0 if self.verify else None)
        result = Result(
            request_id=rid, prompt_tokens=len(ids), reused_tokens=reused, prefilled_tokens=len(ids) - reused,
            match=found.kind, ttft_s=ttft, lookup_s=found.lookup_s, restore_s=found.restore_s,
            prefill_s=prefill_s, decode_s=decode_s, output_ids=tuple(out),
            text=self.model.tokenizer.decode(list(out)),
            store_bytes=self.store.nbytes if self.store is not None else 0,
            evictions=sum(ev.capacity for ev in events), verify_diff=verify_diff,
            why="; ".join(w for w in (found.why, waited) if w),
            drift_index=drift, entry_tokens=found.match.entry_tokens, checkpoints=checkpoints,
            prompt_ids=ids, miss_reasons=found.missed.reasons, diverged_at=found.missed.diverged_at,
            evicted_by=found.missed.evicted_by, press=None if self.press is None else self.press.key,
            press_tokens=end)
        self.results.append(result)
        for listener in self._listeners:
            listener(self, result)
        return result

    def run_all(self, requests, max_tokens: int | None = None) -> pl.DataFrame:
        """Run every request of a workload; the frame of their results."""
        for request in requests:
            self.run(request, max_tokens)
        return self.results_frame()

    def _prefill(self, rid, toks: Tokens, reused, cache, key):
        """Prefill ids[reused:], stopping to snapshot where the checkpoint policy says
        (``kvlab.checkpoints``): caches that cannot be cut back are reusable only exactly where a
        snapshot was taken. Every snapshot but the last is offered at once; the last (key, tokens,
        snapshot) is returned to be offered after the first token, as a server would, so a store
        that copies it (paged) does so outside the TTFT. Holding one snapshot pins at most one
        copy of the cache while the rest of the prompt runs; holding all would pin one per stop."""
        ids, bounds = toks.ids, ()
        if self.checkpoints and self.store is not None:
            bounds = prefill_stops(self.checkpoint_policy.positions(toks, self.model.tokenizer), len(ids),
                                   self.store.capabilities, self.model.layout)
            # never a stop inside an image whose tokens attend to each other (gemma4)
            bounds = tuple(b for b in bounds if b > reused and restorable_limit(self.model, toks, b)[0] == b)
        cache = make_cache(self.model) if cache is None else cache
        pos, pending = reused, None
        for b in bounds:
            self._advance(ids[pos:b], cache)
            if pending is not None:
                self.core.offer(rid, *pending, kind="checkpoint")
            pending = (key.prefix(b), toks, snapshot(cache, tokens=ids[:b], model=self.model))
            pos = b
        return *self._forward(ids[pos:], cache), len(bounds), pending

    def _pressed(self, rid, toks: Tokens, found, key, end: int):
        """(logits, cache) of a request with a press: its compressed context restored whole, or
        compressed now (and offered, if the press is reusable); then the rest of the prompt."""
        ids = toks.ids
        cache = attach(self.press, found.cache) if found.reused == end else None  # decoding: hooks again
        if cache is None:
            c = compress_context(self.model, ids, end, self.press, self._kv)
            cache = c.cache
            self._event(rid, "compress", end, c.bytes_full - c.bytes_kept, None, self.press.key)
            if self.press.reusable and self.store is not None:
                self.core.offer(rid, key.prefix(end), toks, snapshot(cache, tokens=ids[:end], model=self.model),
                                kind="compressed")
        return self._forward(ids[end:], cache)

    @property
    def trimmable(self) -> bool:
        """Whether this model's cache can be restored at any earlier position (full KV only)."""
        return self.model.layout.restores_anywhere

    def _advance(self, ids, cache) -> None:
        advance(self._net, ids, cache, **self._kv)

    def _forward(self, ids, cache):
        """(last-position logits, cache) after running ids into cache."""
        return prefill(self._net, ids, make_cache(self.model) if cache is None else cache, **self._kv)

    def _decode(self, first: int, cache, max_tokens: int) -> tuple[list[int], int]:
        """Greedy tokens from ``first`` on, and how many of them the cache has run (mlx-lm's
        generate_step runs one token ahead; a recurrent cache cannot say so itself)."""
        out = [first]
        eos = set(self.model.tokenizer.eos_token_ids)
        if max_tokens <= 1 or first in eos:
            return out[:max_tokens], 0
        net = _Counted(self._net)
        for token, _ in generate_step(mx.array([first]), net,
                                      max_tokens=max_tokens - 1, sampler=_greedy, prompt_cache=cache,
                                      **self._kv):
            out.append(int(token))
            if token in eos:
                break
        return out, net.ran

    def _verify(self, ids, logits, end: int = 0) -> float:
        # with a press the cold run compresses the context afresh: reuse must give exactly that
        cache = compress_context(self.model, ids, end, self.press, self._kv).cache if self.press is not None else None
        cold, _ = self._forward(ids[end:], cache)
        return float(mx.abs(cold - logits).max().item())

    def _drift(self, toks: Tokens) -> int | None:
        """Where this prompt stops matching what the previous request cached (its prompt, or
        prompt + output), when this request continues that conversation: templates that re-render
        history (Qwen3 drops <think>) make the cached ids stop matching (re-tokenisation drift).
        A continuation is a conversation that starts with the previous one's messages; for
        token-id requests, one whose divergence lies in the previous request's generated ids."""
        prev, ids = self._last_cached, toks.ids
        if prev is None:
            return None
        n = common_prefix_len(prev, ids)
        if n >= len(prev):
            return None
        before = self._last_messages
        if toks.messages is not None and before is not None:
            continues = len(toks.messages) > len(before) and toks.messages[: len(before)] == before
            return n if continues else None
        return n if n >= self._last_prompt_len else None

    # -- events -----------------------------------------------------------------------------------
    def _event(self, rid, event, tokens, nbytes, entry, detail=None):
        self._events.append({"request": rid, "event": event, "tokens": int(tokens), "bytes": int(nbytes),
                             "entry": None if entry is None else str(entry),
                             "t": timing.now() - self._t0, "detail": detail})

    @property
    def events(self) -> pl.DataFrame:
        """One row per state change, in the core's schema (``kvlab.reuse``): lookup, hit, miss
        (one row per reason, the reason in ``detail``), refused, offer, insert, evict, ..."""
        return pl.DataFrame(self._events, schema=EVENT_SCHEMA)

    def results_frame(self) -> pl.DataFrame:
        rows = [r.row() for r in self.results]
        return pl.DataFrame(rows) if rows else pl.DataFrame()

    def stats(self) -> dict:
        """Both hit-rate definitions, named: vLLM's per token and vllm-mlx's per request."""
        n = len(self.results)
        return {
            "requests": n,
            "prompt_tokens": sum(r.prompt_tokens for r in self.results),
            "reused_tokens": sum(r.reused_tokens for r in self.results),
            **hit_rates((r.prompt_tokens, r.reused_tokens) for r in self.results),
            "bytes": self.store.nbytes if self.store is not None else 0,
            "entries": self.store.entries if self.store is not None else 0,
            "evictions": sum(r.evictions for r in self.results),
            "miss_reasons": {k: sum(r.miss_reasons.get(k, 0) for r in self.results) for k in ALL_REASONS},
        }

    def on_result(self, callback) -> None:
        """Call ``callback(engine, result)`` after every request (the Inspector uses this)."""
        self._listeners.append(callback)

    def __repr__(self) -> str:
        s = self.stats()
        store = self.store.name if self.store is not None else "none"
        kv = "" if self.kv_bits is None else f", kv q{self.kv_bits}g{self.kv_group_size}"
        kv += "" if self.press is None else f", press {self.press.key}"
        return (f"Engine({self.model.name}, store={store}, keying={self.keying}{kv}: "
                f"{s['requests']} requests, token hit {s['token_hit_rate']:.1%}, "
                f"request hit {s['request_hit_rate']:.1%})")

    def _repr_html_(self) -> str:
        s = self.stats()
        s["miss_reasons"] = ", ".join(f"{k} {n}" for k, n in s["miss_reasons"].items() if n) or "none"
        rows = [(k, f"{v:.3f}" if isinstance(v, float) else v) for k, v in s.items()]
        return summary_html("Engine", repr(self), body=table_html(None, rows, row_headers=True))

