"""block_hashes(): chaining, extra keys, salt, determinism, bad input. No model needed."""

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.primitives.blocks import (ALGOS, NONE_HASH, SEED_MESSAGE, TokenIdError, UnknownAlgoError,
                          bench_hashing, block_hashes, shared_blocks, short)
from kvlab.errors import BlockSizeError, KvlabError
from kvlab.primitives.tokens import ImageRef, Tokens

ids_st = st.lists(st.integers(0, 2**32 - 1), max_size=120)
bs_st = st.integers(1, 9)
algo_st = st.sampled_from(sorted(ALGOS))


def test_matches_the_documented_serialisation():
    # an independent re-derivation: parent digest || token ids as little-endian uint32
    parent = hashlib.sha256(SEED_MESSAGE).digest()
    expected = []
    for start in (0, 4):
        parent = hashlib.sha256(parent + struct.pack("<4I", *range(start, start + 4))).digest()
        expected.append(parent)
    assert block_hashes(range(10), 4, algo="sha256") == expected
    assert NONE_HASH["xxh3_128"] == xxhash.xxh3_128_digest(b"kvlab.blocks.NONE_HASH.v1")
    first = xxhash.xxh3_128_digest(NONE_HASH["xxh3_128"] + np.arange(16, dtype="<u4").tobytes())
    assert block_hashes(range(16))[0] == first


@pytest.mark.parametrize("algo,size", [("xxh3_128", 16), ("xxh3_64", 8), ("sha256", 32)])
def test_only_full_blocks_are_hashed(algo, size):
    hs = block_hashes(list(range(47)), 16, algo=algo)
    assert len(hs) == 2 and all(isinstance(h, bytes) and len(h) == size for h in hs)
    assert block_hashes(range(15), 16) == [] and block_hashes([], 16) == []


def test_inputs_list_tuple_array_and_tokens_agree():
    ids = [5, 7, 151_643, 0, 3, 2**32 - 1, 9, 9]
    ref = block_hashes(ids, 4)
    assert block_hashes(tuple(ids), 4) == ref
    assert block_hashes(np.array(ids, dtype=np.int64), 4) == ref
    assert block_hashes(np.array(ids, dtype=np.uint32), 4) == ref
    assert block_hashes(Tokens(tuple(ids), ""), 4) == ref
    assert block_hashes(iter(ids), 4) == ref


@settings(max_examples=200, deadline=None)
@given(ids_st, bs_st, st.integers(0, 120), algo_st)
def test_hashes_of_a_prefix_are_a_prefix(ids, bs, cut, algo):
    full = block_hashes(ids, bs, algo=algo)
    part = block_hashes(ids[:cut], bs, algo=algo)
    assert part == full[: len(part)]
    assert len(full) == len(ids) // bs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=120), bs_st, st.data())
def test_changing_token_k_changes_exactly_the_blocks_from_k_over_bs(ids, bs, data):
    k = data.draw(st.integers(0, len(ids) - 1))
    other = list(ids)
    other[k] += 1
    a, b = block_hashes(ids, bs), block_hashes(other, bs)
    first = k // bs
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))
    assert shared_blocks(a, b) == min(first, len(a))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=4, max_size=4),
       st.lists(st.integers(0, 1000), min_size=4, max_size=4),
       st.lists(st.integers(0, 1000), min_size=4, max_size=4))
def test_same_block_after_different_prefixes_hashes_differently(p, q, block):
    # seed pitfall 9: unchained chunk hashes would match here
    if p != q:
        assert block_hashes(p + block, 4)[1] != block_hashes(q + block, 4)[1]


@settings(max_examples=100, deadline=None)
@given(ids_st, bs_st, st.text(max_size=8), algo_st)
def test_salt_changes_every_hash(ids, bs, salt, algo):
    plain, salted = block_hashes(ids, bs, algo=algo), block_hashes(ids, bs, salt=salt, algo=algo)
    assert len(plain) == len(salted)
    assert all(x != y for x, y in zip(plain, salted))
    assert block_hashes(ids, bs, salt=salt, algo=algo) == salted


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=120), bs_st, st.data())
def test_extra_keys_change_their_block_and_the_ones_after(ids, bs, data):
    n = len(ids) // bs
    if n == 0:
        return
    blk = data.draw(st.integers(0, n - 1))
    plain = block_hashes(ids, bs)
    keyed = block_hashes(ids, bs, extra_keys={blk: ("lora-a",)})
    assert keyed[:blk] == plain[:blk]
    assert all(x != y for x, y in zip(keyed[blk:], plain[blk:]))
    assert block_hashes(ids, bs, extra_keys={blk: ("lora-b",)})[blk] != keyed[blk]
    # a bare key means a one-key tuple
    assert block_hashes(ids, bs, extra_keys={blk: "lora-a"}) == keyed


