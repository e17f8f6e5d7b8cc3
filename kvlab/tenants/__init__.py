"""kvlab.tenants: identity -> tenant -> salt at a server's door, and what a tenant may see.

- keyring: keys files (``KEY TENANT`` per line), constant-time key lookup, ``Caller``;
- secret: the persisted server secret salts are keyed with;
- salts: tenant -> salt, a client's ``cache_salt`` inside its tenant, public prefixes, the key;
- door: ``Tenancy``, the three of them as a server holds them.

Example:
    >>> door = Tenancy.configure(api_keys="keys.txt", admin_key="root")
    >>> door.caller("ka")
    Caller('alice')
"""

from .door import Tenancy
from .keyring import ADMIN, DEFAULT, Caller, KeyEntry, KeyRing, parse_keys, presented_key, read_keys
from .salts import SALT_MARK, Namespace, PublicPrefixes, Salter, client_salt, key_of
from .secret import default_path, load_secret

__all__ = ["ADMIN", "DEFAULT", "SALT_MARK", "Caller", "KeyEntry", "KeyRing", "Namespace", "PublicPrefixes",
           "Salter", "Tenancy", "client_salt", "default_path", "key_of", "load_secret", "parse_keys",
           "presented_key", "read_keys"]
