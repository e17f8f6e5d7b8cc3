"""Who is calling: keys files and the KeyRing that maps a presented key to a ``Caller``.

A keys file holds one ``KEY NAME`` pair per line (``kvlab serve --api-keys``: NAME is a tenant;
``kvlab proxy --users``: NAME is a user, optionally followed by that user's upstream credential).
Blank lines and lines starting with ``#`` are skipped; several keys may name the same tenant. A
line with the wrong number of fields, a name with characters outside ``[A-Za-z0-9_.@:+-]`` or a key
given twice is a ``TenantError`` naming the file and the line: nothing is served with a keys file
that says two things.

Keys are compared in constant time: every presented key is hashed and compared with every known
key's hash by ``hmac.compare_digest``, without stopping at the first match, so neither the
position of a key in the file nor its length shows in the time an answer takes.

Example:
    >>> ring = KeyRing.from_text("ka alice\\nkb bob\\nkc alice\\n", admin_key="root")
    >>> ring.identify("kc"), ring.identify("root"), ring.identify("nope")
    (Caller('alice'), Caller('*admin', admin), None)
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import TenantError
from ..primitives.display import summary_html

NAME = re.compile(r"^[A-Za-z0-9_.@:+-]+$")
ADMIN = "*admin"      # the admin key's own tenant: no keys-file name can spell it
DEFAULT = "*default"  # the one tenant of a server with one key (or none)


@dataclass(frozen=True)
class Caller:
    """An identified caller: its ``tenant`` and whether it is the ``admin`` (sees every tenant's
    metadata). ``salted``: its requests are keyed under its tenant's salt."""

    tenant: str
    admin: bool = False
    salted: bool = True

    def sees(self, tenant: str | None) -> bool:
        """Whether this caller may read what ``tenant`` did (None: the server's own rows)."""
        return self.admin or (tenant is not None and tenant == self.tenant)

    def __repr__(self) -> str:
        return f"Caller({self.tenant!r}{', admin' if self.admin else ''})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


