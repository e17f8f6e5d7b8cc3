"""No store ever serves one tenant KV that only another tenant inserted (issue 33), whatever the
token ids, whichever tenants, with or without a public prefix: a hypothesis property over the keys
``kvlab.tenants`` builds (the reuse core's keys) and every store with synthetic snapshots (no model).

The property: a lookup by tenant T that matches m tokens of ``ids`` is explained by T's own inserts
(m <= the longest common prefix of ``ids`` with something T inserted) or by the public prefix
(m <= how many leading ids are public). Mutants caught: a tenant's salt dropped from its key (every
store then serves B what A inserted); the salt starting where a request leaves the public prefix
instead of at its first token (B is served A's tokens up to where A left it); a request still
inside a public prefix keyed salted (the prefix property below fails)."""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab as kv
from kvlab.primitives.tokens import common_prefix_len, from_ids
from kvlab.stores import make_store
from kvlab.tenants import Namespace, PublicPrefixes, Salter, key_of

from test_store_budget import synthetic

SALTER = Salter(b"s" * 32)
SPACES = {t: Namespace(t, SALTER.tenant_salt(t)) for t in ("alice", "bob")}
PUBLIC = (0, 1, 2, 0, 1)
STORES = ("radix", "shared-radix", "paged", "mlx-lru", "disk")

tail_st = st.lists(st.integers(0, 2), min_size=0, max_size=12).map(tuple)
# random ids, and ids that follow the public prefix for 0..all of its tokens before their own
ids_st = st.one_of(tail_st, st.builds(lambda k, t: PUBLIC[:k] + t, st.integers(1, len(PUBLIC)), tail_st)
                   ).filter(lambda ids: len(ids) >= 2)
ops_st = st.lists(st.tuples(st.sampled_from(("alice", "bob")), ids_st), min_size=1, max_size=6)


def store_of(name, tmp):
    if name == "disk":
        return kv.DiskStore(tmp / f"d{len(list(tmp.iterdir()))}", model="f" * 64)
    return make_store(name, block_size=2)


def public_part(ids, public: PublicPrefixes) -> int:
    """The oracle: all of a declared prefix if ``ids`` agree with it as far as both go, else 0."""
    return max((len(p) for p in public.prefixes if ids[:len(p)] == p[:len(ids)]), default=0)


def check(store, ops, public: PublicPrefixes):
    own: dict[str, list[tuple]] = {"alice": [], "bob": []}
    for tenant, ids in ops:
        toks = from_ids(list(ids))
        for who in ("alice", "bob"):  # both tenants look the request's ids up
            m = store.lookup(key_of(toks, SPACES[who], public), toks, limit=len(ids) - 1).tokens
            mine = max((common_prefix_len(ids, o) for o in own[who]), default=0)
            assert m <= max(mine, public_part(ids, public)), (who, ids, m, own)
        store.insert(key_of(toks, SPACES[tenant], public), toks, synthetic(ids, fingerprint="f" * 64))
        own[tenant].append(ids)


@pytest.mark.parametrize("name", STORES)
@pytest.mark.parametrize("public", [(), PUBLIC], ids=["no-public", "public"])
def test_no_store_reuses_across_tenants(name, public, tmp_path):
    @settings(max_examples=40, deadline=None, database=None)
    @given(ops=ops_st)
    def run(ops):
        check(store_of(name, tmp_path), ops, PublicPrefixes([public] if public else []))

    run()


@given(ids=ids_st, n=st.integers(1, 14))
@settings(max_examples=200, deadline=None, database=None)
def test_a_prefix_of_a_request_keys_as_the_request_does(ids, n):
    """key(ids)[:n] == key(ids[:n]): a store finds a tenant's shorter entry from its longer
    request. The one exception: a request that leaves a public prefix before its end is salted
    from its first token (where it left would tell something of it), while its prefixes still
    inside the public prefix are public."""
    public = PublicPrefixes([PUBLIC])
    n = min(n, len(ids))
    whole = key_of(from_ids(list(ids)), SPACES["alice"], public)
    part = key_of(from_ids(list(ids[:n])), SPACES["alice"], public)
    if public_part(ids, public) == 0 and public_part(ids[:n], public) > 0:
        assert part.symbols() == ids[:n] and whole.salt is not None
    else:
        assert whole.prefix(n).symbols() == part.symbols()
