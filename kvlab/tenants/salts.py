"""Tenant -> salt, and the cache key of a tenant's request.

A salt is derived on the server, never taken from a request: ``HMAC-SHA256(secret, tenant)``
(the secret: kvlab.tenants.secret). A client's ``cache_salt`` (vLLM's field) only subdivides its
own tenant: the salt becomes ``tenant salt + "/" + HMAC(secret, tenant salt, cache_salt)``, which no
client of another tenant can produce. A tenant that is not salted (a server with one key) keeps
unsalted keys; its clients' ``cache_salt`` still subdivides it.

A public prefix (``PublicPrefixes``: token ids the operator declares public, e.g. a common
system prompt as the chat template renders it) stays shared across tenants: a key whose ids
start with one gets its salt as an extra key from the first token after it (vLLM's "salt after a
shared prefix"), so stores share the public part and nothing after it. A paged store salts the
whole block the public prefix ends in (the span joins every block it overlaps): the part of the
public prefix in that block is not shared.

Example:
    >>> salter = Salter(load_secret(tmp / "s"))
    >>> ns = salter.namespace(Caller("alice"), client_salt=None)
    >>> key_of(tokens, ns, PublicPrefixes()).salt == ns.salt
    True
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ..errors import RequestError
from ..keys import CacheKey, cache_key
from ..primitives.display import summary_html
from .keyring import Caller

SALT_MARK = "tenant-salt:"  # the extra key that salts the tokens after a public prefix


@dataclass(frozen=True)
class Namespace:
    """Where a request's KV lives: its ``tenant`` and the ``salt`` of its keys (None: unsalted)."""

    tenant: str
    salt: str | None = None

    def __repr__(self) -> str:
        return f"Namespace({self.tenant!r}{', salted' if self.salt else ''})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


class Salter:
    """Derives salts from a secret (bytes, or a zero-argument function returning them, called
    on first use so a server that never salts never creates a secret file)."""

    def __init__(self, secret):
        self._secret = secret if isinstance(secret, (bytes, bytearray)) else None
        self._load = None if self._secret is not None else secret

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            self._secret = bytes(self._load())
        return self._secret

    def _mac(self, *parts: str) -> str:
        msg = b"\0".join(p.encode("utf-8", "surrogatepass") for p in parts)
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()[:32]

    def tenant_salt(self, tenant: str) -> str:
        """The salt of ``tenant``'s keys.

        Example:
            >>> Salter(b"k" * 32).tenant_salt("alice")[:2]
            't:'
        """
        return "t:" + self._mac("tenant", tenant)

    def namespace(self, caller: Caller, client_salt: str | None = None) -> Namespace:
        """The namespace of a request by ``caller`` carrying ``client_salt`` (None: none)."""
        base = self.tenant_salt(caller.tenant) if caller.salted else None
        if client_salt is None:
            return Namespace(caller.tenant, base)
        return Namespace(caller.tenant, f"{base or 'u:'}/{self._mac('client', base or '', client_salt)}")

    def __repr__(self) -> str:
        return f"Salter(secret {'loaded' if self._secret is not None else 'not loaded yet'})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def client_salt(body) -> str | None:
    """A request body's ``cache_salt`` (vLLM's field): None when absent; RequestError (400) when
    it is not a non-empty string.

    Example:
        >>> client_salt({"cache_salt": "team-a"}), client_salt({})
        ('team-a', None)
    """
    if not isinstance(body, dict) or body.get("cache_salt") is None:
        return None
    value = body["cache_salt"]
    if not isinstance(value, str) or not value:
        raise RequestError(f"cache_salt must be a non-empty string, got {type(value).__name__} "
                           f"{value!r:.40}; it subdivides your tenant's cache (omit it to share "
                           "your tenant's)")
    return value


class PublicPrefixes:
    """Token-id prefixes the operator declares public (module docstring). ``length(ids)``: how
    many leading ids of a request are public."""

    def __init__(self, prefixes=()):
        self.prefixes = tuple(tuple(int(t) for t in p) for p in prefixes if len(p))

    def length(self, ids) -> int:
        """The longest declared prefix that ``ids`` agree with over their common length (a
        request still inside a public prefix is public so far: every prefix of a key keys alike)."""
        best = 0
        for p in self.prefixes:
            n = min(len(p), len(ids))
            if len(p) > best and tuple(ids[:n]) == p[:n]:
                best = len(p)
        return best

    def __len__(self) -> int:
        return len(self.prefixes)

    def __repr__(self) -> str:
        sizes = ", ".join(str(len(p)) for p in self.prefixes)
        return f"PublicPrefixes({len(self.prefixes)}{': ' + sizes + ' tokens' if sizes else ''})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def key_of(tokens, ns: Namespace | None, public: PublicPrefixes | None = None, *,
           extra_keys=(), image_keys: bool = True) -> CacheKey:
    """The cache key of ``tokens`` in namespace ``ns`` (None or unsalted: ``kv.cache_key``'s),
    its salt starting after a public prefix when it starts with one.

    Example:
        >>> key_of(tokens, Namespace("alice", "t:ab"), PublicPrefixes([tokens.ids[:10]])).extra_keys
        ((10, 11, 'tenant-salt:t:ab'),)
    """
    if ns is None or ns.salt is None:
        return cache_key(tokens, extra_keys=extra_keys, image_keys=image_keys)
    at = public.length(tokens.ids) if public is not None else 0
    if at == 0:
        return cache_key(tokens, extra_keys=extra_keys, salt=ns.salt, image_keys=image_keys)
    if at >= len(tokens.ids):
        return cache_key(tokens, extra_keys=extra_keys, image_keys=image_keys)
    return cache_key(tokens, extra_keys=(*extra_keys, (at, at + 1, SALT_MARK + ns.salt)), image_keys=image_keys)
