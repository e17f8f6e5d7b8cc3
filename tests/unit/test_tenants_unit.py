"""kvlab.tenants without a model: keys files (bad lines named by line), constant-time lookup, the
persisted secret, salts, a client's cache_salt, public prefixes.

Mutants caught (each checked by breaking the code): a duplicate key accepted (the later line
wins: one key, two tenants); the lookup stopping at the first match (its time then tells the
key's position); the secret file rewritten when it exists (a restart orphans every salted entry
on disk); a client's cache_salt used as the salt itself (a client could name another tenant's);
a non-string cache_salt accepted."""

import hashlib
import hmac
import threading

import pytest

from kvlab.errors import RequestError, TenantError
from kvlab.tenants import (ADMIN, Caller, KeyRing, Namespace, PublicPrefixes, Salter, Tenancy,
                           client_salt, key_of, load_secret, parse_keys, read_keys)
from kvlab.keys import CacheKey
from kvlab.primitives.tokens import from_ids


def test_keys_file_pairs_comments_and_shared_tenants(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# operator's list\nka alice\n\n  kb   bob  \nkc alice\n")
    entries = read_keys(path)
    assert [(e.key, e.name, e.line) for e in entries] == [("ka", "alice", 2), ("kb", "bob", 4), ("kc", "alice", 5)]
    ring = KeyRing(entries, admin_key="root")
    assert ring.tenants == (ADMIN, "alice", "bob") and ring.isolated
    assert ring.identify("kc") == Caller("alice") and ring.identify("kb") == Caller("bob")
    assert ring.identify("root") == Caller(ADMIN, admin=True)
    assert ring.identify("kz") is None and ring.identify("") is None and ring.identify(None) is None
    assert "ka" not in repr(entries[0]) and "root" not in repr(ring)  # keys are never shown


@pytest.mark.parametrize("text, line, what", [
    ("ka alice\nkb\n", 2, "expected KEY NAME"),
    ("ka alice\nkb bob extra\n", 2, "expected KEY NAME"),
    ("ka alice\nkb bob\nka carol\n", 3, "already given on line 1"),
    ("ka al*ice\n", 1, "may only hold"),
])
def test_bad_keys_files_name_the_line(text, line, what):
    with pytest.raises(TenantError, match=f"keys.txt:{line}: .*{what}"):
        parse_keys(text, source="keys.txt")


def test_other_bad_settings(tmp_path):
    with pytest.raises(TenantError, match="no keys"):
        parse_keys("# nothing\n")
    with pytest.raises(TenantError, match="also a tenant's key"):
        KeyRing(parse_keys("ka alice\n"), admin_key="ka")
    with pytest.raises(TenantError, match="either one api_key"):
        Tenancy.configure(api_key="k", api_keys={"a": "b"})
    with pytest.raises(TenantError, match="admin key alone"):
        Tenancy.configure(admin_key="root")
    with pytest.raises(TenantError, match="cannot read the keys file"):
        read_keys("/nonexistent/keys.txt")
    bad = tmp_path / "secret"
    bad.write_text("not a secret\n")
    with pytest.raises(TenantError, match="not 64 hex digits"):  # at start, not on a first request
        Tenancy.configure(api_keys={"ka": "alice"}, secret=bad)


def test_lookup_compares_every_key_whatever_matches(monkeypatch):
    ring = KeyRing(parse_keys("\n".join(f"k{i} t{i}" for i in range(6))), admin_key="root")
    calls, real = [], hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr("kvlab.tenants.keyring.hmac.compare_digest", counting)
    for given in ("k0", "k5", "root", "wrong", "a-much-longer-wrong-key"):
        calls.clear()
        ring.identify(given)
        # every key compared, always as 32-byte digests: neither position nor length shows
        assert calls == [(32, 32)] * 7, given


def test_one_key_or_none_is_one_unsalted_tenant_that_sees_all(tmp_path):
    lone = Tenancy.configure(api_key="k", secret=tmp_path / "s")
    caller = lone.caller("k")
    assert caller.admin and not caller.salted and not lone.isolated and lone.caller("x") is None
    assert Tenancy.configure().caller(None) == caller  # no key at all: anyone
    assert not (tmp_path / "s").exists()  # no salted tenant: no secret read or made
    with_admin = Tenancy.configure(api_key="k", admin_key="root", secret=tmp_path / "s")
    assert (tmp_path / "s").exists()  # salted tenants: the secret is read (made) at start
    assert with_admin.isolated and not with_admin.caller("k").admin and with_admin.caller("root").admin


def test_secret_is_created_once_privately_and_kept(tmp_path):
    path = tmp_path / "deep" / "secret"
    got = []
    threads = [threading.Thread(target=lambda: got.append(load_secret(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got[0]) == 32  # eight creators at once agree on one secret
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_secret(path) == got[0]
    assert not [p for p in path.parent.iterdir() if p.name != "secret"]  # no temporary left
    path.write_text("not hex\n")
    with pytest.raises(TenantError, match="not 64 hex digits"):
        load_secret(path)
    path.write_text("ab" * 8 + "\n")
    with pytest.raises(TenantError, match="holds 8 bytes"):
        load_secret(path)


def test_salts_are_keyed_per_tenant_and_client_salts_stay_inside():
    s, other = Salter(b"a" * 32), Salter(b"b" * 32)
    alice, bob = Caller("alice"), Caller("bob")
    assert s.tenant_salt("alice") == s.tenant_salt("alice") != s.tenant_salt("bob")
    assert s.tenant_salt("alice") != other.tenant_salt("alice")  # keyed by the secret
    expected = "t:" + hmac.new(b"a" * 32, b"tenant\0alice", hashlib.sha256).hexdigest()[:32]
    assert s.tenant_salt("alice") == expected
    a_x, b_x = s.namespace(alice, "x"), s.namespace(bob, "x")
    assert a_x.salt.startswith(s.tenant_salt("alice") + "/") and a_x.salt != b_x.salt
    assert s.namespace(alice, "x").salt != s.namespace(alice, "y").salt != s.namespace(alice).salt
    # a client naming another tenant's salt as its cache_salt gets a salt inside its own tenant
    assert s.namespace(bob, s.tenant_salt("alice")).salt != s.namespace(alice).salt
    lone = Caller("*default", admin=True, salted=False)
    assert s.namespace(lone).salt is None and s.namespace(lone, "x").salt.startswith("u:/")


def test_client_salt_must_be_a_nonempty_string():
    assert client_salt({"cache_salt": "team"}) == "team" and client_salt({}) is None
    assert client_salt({"cache_salt": None}) is None and client_salt(None) is None
    for bad in (5, ["a"], {"a": 1}, "", True):
        with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
            client_salt({"cache_salt": bad})


def test_key_of_salts_after_a_public_prefix():
    toks = from_ids(list(range(10, 30)))
    ns = Namespace("alice", "t:ab")
    assert key_of(toks, None) == CacheKey(tuple(range(10, 30)))
    assert key_of(toks, ns).salt == "t:ab"
    public = PublicPrefixes([range(10, 18)])
    k = key_of(toks, ns, public)
    assert k.salt is None and k.extra_keys == ((8, 9, "tenant-salt:t:ab"),)
    sym = k.symbols()
    assert sym[:8] == tuple(range(10, 18)) and all(isinstance(x, tuple) for x in sym[8:])
    assert key_of(from_ids(list(range(10, 15))), ns, public).symbols() == tuple(range(10, 15))  # still public
    assert key_of(from_ids([10, 11, 99, 1]), ns, public).salt == "t:ab"  # left it: salted from its start
    assert public.length([10, 11]) == 8 and public.length([10, 12]) == 0 and len(PublicPrefixes()) == 0
