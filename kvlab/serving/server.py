"""serve(): mlx-lm's own HTTP server and continuous batching with a kvlab store behind its prompt
cache, in a background thread (notebooks, tests) or in the foreground (``kvlab serve``).

The pieces are mlx-lm's: ``ResponseGenerator`` (its batching loop over ``BatchGenerator``),
``APIHandler`` (its OpenAI-compatible routes) and the standard library's ``ThreadingHTTPServer``
it runs on; kvlab adds the prompt-cache adapter (kvlab.serving.adapter: the reuse core the Engine
runs, over the store ``kv.make_store(name)`` builds, mlx-lm's own ``LRUPromptCache`` for
``"mlx-lru"`` included), the event log, the ledger of requests, the recording and the extra
routes (kvlab.serving.handler).

A vision-language model (``tiny-vlm``, an mlx-vlm folder or a ``kv.load_vlm`` model) takes images
in its chat and messages requests and is keyed as ``kv.Engine`` keys it (each image's pixel hash
over its placeholders); its requests are not continuously batched but served one at a time on the
generation thread (kvlab.serving.vlm_generator: the model is bound to each request's images).

Binds 127.0.0.1 unless told otherwise; ``port=0`` picks a free port. ``api_key`` (default
``$KVLAB_API_KEY``) is checked on every route. ``budget`` is the store's ``budget_bytes``.
``api_keys`` (a keys file or ``{key: tenant}``) serves several tenants that cannot see each other
(kvlab.tenants: salted keys, scoped metadata; ``admin_key`` sees everything; ``tenant_secret`` the
secret salts are keyed with; ``public_prefix`` system prompts shared by every tenant).

Example:
    >>> with kv.serve("tiny", "radix") as server:
    ...     client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ...     client.chat.completions.create(model="tiny", messages=[...], max_tokens=8)
    ...     server.events, server.stats()
"""

from __future__ import annotations

import logging
import os
import threading

from mlx_lm.server import get_system_fingerprint

from .. import presses
from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from ..primitives.units import fmt_bytes, parse_bytes
from .adapter import StoreAdapter
from .checkpointing import ServedCheckpoints
from .diagnosing import ServedDiagnostics
from .events import ServerEvents
from .generator import KvlabModelProvider, KvlabResponseGenerator, cli_args
from .handler import bind_handler
from .ledger import Ledger
from .listener import Listener, Listening
from .prometheus import ServerMetrics
from .record import Recorder
from .tenanted import TenantView, scoped_stats, tenancy_for

log = logging.getLogger("kvlab.serving")
ENV_KEY = "KVLAB_API_KEY"