@dataclass(frozen=True)
class KeyEntry:
    """One line of a keys file: the key (never shown), the name, further fields, its line."""

    key: str
    name: str
    extra: tuple[str, ...] = ()
    line: int = 0

    def __repr__(self) -> str:
        return f"KeyEntry(line {self.line}: {self.name}{' + ' + str(len(self.extra)) + ' fields' if self.extra else ''})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def parse_keys(text: str, *, source: str = "<keys>", extra: int = 0) -> tuple[KeyEntry, ...]:
    """The entries of a keys file's ``text``: ``KEY NAME`` plus up to ``extra`` further fields a
    line. TenantError names ``source`` and the line of a malformed line or a repeated key.

    Example:
        >>> parse_keys("# who\\nk1 alice\\n")[0].name
        'alice'
    """
    out, first = [], {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if not 2 <= len(fields) <= 2 + extra:
            want = "KEY NAME" if not extra else f"KEY NAME and at most {extra} more field(s)"
            raise TenantError(f"{source}:{lineno}: expected {want} separated by spaces, got "
                              f"{len(fields)} field(s); one pair per line, '#' starts a comment")
        key, name = fields[0], fields[1]
        if not NAME.match(name):
            raise TenantError(f"{source}:{lineno}: name {name!r} may only hold letters, digits and "
                              "_ . @ : + -")
        if key in first:
            raise TenantError(f"{source}:{lineno}: this key was already given on line {first[key]}; "
                              "a key names one tenant: remove one of the two lines")
        first[key] = lineno
        out.append(KeyEntry(key, name, tuple(fields[2:]), lineno))
    if not out:
        raise TenantError(f"{source}: no keys (one 'KEY NAME' pair per line)")
    return tuple(out)


def read_keys(path, *, extra: int = 0) -> tuple[KeyEntry, ...]:
    """:func:`parse_keys` of the file at ``path`` (TenantError if it cannot be read).

    Example:
        >>> read_keys("keys.txt")
        (KeyEntry(line 1: alice), KeyEntry(line 2: bob))
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TenantError(f"cannot read the keys file {path}: {getattr(e, 'strerror', None) or e}") from e
    return parse_keys(text, source=str(path), extra=extra)


def presented_key(headers) -> str:
    """The key a request presents: ``x-api-key``, else ``Authorization: Bearer KEY`` ("" if none).

    Example:
        >>> presented_key({"Authorization": "Bearer sk-1"}), presented_key({})
        ('sk-1', '')
    """
    given = headers.get("x-api-key") or ""
    auth = headers.get("Authorization") or ""
    if not given and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    """Keys -> callers (module docstring). ``entries``: the keys file's; ``admin_key``: the
    operator's key (sees every tenant). ``KeyRing.single(key)`` is a server with one key (one
    unsalted tenant, which sees everything, as before tenants existed); ``KeyRing.open()`` one with
    none (anyone is that tenant)."""

    def __init__(self, entries=(), *, admin_key: str | None = None, single: bool = False):
        self.entries = tuple(entries)
        self.single = single
        if admin_key is not None and (not isinstance(admin_key, str) or not admin_key.strip()):
            raise TenantError("the admin key must be a non-empty string")
        if admin_key is not None and any(e.key == admin_key for e in self.entries):
            raise TenantError("the admin key is also a tenant's key; give the operator a key of its own")
        self.admin_key = admin_key
        # a lone key stays what it was before tenants: unsalted, and it sees everything unless an
        # admin key says who the operator is
        lone = Caller(DEFAULT, admin=admin_key is None, salted=False)
        self._known = [(_digest(e.key), lone if single else Caller(e.name)) for e in self.entries]
        if admin_key is not None:
            self._known.append((_digest(admin_key), Caller(ADMIN, admin=True)))

    @classmethod
    def from_file(cls, path, *, admin_key: str | None = None) -> "KeyRing":
        return cls(read_keys(path), admin_key=admin_key)

    @classmethod
    def from_text(cls, text: str, *, admin_key: str | None = None) -> "KeyRing":
        return cls(parse_keys(text), admin_key=admin_key)

    @classmethod
    def from_mapping(cls, keys: dict, *, admin_key: str | None = None) -> "KeyRing":
        """``{key: tenant}`` (the Python API's form of a keys file)."""
        text = "\n".join(f"{k} {v}" for k, v in keys.items())
        if any(not isinstance(k, str) or not k or any(c.isspace() for c in k) for k in keys):
            raise TenantError("every key must be a non-empty string without spaces")
        return cls(parse_keys(text, source="api_keys"), admin_key=admin_key)

    @classmethod
    def single_key(cls, key: str, *, admin_key: str | None = None) -> "KeyRing":
        return cls((KeyEntry(key, DEFAULT.lstrip("*"), (), 1),), admin_key=admin_key, single=True)

    @classmethod
    def open(cls) -> "KeyRing":
        return cls(single=True)

    @property
    def required(self) -> bool:
        """Whether a request must present a key."""
        return bool(self._known)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted({c.tenant for _, c in self._known}))

    @property
    def isolated(self) -> bool:
        """More than one tenant: metadata is scoped and each tenant's KV salted."""
        return len(self.tenants) > 1

    def identify(self, given: str | None) -> Caller | None:
        """The caller a presented key belongs to, None for an unknown or missing key (401).
        Compares with every key, in constant time (module docstring)."""
        if not self._known:
            return Caller(DEFAULT, admin=True, salted=False)
        probe = _digest(given or "")
        found = None
        for digest, caller in self._known:
            if hmac.compare_digest(probe, digest) and given:
                found = caller
        return found

    def __repr__(self) -> str:
        if not self._known:
            return "KeyRing(open: no key)"
        admin = ", admin key" if self.admin_key else ""
        return f"KeyRing({len(self.entries)} keys, {len(self.tenants)} tenants{admin})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
