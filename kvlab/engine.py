"""Engine: the one mutable object. Runs requests through a prefix-cache store and records every
state change as an event row.

Example:
    >>> engine = kv.Engine(kv.load("tiny"), kv.RadixStore(), verify=True)
    >>> r = engine.run([{"role": "user", "content": "Hi"}], max_tokens=8)
    >>> r.match, r.reused_tokens, r.verify_diff
    >>> engine.events, engine.stats()
"""

from __future__ import annotations

import html
import itertools
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import polars as pl
from mlx_lm.generate import generate_step

from . import _blas
from .errors import KvlabError, NotTrimmableError, RequestError, SnapshotError
from .keys import CacheKey, cache_key
from .miss_reasons import MissIndex
from .policies.reasons import ALL_REASONS
from .primitives.kv_format import check_reusable, check_settings, check_start, head_dims_of
from .request import Request
from .primitives.snapshots import advance, make_cache, non_trimmable_layers, prefill, restore, snapshot, trim
from .stores.base import MISS, StoreEvent
from .primitives.tokens import Tokens, common_prefix_len, is_id_sequence

KEYINGS = ("prompt", "prompt+output")
EVENT_SCHEMA = {"request": pl.Int64, "event": pl.Utf8, "tokens": pl.Int64, "bytes": pl.Int64,
                "entry": pl.Utf8, "t": pl.Float64, "detail": pl.Utf8}


