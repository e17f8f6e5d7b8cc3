"""Tenancy: identity -> tenant -> salt at a server's door, in one object the server holds.

Three ways to run, by what the operator gives:

- no key: anyone may call; one tenant, unsalted, sees everything (a local research server);
- ``api_key``: one key, one tenant, unsalted, as before tenants existed; with ``admin_key`` too,
  the admin is a second tenant (salted) and the only caller who sees the other's metadata;
- ``api_keys`` (a keys file, or ``{key: tenant}``): each tenant salted with its own salt, every
  metadata route scoped to the caller's tenant; ``admin_key`` sees everything.

A client's ``cache_salt`` subdivides its tenant in every mode (kvlab.tenants.salts).

Example:
    >>> door = Tenancy.configure(api_keys={"ka": "alice", "kb": "bob"}, secret=tmp / "secret")
    >>> caller = door.caller("ka"); ns = door.namespace(caller, None)
    >>> door.key(tokens, ns).salt == door.key(tokens, door.namespace(door.caller("kb"))).salt
    False
"""

from __future__ import annotations

import os

from ..errors import TenantError
from ..primitives.display import summary_html, table_html
from .keyring import Caller, KeyRing
from .salts import Namespace, PublicPrefixes, Salter, key_of
from .secret import load_secret


class Tenancy:
    """A server's keys, salts and public prefixes (module docstring)."""

    def __init__(self, keyring: KeyRing, salter: Salter, public: PublicPrefixes | None = None):
        self.keyring, self.salter = keyring, salter
        self.public = public or PublicPrefixes()

    @classmethod
    def configure(cls, *, api_key: str | None = None, api_keys=None, admin_key: str | None = None,
                  secret=None, public=()) -> "Tenancy":
        """The tenancy for a server's settings: ``api_keys`` a keys file path or ``{key: tenant}``
        (not with ``api_key``), ``secret`` the secret's path (default under $KVLAB_HOME, read
        only once a salt is needed), ``public`` token-id prefixes shared by every tenant."""
        if api_keys is not None and api_key:
            raise TenantError("give either one api_key (one tenant) or api_keys (a keys file of "
                              "tenants), not both")
        if api_keys is not None:
            ring = (KeyRing.from_mapping(api_keys, admin_key=admin_key) if isinstance(api_keys, dict)
                    else KeyRing.from_file(os.fspath(api_keys), admin_key=admin_key))
        elif api_key:
            ring = KeyRing.single_key(api_key, admin_key=admin_key)
        elif admin_key:
            raise TenantError("an admin key alone leaves every other caller unauthenticated: give "
                              "api_key or api_keys too")
        else:
            ring = KeyRing.open()
        # a server with salted tenants reads (or creates) its secret now: a bad one fails at start
        salted = api_keys is not None or admin_key is not None
        salter = Salter(load_secret(secret) if salted else (lambda: load_secret(secret)))
        return cls(ring, salter, PublicPrefixes(public))

    @property
    def required(self) -> bool:
        return self.keyring.required

    @property
    def isolated(self) -> bool:
        """More than one tenant: every metadata route is scoped to the caller's."""
        return self.keyring.isolated

    def caller(self, given: str | None) -> Caller | None:
        return self.keyring.identify(given)

    def namespace(self, caller: Caller, client_salt: str | None = None) -> Namespace:
        return self.salter.namespace(caller, client_salt)

    def key(self, tokens, ns: Namespace | None, **kw):
        """The cache key of ``tokens`` in ``ns`` (kvlab.tenants.salts.key_of)."""
        return key_of(tokens, ns, self.public, **kw)

    def __repr__(self) -> str:
        public = f", {len(self.public)} public prefixes" if len(self.public) else ""
        return f"Tenancy({self.keyring!r}{public})"

    def _repr_html_(self) -> str:
        rows = [("keys", repr(self.keyring)), ("tenants", ", ".join(self.keyring.tenants) or "one"),
                ("isolated", self.isolated), ("public prefixes", repr(self.public))]
        return summary_html("Tenancy", body=table_html(None, rows))