def test_span_keys_attach_to_every_overlapped_block():
    ids = [7] * 64  # identical placeholder ids, as an image's tokens are
    plain = block_hashes(ids, 16)
    img_a = block_hashes(ids, 16, extra_keys=[(20, 40, "sha-of-image-a")])
    img_b = block_hashes(ids, 16, extra_keys=[(20, 40, "sha-of-image-b")])
    assert img_a[0] == plain[0] == img_b[0]
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain[1:], img_a[1:], img_b[1:]))
    # a span inside one block: that block and after; the same image at another offset differs
    one = block_hashes(ids, 16, extra_keys=[(33, 35, "k")])
    assert one[:2] == plain[:2] and one[2] != plain[2]
    assert block_hashes(ids, 16, extra_keys=[(34, 36, "k")])[2] != one[2]


def test_tokens_images_become_extra_keys():
    # seed pitfall 2: identical ids with different images must not share blocks
    ids = tuple([1] * 8 + [99] * 16 + [2] * 8)
    a = Tokens(ids, "", images=(ImageRef("aaaa", 8, 24, 0),))
    b = Tokens(ids, "", images=(ImageRef("bbbb", 8, 24, 0),))
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[3] != hb[3]
    assert ha == block_hashes(ids, 8, extra_keys=a.images)


def test_deterministic_across_processes():
    code = ("from kvlab.primitives.blocks import block_hashes\n"
            "ids = [i * 7919 % 151643 for i in range(200)]\n"
            "for algo in ('xxh3_128', 'xxh3_64', 'sha256'):\n"
            "    print(algo, ','.join(h.hex() for h in block_hashes(ids, 16, algo=algo, salt='s',"
            " extra_keys=[(20, 40, 'img'), (50, 51, ('x', 1, 2.5, None, b'b'))])))\n")
    ids = [i * 7919 % 151643 for i in range(200)]
    here = "".join(
        f"{algo} " + ",".join(h.hex() for h in block_hashes(
            ids, 16, algo=algo, salt="s",
            extra_keys=[(20, 40, "img"), (50, 51, ("x", 1, 2.5, None, b"b"))])) + "\n"
        for algo in ("xxh3_128", "xxh3_64", "sha256"))
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, check=True, cwd=os.path.dirname(__file__))
        assert out.stdout == here


@pytest.mark.parametrize("bad", [0, -16, 1.5, "16", None, True])
def test_bad_block_size(bad):
    with pytest.raises(BlockSizeError, match="positive int"):
        block_hashes([1, 2, 3], bad)


def test_unknown_algo_lists_the_known_ones():
    with pytest.raises(UnknownAlgoError) as e:
        block_hashes([1, 2, 3], algo="md5")
    assert isinstance(e.value, KvlabError)
    assert all(name in str(e.value) for name in ("xxh3_128", "xxh3_64", "sha256"))


@pytest.mark.parametrize("bad", [[1, 2.5], [1, "2"], [1, None], [-1], [2**32], "hello",
                                 np.array([1.0, 2.0]), np.array([-3, 4])])
def test_non_int_ids(bad):
    with pytest.raises(TokenIdError) as e:
        block_hashes(bad, 1)
    assert isinstance(e.value, KvlabError)


@pytest.mark.parametrize("keys", [[(5, 5, "k")], [(-1, 3, "k")], [(0, 2)], {-1: "k"},
                                  {0: object()}])
def test_bad_extra_keys(keys):
    with pytest.raises(TokenIdError):
        block_hashes(range(16), 4, extra_keys=keys)


def test_short_and_shared_blocks():
    hs = block_hashes(range(64))
    assert short(hs[0]) == hs[0].hex()[:12] and len(short(hs[0], 6)) == 6
    assert shared_blocks(hs, block_hashes([*range(40), 0])) == 2


def test_bench_hashing_reports_each_algo():
    r = bench_hashing(n_tokens=8192, block_size=16, repeats=3)
    assert set(r["algos"]) == set(ALGOS) and r["n_tokens"] == 8192
    for stats in r["algos"].values():
        assert stats["min_tokens_per_s"] <= stats["median_tokens_per_s"] <= stats["max_tokens_per_s"]
        assert stats["spread"] >= 0
    # measured ~46M tokens/s here; a loose floor so a slow CI box does not flake
    assert r["algos"]["xxh3_128"]["median_tokens_per_s"] > 2e6
    with pytest.raises(UnknownAlgoError):
        bench_hashing(algos=["crc32"])


@pytest.mark.parametrize("ids,position,value", [
    ([1, 2, 64], 2, 64), ((7, -5, 3), 1, -5), (np.array([1, 2, 3, 99]), 3, 99),
    (Tokens((0, 1, 2**31), ""), 2, 2**31)])
def test_vocab_size_rejects_ids_outside_the_vocabulary(ids, position, value):
    """Issue 9 §7: with a known vocabulary, block hashing names the first id outside it.
    Mutant caught: `>= vocab_size` written `> vocab_size` (the id 64 case passes unnoticed)."""
    with pytest.raises(TokenIdError, match=rf"position {position} holds id {value}, .*\[0, 64\)"):
        block_hashes(ids, 4, vocab_size=64)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 63), max_size=60), bs_st)
def test_vocab_size_leaves_valid_hashes_unchanged(ids, bs):
    assert block_hashes(ids, bs, vocab_size=64) == block_hashes(ids, bs)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "64"])
def test_vocab_size_must_be_a_positive_int(bad):
    with pytest.raises(TokenIdError, match="vocab_size must be a positive int"):
        block_hashes([1, 2], 2, vocab_size=bad)