@dataclass(frozen=True)
class Result:
    """What one request reused, what it cost, and why."""

    request_id: int
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    match: str
    ttft_s: float
    lookup_s: float
    restore_s: float
    prefill_s: float
    decode_s: float
    output_ids: tuple[int, ...]
    text: str
    store_bytes: int
    evictions: int
    verify_diff: float | None = None
    why: str = ""
    drift_index: int | None = None
    entry_tokens: int = 0
    checkpoints: int = 0
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)
    # missed tokens by reason (kvlab.policies.reasons); empty when unknown (a server's results)
    miss_reasons: dict = field(default_factory=dict, repr=False)
    diverged_at: int | None = None
    evicted_by: int | None = None

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def row(self) -> dict:
        d = asdict(self)
        d.pop("prompt_ids")
        reasons = d.pop("miss_reasons")
        d.update({r: reasons.get(r) for r in ALL_REASONS})  # one column per reason (null: unknown)
        d["output_ids"] = list(self.output_ids)
        d["reuse_ratio"] = self.reuse_ratio
        return d

    def __repr__(self) -> str:
        v = "" if self.verify_diff is None else f", verify {self.verify_diff:.2e}"
        return (f"Result(#{self.request_id} {self.match}: reused {self.reused_tokens}/{self.prompt_tokens}, "
                f"prefilled {self.prefilled_tokens}, ttft {self.ttft_s * 1e3:.0f} ms{v})")

    def _repr_html_(self) -> str:
        bar = int(300 * self.reuse_ratio)
        why = f"<br><i>{html.escape(self.why)}</i>" if self.why else ""
        drift = (f"<br>re-tokenisation drift at token {self.drift_index}"
                 if self.drift_index is not None else "")
        v = "" if self.verify_diff is None else f" · verify max|Δlogit| {self.verify_diff:.2e}"
        missed = ", ".join(f"{k} {n}" for k, n in self.miss_reasons.items() if n)
        why += f"<br>missed: {html.escape(missed)}" if missed else ""
        return (f"<div><b>Request #{self.request_id}</b> <code>{self.match}</code> · reused "
                f"{self.reused_tokens}/{self.prompt_tokens} tokens · TTFT {self.ttft_s * 1e3:.1f} ms "
                f"(prefill {self.prefill_s * 1e3:.1f} ms){v}"
                f'<div style="width:300px;height:8px;background:#eee"><div style="width:{bar}px;'
                f'height:8px;background:#2a7"></div></div>{why}{drift}'
                f"<pre style='white-space:pre-wrap'>{html.escape(self.text[:500])}</pre></div>")


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
    """

    def __init__(self, model, store=None, *, keying: str = "prompt", verify: bool = False,
                 image_keys: bool = True, checkpoints: bool | None = None, max_tokens: int = 16,
                 kv_bits: int | None = None, kv_group_size: int = 64, quantized_kv_start: int = 0):
        if keying not in KEYINGS:
            raise KvlabError(f"keying must be one of {KEYINGS}, got {keying!r}")
        if kv_bits is not None:
            check_settings(kv_bits, kv_group_size, head_dims_of(model))
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.quantized_kv_start = check_start(quantized_kv_start)
        self._kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size,
                    "quantized_kv_start": quantized_kv_start}
        _blas.warn_if_slow()
        self.model = model
        self.store = store
        self.keying = keying
        self.verify = verify
        self.image_keys = image_keys
        self.max_tokens = max_tokens
        probe = snapshot(make_cache(model))
        self.trimmable = not non_trimmable_layers(probe) if probe.layers else True
        # Non-trimmable caches can only be reused exactly where a snapshot was taken.
        self.checkpoints = (not self.trimmable) if checkpoints is None else checkpoints
        # what the store cached and lost, to say why each missed token missed
        unit = getattr(store, "block_size", None)
        self._misses = MissIndex(unit, unstorable=not self.trimmable and getattr(store, "slices_kv", False))
        self.results: list[Result] = []
        self._events: list[dict] = []
        self._ids = itertools.count(1)
        self._t0 = time.perf_counter()
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
        extra, salt, max_tokens = (), None, None
        if isinstance(request, Request):
            extra, salt, max_tokens = request.extra_keys, request.salt, request.max_tokens
            request = list(request.messages) if request.messages is not None else list(request.ids)
        if isinstance(request, Tokens):
            self.model.check_ids(request.ids)
            return request, extra, salt, max_tokens
        if isinstance(request, (list, tuple, str)) or is_id_sequence(request):
            if len(request) == 0:
                raise RequestError("empty request: pass messages, text or token ids")
            return self.model.tokenise(request), extra, salt, max_tokens
        raise RequestError(f"cannot run a {type(request).__name__}: pass a list of messages, "
                           "a string, token ids, Tokens or a kv.workloads.Request")

    def key_of(self, request, *, extra_keys=(), salt=None) -> CacheKey:
        """The cache key this engine gives ``request`` (its images' hashes unless image_keys=False)."""
        toks, extra, req_salt, _ = self.tokens_of(request)
        return cache_key(toks, extra_keys=tuple(extra_keys) + tuple(extra),
                         salt=salt if salt is not None else req_salt, image_keys=self.image_keys)

    def run(self, request, max_tokens: int | None = None, *, extra_keys=(), salt=None) -> Result:
        """Run one request: look up, restore, prefill the rest, decode greedily, insert, record."""
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
        start = time.perf_counter()

        match, why = (MISS, "no store") if self.store is None else (
            self.store.lookup(key, toks, limit=len(ids) - 1), "")
        lookup_s = time.perf_counter() - start
        why = match.why or why
        self._event(rid, "lookup", len(ids), 0, None, match.kind)
        t = time.perf_counter()
        cache, reused, refused = None, 0, 0
        if match.snapshot is not None and match.tokens > 0:
            snap = match.snapshot
            self._check_model(snap)
            try:
                if snap.offset > match.tokens:
                    snap = trim(snap, snap.offset - match.tokens)
                check_reusable(snap, **self._kv)
                cache, reused = restore(snap), match.tokens
            except NotTrimmableError as e:
                refused, match, why = match.tokens, MISS, f"could not trim the matched entry: {e}"
        restore_s = time.perf_counter() - t
        missed = self._misses.explain(key, reused, untrimmable=not self.trimmable or refused > 0,
                                      refused=refused)
        if reused:
            self._event(rid, "hit", reused, 0, match.entry_id, match.kind)
        for reason, n in missed.reasons.items():
            if n:
                self._event(rid, "miss", n, 0, None, reason)

        t = time.perf_counter()
        logits, cache, checkpoints = self._prefill(toks, reused, cache, key)
        first = int(mx.argmax(logits).item())
        prefill_s = time.perf_counter() - t
        ttft = time.perf_counter() - start
        prompt_snap = snapshot(cache, tokens=ids, model=self.model) if self.store is not None else None

        t = time.perf_counter()
        out = self._decode(first, cache, max_tokens)
        decode_s = time.perf_counter() - t

        seq, inserted = ids, key
        if self.keying == "prompt+output":
            seq = (ids + tuple(out))[:snapshot(cache).offset]
            inserted = CacheKey(seq, key.extra_keys, key.salt)
        if self.store is not None:
            # stores refresh (not replace) an entry they already hold for the same tokens
            if self.keying == "prompt":
                self.store.insert(key, toks, prompt_snap, kind="prompt")
            else:
                self.store.insert(inserted, toks, snapshot(cache, tokens=seq, model=self.model),
                                  kind="prompt+output")
        self._last_cached, self._last_prompt_len, self._last_messages = seq, len(ids), toks.messages
        evictions = self._drain(rid, inserted)
        verify_diff = self._verify(ids, logits) if self.verify and reused else (0.0 if self.verify else None)
        text = self.model.tokenizer.decode(list(out))
        result = Result(rid, len(ids), reused, len(ids) - reused, match.kind if reused else "miss",
                        ttft, lookup_s, restore_s, prefill_s, decode_s, tuple(out), text,
                        self.store.nbytes if self.store is not None else 0, evictions, verify_diff,
                        why, drift, match.entry_tokens, checkpoints, ids, missed.reasons,
                        missed.diverged_at, missed.evicted_by)
        self.results.append(result)
        for listener in self._listeners:
            listener(self, result)
        return result

    def run_all(self, requests, max_tokens: int | None = None) -> pl.DataFrame:
        """Run every request of a workload; the frame of their results."""
        for request in requests:
            self.run(request, max_tokens)
        return self.results_frame()

    def _check_model(self, snap) -> None:
        mine = self.model.fingerprint
        if snap.fingerprint is not None and snap.fingerprint != mine:
            raise SnapshotError(f"the store returned KV made by model {snap.fingerprint[:12]}, but "
                                f"this engine runs model {mine[:12]}: KV from another model is "
                                "meaningless; give each model its own store")

    def _prefill(self, toks: Tokens, reused, cache, key):
        """Prefill ids[reused:]. With checkpoints (non-trimmable caches), stop at each message
        boundary and at n-1 to snapshot: such caches are reusable only exactly where a snapshot
        was taken, and n-1 is what an identical request needs (its last token is recomputed)."""
        ids, bounds = toks.ids, []
        if self.checkpoints and self.store is not None:
            ends = {s.token_end for s in toks.spans} | {len(ids) - 1}
            bounds = sorted(b for b in ends if reused < b < len(ids))
        cache = make_cache(self.model) if cache is None else cache
        pos, checkpoints = reused, 0
        for b in bounds:
            self._advance(ids[pos:b], cache)
            self.store.insert(key.prefix(b), toks, snapshot(cache, tokens=ids[:b], model=self.model),
                              kind="checkpoint")
            pos, checkpoints = b, checkpoints + 1
        return *self._forward(ids[pos:], cache), checkpoints

    def _advance(self, ids, cache) -> None:
        advance(self._net, ids, cache, **self._kv)

    def _forward(self, ids, cache):
        """(last-position logits, cache) after running ids into cache."""
        return prefill(self._net, ids, make_cache(self.model) if cache is None else cache, **self._kv)

    def _decode(self, first: int, cache, max_tokens: int) -> list[int]:
        out = [first]
        eos = set(self.model.tokenizer.eos_token_ids)
        if max_tokens <= 1 or first in eos:
            return out[:max_tokens]
        for token, _ in generate_step(mx.array([first]), self._net,
                                      max_tokens=max_tokens - 1, sampler=_greedy, prompt_cache=cache,
                                      **self._kv):
            out.append(int(token))
            if token in eos:
                break
        return out

    def _verify(self, ids, logits) -> float:
        cold, _ = self._forward(ids, None)
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
                             "t": time.perf_counter() - self._t0, "detail": detail})

    def _drain(self, rid, inserted: CacheKey) -> int:
        """Move the store's events into the frame (and the miss memory); the evictions made to
        free room."""
        events: list[StoreEvent] = self.store.drain_events() if self.store is not None else []
        for ev in events:
            self._event(rid, ev.event, ev.tokens, ev.nbytes, ev.entry, ev.detail)
        self._misses.record(rid, inserted, events, offered=inserted if self.store is not None else None)
        return sum(ev.capacity for ev in events)

    @property
    def events(self) -> pl.DataFrame:
        """One row per state change: lookup, hit, miss (one row per reason, the reason in
        ``detail``), insert, evict, block_stored, block_removed."""
        return pl.DataFrame(self._events, schema=EVENT_SCHEMA)

    def results_frame(self) -> pl.DataFrame:
        rows = [r.row() for r in self.results]
        return pl.DataFrame(rows) if rows else pl.DataFrame()

    def stats(self) -> dict:
        """Both hit-rate definitions, named: vLLM's per token and vllm-mlx's per request."""
        prompt = sum(r.prompt_tokens for r in self.results)
        reused = sum(r.reused_tokens for r in self.results)
        n = len(self.results)
        return {
            "requests": n,
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "token_hit_rate": reused / prompt if prompt else 0.0,
            "request_hit_rate": sum(r.reused_tokens > 0 for r in self.results) / n if n else 0.0,
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
        return (f"Engine({self.model.name}, store={store}, keying={self.keying}{kv}: "
                f"{s['requests']} requests, token hit {s['token_hit_rate']:.1%}, "
                f"request hit {s['request_hit_rate']:.1%})")

    def _repr_html_(self) -> str:
        s = self.stats()
        s["miss_reasons"] = ", ".join(f"{k} {n}" for k, n in s["miss_reasons"].items() if n) or "none"
        cells = "".join(f"<tr><td>{k}</td><td>{v:.3f}</td></tr>" if isinstance(v, float)
                        else f"<tr><td>{k}</td><td>{html.escape(str(v))}</td></tr>" for k, v in s.items())
        return (f"<div><b>Engine</b> {html.escape(repr(self))}<table>{cells}</table></div>")