class Server(Listening):
    """A running (or ready) ``kvlab serve``: ``url``, ``events`` (polars), ``stats()``, ``results``
    (``kv.Result`` per finished request), ``store``, ``on_result(callback)``, ``metrics`` (what
    ``GET /metrics`` answers: kvlab.serving.prometheus); ``stop()`` or use
    it as a context manager. Made by :func:`serve`."""

    keying = "prompt+output"  # mlx-lm caches prompt + output when a request finishes

    def __init__(self, model="tiny", store="radix", *, dtype: str | None = None, budget=None,
                 host: str = "127.0.0.1", port: int = 0, record=None, record_text: bool = False, normalise: bool = False,
                 api_key: str | None = None, block_size: int = 16, max_size: int = 10,
                 max_tokens: int = 512, decode_concurrency: int = 32, prompt_concurrency: int = 8,
                 disk=None, disk_budget=None, checkpoints="segment_ends", kv_events: str | None = None,
                 api_keys=None, admin_key: str | None = None, tenant_secret=None, public_prefix=(), press=None):
        from ..checkpoints import parse_policy
        from ..loader import load
        from ..models.loading import Model

        parse_policy(checkpoints)  # a bad spec fails before a model is loaded

        if isinstance(model, Model) and dtype not in (None, model.dtype):
            raise KvlabError(f"the model passed runs in {model.dtype}, not the dtype={dtype!r} asked for: "
                             f"pass its name or folder to load it in {dtype}, or load it so yourself")
        self.model = model if isinstance(model, Model) else load(model, dtype=dtype)
        self.listener = Listener(host, port, "kvlab serve", log)
        self.normalise, self.record_text = bool(normalise), bool(record_text)
        # normalise=True: kv.DEFAULT_RULES; a sequence of kv Rules: those rules instead
        self.normalise_rules = None if isinstance(normalise, bool) else tuple(normalise)
        self.api_key = api_key if api_key is not None else (os.environ.get(ENV_KEY) or None
                                                            if api_keys is None else None)
        self.tenancy = tenancy_for(self.model, api_key=self.api_key, api_keys=api_keys, admin_key=admin_key,
                                   secret=tenant_secret, public_prefix=public_prefix)
        budget_bytes = None if budget is None else parse_bytes(budget)
        self.events_log = ServerEvents()
        if disk is not None:  # the named RAM store in front of a DiskStore at disk (survives restarts)
            from ..stores import make_store

            store = make_store("tiered", ram=store, budget_bytes=budget_bytes, block_size=block_size,
                               disk_path=disk, model=self.model,
                               disk_budget_bytes=None if disk_budget is None else parse_bytes(disk_budget))
            budget_bytes = None
        self.press = None if press is None else presses.parse(press)
        self.store_name, self.adapter = self._adapter(store, budget_bytes, block_size, max_size)
        self.budget_bytes = self.adapter.budget_bytes
        self.checkpoints = ServedCheckpoints(checkpoints, self.model, self.adapter.store)
        self.recorder = Recorder(record, record_text=record_text, block_size=block_size) if record else None
        meta = {"store": self.store_name, "budget_bytes": self.budget_bytes, "model": self.model.name,
                "fingerprint": self.model.fingerprint}
        self.ledger = Ledger(self.adapter, self.events_log, self.model, recorder=self.recorder, meta=meta)
        self.ledger.owner = self
        # what cache diagnostics compare with: each answered request under its response id
        self.diagnostics = ServedDiagnostics(self.model, self.store_name, store=self.adapter.store)
        self.diagnostics.tenant_of = self.ledger.tenant_of.get
        self._limits = dict(max_tokens=max_tokens, decode_concurrency=decode_concurrency,
                            prompt_concurrency=prompt_concurrency, prompt_cache_size=max_size)
        self.connections: set = set()
        self._conn_lock = threading.Lock()  # the handler registers its connections under it
        self.generator = None
        self._done = threading.Event()  # stopped, or generation failed for good
        self.failure = None  # the GenerationError that ended generation for good
        self.metrics = ServerMetrics(self)  # GET /metrics (kvlab.serving.prometheus)
        self.kv_events = None  # vLLM-format KV events of the store (kvlab.serving.kv_publisher)
        if kv_events is not None:
            from .kv_publisher import KVEventPublisher

            self.kv_events = KVEventPublisher(kv_events, self.adapter.store, block_size)
            self.adapter.listeners.append(self.kv_events.on_drain)

    def _adapter(self, store, budget_bytes, block_size, max_size):
        """The store behind the reuse core: by name exactly what ``kv.make_store(name)`` builds."""
        from ..stores import make_store

        if store is None or isinstance(store, str):
            name = store or "none"
            obj = make_store(name, budget_bytes=budget_bytes, block_size=block_size, max_size=max_size)
            return name, StoreAdapter(obj, self.model, self.events_log, self.tenancy, press=self.press)
        if budget_bytes is not None:
            raise KvlabError("budget= applies to a store made by name; a store object keeps its own "
                             "budget_bytes")
        return store.name, StoreAdapter(store, self.model, self.events_log, self.tenancy, press=self.press)

    # -- running ----------------------------------------------------------------------------------
    def start(self) -> "Server":
        """Start serving in background threads; returns self once the port is bound."""
        if self.listener.httpd is not None:
            return self
        args = cli_args(self.model, prompt_cache_bytes=None, **self._limits)
        args.allowed_origins = []  # no CORS: a web page must not drive a local server
        provider = KvlabModelProvider(args, self.model, sequential=self.press is not None)
        self.generator = KvlabResponseGenerator(provider, self.adapter, self.ledger, self.events_log,
                                                on_fatal=self._fatal, checkpoints=self.checkpoints)
        handler, rg, fp = bind_handler(self), self.generator, get_system_fingerprint()
        try:
            self.listener.listen(lambda *a, **k: handler(rg, *a, system_fingerprint=fp, **k),
                                 exposed="" if self.tenancy.required else "; set --api-key or $KVLAB_API_KEY")
        except KvlabError:
            self.generator.stop_and_join()
            raise
        return self

    def stop(self) -> None:
        """Stop accepting, end mlx-lm's generation thread, close open connections, join every
        thread and free the port. Finished requests are already recorded. Idempotent."""
        if not self.listener.shutdown():
            return
        self._done.set()
        self.generator.stop_and_join()
        with self._conn_lock:
            conns = list(self.connections)
        self.listener.close(conns)
        if self.adapter.store is not None:
            self.adapter.store.flush()  # a disk tier keeps what RAM still holds, for the next start
        self.ledger.close()
        if self.recorder is not None:
            self.recorder.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def wait(self) -> None:
        """Block until :meth:`stop` is called or generation fails for good (``failure`` says why;
        the CLI's foreground mode then stops and exits non-zero)."""
        self._done.wait()

    def _fatal(self, error) -> None:
        log.error("kvlab serve: %s", error)
        self.failure = error
        self._done.set()

    # -- reading ----------------------------------------------------------------------------------
    @property
    def store(self):
        """The kvlab store behind the adapter."""
        return self.adapter.store

    @property
    def events(self):
        """Every event so far (polars): lookup, hit/miss, offer (mlx-lm's insert with its segment
        type), insert, evict, block_stored/removed, arrive, first_token, finish, error.

        Each read is a new snapshot: read it once and filter that (two reads may differ while
        requests run). Promise: once a response has ended (a plain body received whole, a
        stream's last event received), every row of its request is in it (arrive through the
        insert of its prompt + output, after which mlx-lm ends the response), and its Result is
        in ``results``. A request still running, or another client's, may add rows at any time.

        Example:
            >>> client.chat.completions.create(...)          # the response has ended
            >>> ev = server.events                           # one read
            >>> ev.filter(ev["event"] == "insert")
        """
        return self.events_log.frame()

    @property
    def results(self) -> list:
        return self.ledger.finished()

    def requests(self, since: int = 0) -> list[dict]:
        """One row per finished request from number ``since`` on (what ``GET /kvlab/requests``
        answers): its ids, API, prompt / reused / missed tokens, miss reasons and TTFT."""
        return self.ledger.rows_since(since)

    def on_result(self, callback) -> None:
        """Call ``callback(server, result)`` after every finished request, on a listener thread."""
        self.ledger.on_result(callback)

    def tenant(self, name: str) -> TenantView:
        """What tenant ``name`` may see of this server (its results, event rows, stats and
        ``on_result``): ``kv.Inspector(server.tenant("alice"))`` is that tenant's feed.

        Example:
            >>> server.tenant("alice").stats()["requests"]
        """
        return TenantView(self, name)

    def stats(self, caller=None) -> dict:
        """Both hit rates (named), the store's bytes and entries, the adapter's counters; for a
        non-admin ``caller`` (kvlab.tenants.Caller) its tenant's requests and the server's settings."""
        if caller is not None and not caller.admin:
            return scoped_stats(self, caller)
        a = self.adapter
        return {**self.ledger.stats(), "running": len(self.ledger.inflight), "store": self.store_name,
                "budget_bytes": self.budget_bytes, "checkpoints": self.checkpoints.spec, "bytes": a.nbytes, "entries": len(a),
                "peak_bytes": a.peak_bytes, "lookups": a.lookups, "hits": a.hits,
                "adapter_reused_tokens": a.reused_tokens, "adapter_errors": a.errors,
                "by_type": a.stats_by_type(), "step": self.events_log.step,
                "events": self.events_log.next_seq, "normalise": self.normalise,
                "model": self.model.name, "url": self.url,
                "batching": self._batching(), "press": None if self.press is None else self.press.key,
                "generation_restarts": self.generator.kv_restarts if self.generator else 0,
                "failure": None if self.failure is None else str(self.failure),
                "kv_events": None if self.kv_events is None else self.kv_events.info()}

    def _batching(self) -> str:
        if self.model.kind == "vlm":
            return "one request at a time (VLM)"
        if self.press is not None:
            return (f"one request at a time (press {self.press.key}: a compressed cache has no merge, so "
                    "mlx-lm's BatchGenerator cannot batch it; each prompt's context is compressed after "
                    "its own prefill)")
        return "continuous"

    def invariants(self) -> dict:
        """The store's invariants (see StoreAdapter.invariants) plus no request left running."""
        inv = self.adapter.invariants()
        running = self.ledger.inflight
        return {**inv, "running": running, "ok": inv["ok"] and not running}

    def __repr__(self) -> str:
        s = self.ledger.stats()
        return (f"Server({self.url} {self.listener.state}, {self.model.name}, store={self.store_name}, "
                f"{s['requests']} requests, token hit {s['token_hit_rate']:.1%})")

    def _repr_html_(self) -> str:
        s = self.stats()
        budget = fmt_bytes(s["budget_bytes"]) if s["budget_bytes"] else "unbounded"
        rows = [("url", self.url), ("store", self.store_name), ("budget", budget),
                ("requests", s["requests"]), ("token hit rate", f"{s['token_hit_rate']:.1%}"),
                ("request hit rate", f"{s['request_hit_rate']:.1%}"), ("bytes", fmt_bytes(s["bytes"])),
                ("entries", s["entries"]), ("batch steps", s["step"])]
        return summary_html("kvlab Server", body=table_html(None, rows))


