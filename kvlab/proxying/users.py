"""The proxy's users: who a request comes from, what it carries upstream, and what it may read.

``kvlab proxy --users FILE``: one ``KEY USER [UPSTREAM_CREDENTIAL]`` line per key (kvlab.tenants'
keys-file rules: comments, several keys per user, a bad line or a repeated key named by its line).
A request must then present a user's key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``,
401 otherwise); the key never goes upstream: the user's upstream credential replaces it in the
header the client used (none: the request goes upstream without one). ``--admin-key`` names the
operator, who reads every user's rows.

With ``--cache-salt`` (for upstreams that take vLLM's field: vLLM, kvlab serve) the proxy injects
each user's salt into every JSON request body's ``cache_salt``: the user's keyed hash (the secret:
kvlab.tenants.secret), and a client's own ``cache_salt`` only subdivides it. The recording then
hashes each user's blocks apart, as the upstream caches them. Without users nothing changes: the
proxy forwards every header as it came.

Example:
    >>> users = ProxyUsers({"ka": ("alice", "sk-alice"), "kb": "bob"}, cache_salt=True, secret=tmp / "s")
    >>> caller = users.caller("ka"); users.headers({"Authorization": "Bearer ka"}, caller)
    {'Authorization': 'Bearer sk-alice'}
"""

from __future__ import annotations

import json
import os

from ..errors import RequestError, TenantError
from ..keys import CacheKey
from ..primitives.display import summary_html
from ..tenants import KeyRing, Salter, client_salt, load_secret, parse_keys, read_keys
from .diagnosing import json_object

AUTH_HEADERS = ("authorization", "x-api-key")


class ProxyUsers:
    """Users, their upstream credentials and salts (module docstring). ``users``: a file path or
    ``{key: user}`` / ``{key: (user, upstream credential)}``; None: no users (as before)."""

    def __init__(self, users=None, *, admin_key: str | None = None, cache_salt: bool = False, secret=None):
        entries = _entries(users) if users is not None else ()
        if (admin_key or cache_salt) and not entries:
            raise TenantError("--admin-key and --cache-salt need --users (who is calling decides both)")
        self.keyring = KeyRing(entries, admin_key=admin_key) if entries else KeyRing.open()
        self.credentials: dict[str, str] = {}
        first: dict[str, int] = {}
        for e in entries:
            cred = e.extra[0] if e.extra else None
            if e.name in self.credentials and self.credentials[e.name] != cred:
                raise TenantError(f"users line {e.line}: user {e.name!r} was given another upstream "
                                  f"credential on line {first[e.name]}; one credential a user")
            self.credentials.setdefault(e.name, cred)
            first.setdefault(e.name, e.line)
        self.inject = bool(cache_salt)
        self.salter = Salter(load_secret(secret) if self.inject else (lambda: load_secret(secret)))

    @property
    def active(self) -> bool:
        """Whether requests must present a user's key."""
        return self.keyring.required

    def caller(self, given: str | None):
        return self.keyring.identify(given)

    def headers(self, headers: dict, caller) -> dict:
        """``headers`` as they go upstream for ``caller``: its key replaced by its credential."""
        if not self.active:
            return headers
        out = {k: v for k, v in headers.items() if k.lower() not in AUTH_HEADERS}
        cred = self.credentials.get(caller.tenant)
        if cred is not None:
            used = {k.lower() for k in headers}
            if "x-api-key" in used:
                out["x-api-key"] = cred
            if "authorization" in used or "x-api-key" not in used:
                out["Authorization"] = f"Bearer {cred}"
        return out

    def salt(self, caller, client: str | None = None) -> str | None:
        """The ``cache_salt`` injected for ``caller`` (None when not injecting)."""
        if not self.inject:
            return None
        return self.salter.namespace(caller, client).salt

    def body(self, raw: bytes, caller) -> bytes:
        """A JSON object body with ``caller``'s salt as its ``cache_salt``; any other body as it
        came (the upstream says what is wrong with it). RequestError (400) for a client's
        ``cache_salt`` that is not a non-empty string."""
        body = json_object(raw) if self.inject and raw else None
        if body is None:
            return raw
        body["cache_salt"] = self.salt(caller, client_salt(body))
        return json.dumps(body).encode()

    def key(self, ids, caller) -> CacheKey | None:
        """The key a recording hashes ``ids`` with: salted as the upstream caches them."""
        salt = self.salt(caller) if caller is not None else None
        return CacheKey(tuple(ids), (), salt) if salt is not None and ids is not None else None

    def __repr__(self) -> str:
        if not self.active:
            return "ProxyUsers(none: headers pass through)"
        return f"ProxyUsers({self.keyring!r}{', cache_salt injected' if self.inject else ''})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def _entries(users):
    if isinstance(users, dict):
        lines = []
        for key, who in users.items():
            user, cred = (who if isinstance(who, (tuple, list)) else (who, None))
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise TenantError("every user key must be a non-empty string without spaces")
            lines.append(f"{key} {user}" + (f" {cred}" if cred else ""))
        return parse_keys("\n".join(lines), source="users", extra=1)
    return read_keys(os.fspath(users), extra=1)


__all__ = ["AUTH_HEADERS", "ProxyUsers", "RequestError"]
