"""A served model's tenancy (kvlab.tenants) and what one tenant may see of a running server.

- ``tenancy_for``: the server's ``Tenancy`` from its settings, public system prompts rendered by
  the model's chat template into the token ids every tenant shares;
- ``scoped_stats``: ``/kvlab/stats`` for a tenant: its own requests' counts and hit rates and the
  server's settings, never the store's bytes, entries or counters (they move with other tenants'
  traffic);
- ``TenantView``: a tenant's results, event rows, stats and ``on_result``, the shape
  ``kv.Inspector`` reads (its store: None; the shared store's tree is the operator's view).

Example:
    >>> kv.Inspector(server.tenant("alice"))
"""

from __future__ import annotations

from ..errors import KvlabError
from ..primitives.boundary import split_at_boundary
from ..primitives.display import summary_html
from ..tenants import Caller, Tenancy

SETTINGS = ("store", "budget_bytes", "checkpoints", "normalise", "model", "url", "batching")


def public_ids(model, text: str) -> tuple[int, ...]:
    """The token ids of ``text`` as a system prompt, as the model's chat template renders it at
    the start of a conversation (through the end of the system message).

    Example:
        >>> len(public_ids(kv.load("tiny"), "You are terse.")) > 0
        True
    """
    if not isinstance(text, str) or not text.strip():
        raise KvlabError(f"a public prefix is the text of a system prompt, got {text!r:.40}")
    toks = model.tokenise([{"role": "system", "content": text}, {"role": "user", "content": "."}])
    split = split_at_boundary(toks, at="system")
    if not split.index:
        raise KvlabError("the model's chat template renders no system message for a public prefix")
    return tuple(toks.ids[:split.index])


def tenancy_for(model, *, api_key=None, api_keys=None, admin_key=None, secret=None, public_prefix=()) -> Tenancy:
    """The ``Tenancy`` of a server of ``model`` (kvlab.tenants.Tenancy.configure); each public
    prefix a system prompt's text (or token ids)."""
    texts = [public_prefix] if isinstance(public_prefix, str) else list(public_prefix or ())
    prefixes = [public_ids(model, p) if isinstance(p, str) else tuple(int(t) for t in p) for p in texts]
    return Tenancy.configure(api_key=api_key, api_keys=api_keys, admin_key=admin_key, secret=secret,
                             public=prefixes)


def scoped_stats(server, caller: Caller) -> dict:
    """``/kvlab/stats`` as a non-admin ``caller`` reads it (module docstring)."""
    full = {"store": server.store_name, "budget_bytes": server.budget_bytes, "checkpoints": server.checkpoints.spec,
            "normalise": server.normalise, "model": server.model.name, "url": server.url,
            "batching": "one request at a time (VLM)" if server.model.kind == "vlm" else "continuous"}
    return {**server.ledger.stats(caller), "tenant": caller.tenant, **{k: full[k] for k in SETTINGS}}


class TenantView:
    """What tenant ``name`` sees of ``server`` (module docstring)."""

    def __init__(self, server, name: str):
        if name not in server.tenancy.keyring.tenants and not name.startswith("*"):
            raise KvlabError(f"no tenant {name!r} on this server; its tenants: "
                             f"{', '.join(server.tenancy.keyring.tenants) or 'none'}")
        self.server, self.name = server, name
        self.caller = Caller(name)
        self.store = None  # shared by every tenant: its tree and blocks are the operator's view
        self.model = server.model

    @property
    def results(self) -> list:
        return self.server.ledger.finished(self.caller)

    @property
    def events(self):
        import polars as pl

        from .events import EVENT_SCHEMA

        return pl.DataFrame(self.server.events_log.since(0, self.caller), schema=EVENT_SCHEMA)

    def stats(self) -> dict:
        return scoped_stats(self.server, self.caller)

    def requests(self, since: int = 0) -> list[dict]:
        return self.server.ledger.rows_since(since, self.caller)

    def on_result(self, callback) -> None:
        self.server.ledger.on_result(callback, self.caller)

    def __repr__(self) -> str:
        s = self.stats()
        return f"TenantView({self.name!r}: {s['requests']} requests, token hit {s['token_hit_rate']:.1%})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