def serve(model="tiny", store="radix", **kwargs) -> Server:
    """A :class:`Server` for ``model`` (a name ``kv.load`` accepts, a folder, ``tiny-vlm`` or an
    mlx-vlm folder (a VLM: requests with images, served one at a time), or a loaded model)
    with ``store`` (``radix``, ``paged``, ``system``, ``mlx-lru``, ``none`` or a store object),
    started; use it as a context manager so it stops (threads joined, port freed).

    Keywords: ``dtype`` (None: the stored dtype), ``budget`` ("1GiB" or bytes), ``host``, ``port`` (0: free),
    ``record`` (JSONL path), ``record_text``, ``normalise`` (True: ``kv.DEFAULT_RULES``; or a
    sequence of normalisation Rules), ``api_key``, ``block_size`` (paged store and recorded kvlab
    hash ids), ``max_size`` (mlx-lru entries), ``max_tokens`` (default per request),
    ``decode_concurrency``, ``prompt_concurrency``, ``checkpoints`` (where prefill stops to
    snapshot: a ``kvlab.checkpoints`` spec; default ``segment_ends``, mlx-lm's), ``kv_events`` (a ZMQ
    address such as ``tcp://127.0.0.1:0``: the store published as vLLM KV events,
    kvlab.serving.kv_publisher), ``press`` (``"knorm:0.5"`` or a ``kv.press(...)``: each prompt's
    context compressed, stored whole, requests served one at a time: ``kvlab.compressing``).

    Example:
        >>> with kv.serve("tiny", "paged", budget="64MiB") as server:
        ...     server.url
        'http://127.0.0.1:...'
    """
    return Server(model, store, **kwargs).start()
