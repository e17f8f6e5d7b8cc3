"""The tiny models of every cache family (``kv.load("tiny:<model_type>")``) and the conformance of
every store on them.

TOL (kvlab.experiments.conformance.TOLERANCE = 1e-4): float32 tiny models; restored KV is the KV a
cold prefill computes, so the measured differences (<= 3e-5) come only from running a prompt in two
forward passes instead of one.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import kvlab as kv
from kvlab.experiments.conformance import TOLERANCE, classify, run_cell
from kvlab.models.families import MODEL_TYPES, context_sensitivity

pytestmark = pytest.mark.model

LAYOUTS = {  # what each family's cache is, layer by layer (kvlab.models.families' table)
    "qwen3": "4 x full-attention KV",
    "gemma3_text": "2 x sliding window of 32, 2 x full-attention KV",
    "gemma4_text": "2 x sliding window of 32, 2 x full-attention KV, 2 x no cache (shared-KV or MLP-only layer)",
    "gpt_oss": "2 x sliding window of 32, 2 x full-attention KV",
    "qwen3_5": "2 x recurrent state (ArraysCache), 2 x full-attention KV",
    "mamba2": "4 x recurrent state (ArraysCache)",
    "falcon_h1": "4 x CacheList of recurrent state (ArraysCache) + full-attention KV",
    "llama4": "3 x chunked attention of 32, 1 x full-attention KV",
    "recurrent_gemma": "2 x recurrent state (ArraysCache), 1 x sliding window of 32",
}


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_each_family_has_the_cache_it_is_named_for(model_type):
    # mutant caught: a config that silently builds dense attention (a sliding_window key mlx-lm
    # ignores, a hybrid pattern of attention only) would test nothing about its family
    assert kv.load(f"tiny:{model_type}").layout.summary() == LAYOUTS[model_type]


RECURRENT = ("qwen3_5", "qwen3_next", "nemotron_h", "lfm2", "falcon_h1", "mamba2", "rwkv7", "recurrent_gemma")


@pytest.mark.parametrize("model_type", RECURRENT)
def test_recurrent_layers_remember_the_start_of_a_long_prompt(model_type):
    # mutant caught: mlx-lm's default initialisation (forgets within ~50 tokens), under which a
    # wrongly restored recurrent state would still pass verification against cold prefill
    assert context_sensitivity(kv.load(f"tiny:{model_type}")) >= 1e-2


def test_unknown_family_says_which_exist():
    with pytest.raises(kv.errors.ModelNotFoundError, match="tiny:qwen3, tiny:gemma3_text"):
        kv.load("tiny:gpt2")


def test_a_restored_cachelist_never_writes_into_its_snapshot():
    # mutant caught: restore() handing a CacheList's recurrent part the snapshot's own list
    # (mlx-lm writes ArraysCache.cache in place): the system store then served a state that a
    # previous request had run on, a logit error of 0.7
    m = kv.load("tiny:falcon_h1")
    ids = list(range(1000, 1040))
    _, cache = kv.prefill(m, ids)
    snap = kv.snapshot(cache, tokens=ids, model=m)
    before = [mx.array(a) for _, a in tree_flatten([layer.state for layer in snap.layers]) if isinstance(a, mx.array)]
    kv.prefill(m, list(range(2000, 2010)), kv.restore(snap))
    after = [a for _, a in tree_flatten([layer.state for layer in snap.layers]) if isinstance(a, mx.array)]
    assert len(after) == len(before) > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))


def test_a_pure_recurrent_snapshot_takes_its_length_from_tokens():
    # mutant caught: taking the length from the layers (recurrent layers say 0), the bug that made
    # every store reuse 0 tokens of mamba2 with no reason given
    m = kv.load("tiny:mamba2")
    ids = list(range(1000, 1030))
    _, cache = kv.prefill(m, ids)
    assert kv.snapshot(cache, tokens=ids, model=m).offset == 30
    with pytest.raises(kv.errors.SnapshotError, match="pass tokens="):
        kv.snapshot(cache, model=m)


def test_classify_names_the_two_worst_bugs():
    assert classify(10, 2e-4, "") == "wrong"
    assert classify(0, 0.0, "no system prompt cached yet") == "silent zero"
    assert classify(0, 0.0, "layer 0 (RotatingKVCache) cannot be cut back") == "refused"
    assert classify(5, TOLERANCE / 2, "") == "exact"


# Every family on the radix store over the workload that restores from the most places (branching:
# a branch reuses up to the end of an earlier user turn), and every store on one model per family.
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_family_reuses_exactly_in_the_radix_store(model_type):
    # mutants caught: a chunked cache trimmed before its chunk start (llama4 errs 6e-2..3.4), a
    # wrapped window trimmed, a recurrent state restored past where it was taken, a recurrent
    # snapshot of length 0 (silent zero)
    cell = run_cell(model_type, "radix", "branching")
    assert cell.status == "exact", cell
    assert cell.reused_tokens > 0 and cell.max_logit_diff <= TOLERANCE


@pytest.mark.parametrize("model_type,store", [("falcon_h1", "disk"), ("llama4", "mlx-lru")])
def test_cells_that_once_raised_now_reuse_exactly(model_type, store):
    # mutants caught: restore() rebuilding a CacheList through mlx-lm's setter (a disk-loaded
    # recurrent part keeps a tuple: TypeError in the model); the mlx-lm LRU wrapper snapshotting
    # the copy mlx-lm failed to cut back (its ChunkedKVCache.trim stops at the chunk start:
    # SnapshotError "tokens has 110 ids but the cache holds 232 tokens")
    # mlx-lm's LRU on llama4 reuses what shared-radix does (871) since it keeps the entries a
    # chunked cache cannot serve instead of dropping them as subsumed (it reused 568 before)
    cell = run_cell(model_type, store, "branching")
    assert cell.status == "exact", cell
    assert cell.reused_tokens == 871
