"""Quantized KV caches on the embedded SmolLM2-135M (head_dim 64; kvlab's tiny model has head_dim
16, which no mlx group size divides, so it only appears here to check the error).

Invariants and the broken implementation each catches:
- a restored quantized snapshot gives exactly (max |Δlogit| == 0.0) the logits of the live
  quantized cache, also after trim and after save/load (mutant: snapshot swaps group_size and bits);
- kv.Engine(kv_bits=...) matches mlx-lm's own generate_step with the same options token for token,
  stores quantized snapshots in every store, and an exact hit reproduces the cold run exactly
  (mutant: the Engine's prefill ignores kv_bits -> float snapshots, outputs differ from mlx-lm);
- quantized_kv_start has mlx-lm's meaning (mutant: ``>`` instead of ``>=``);
- an engine never reuses KV of another format (mutant: drop the Engine's check_reusable call);
- the sweep's stored bytes equal the formula exactly and KL falls as bits rise; its KL matches an
  independent numpy computation (mutant: KL(q || p) instead of KL(p || q)).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import kvlab as kv
from kvlab.errors import QuantizationError, SnapshotError
from kvlab.quantization import SAMPLE_TEXTS
from kvlab.primitives.kv_format import kv_format

pytestmark = [pytest.mark.model, pytest.mark.embedded]

SMOL_TOL = 2e-3  # float32 reuse vs cold on SmolLM2 (as in test_primitives)
SYSTEM = ("You are a meticulous assistant for a research lab. Answer with care, cite the step you "
          "used, and keep answers short. ") * 2
A = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
B = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a long river in Germany."}]
STORES = {"radix": lambda: kv.RadixStore(), "paged": lambda: kv.PagedStore(block_size=16, num_blocks=1024),
          "system_prompt": lambda: kv.SystemPromptStore(), "mlx_lm_lru": lambda: kv.MlxLmLRUStore(max_size=10)}


def text_ids(model, i=0):
    return list(model.tokenise(SAMPLE_TEXTS[i]).ids)


def max_diff(a, b) -> float:
    return float(mx.abs(a - b).max().item())


def test_restored_quantized_snapshot_gives_exactly_the_live_logits(smol, tmp_path):
    ids = text_ids(smol)
    head, tail = ids[:80], ids[80:100]
    _, cache = kv.prefill(smol, head, kv_bits=4, kv_group_size=64)
    assert [type(c) for c in cache] == [QuantizedKVCache] * 30
    snap = kv.snapshot(cache, tokens=head, model=smol)
    assert kv_format(snap) == "q4g64" and snap.nbytes == 80 * 30 * 2 * 3 * (32 + 2 * 4)
    live, cache = kv.prefill(smol, tail, cache, kv_bits=4, kv_group_size=64)
    restored, _ = kv.prefill(smol, tail, kv.restore(snap), kv_bits=4, kv_group_size=64)
    assert max_diff(live, restored) == 0.0
    back = kv.load_snapshot(kv.save(snap, tmp_path / "q.safetensors"), smol, kv_format="q4g64")
    assert max_diff(live, kv.prefill(smol, tail, kv.restore(back), kv_bits=4)[0]) == 0.0
    # trim: the 100-token live cache trimmed back to 80 is the 80-token snapshot, bit for bit
    longer = kv.snapshot(cache, tokens=head + tail, model=smol)
    assert max_diff(live, kv.prefill(smol, tail, kv.restore(kv.trim(longer, 20)), kv_bits=4)[0]) == 0.0
    # a quantized prefix continues quantized without kv_bits too (mlx-lm's cache class does it)
    assert type(kv.prefill(smol, tail, kv.restore(snap))[1][0]) is QuantizedKVCache


def test_quantize_and_dequantize_snapshots(smol):
    ids = text_ids(smol)[:64]
    _, cache = kv.prefill(smol, ids)
    fsnap = kv.snapshot(cache, tokens=ids, model=smol)
    q8 = kv.quantize(fsnap, bits=8, group_size=32)
    assert kv_format(q8) == "q8g32" and q8.token_ids == tuple(ids) and q8.fingerprint == smol.fingerprint
    assert kv_format(fsnap) == "float32" and type(cache[0]) is KVCache  # the input is untouched
    back = kv.dequantize(q8)
    assert kv_format(back) == "float32" and back.nbytes == fsnap.nbytes
    k, k8 = fsnap.layers[0].state[0], back.layers[0].state[0]
    assert 0 < max_diff(k, k8) < 0.02 * float(mx.abs(k).max().item())  # 8-bit: small but not zero
    # what kv.prefill(kv_bits=) converts equals kv.quantize of the float cache
    _, qcache = kv.prefill(smol, ids, kv_bits=8, kv_group_size=32, quantized_kv_start=10_000)
    assert kv_format(qcache) == "float32"
    with pytest.raises(QuantizationError, match="already quantized"):
        kv.quantize(q8, bits=4)
    with pytest.raises(QuantizationError, match="group_size 128 does not divide the head dimension 64"):
        kv.quantize(fsnap, bits=4, group_size=128)


def test_engine_matches_mlx_lm_generate_with_kv_bits(smol):
    ids = list(kv.tokenise(smol, A).ids)
    ours = kv.Engine(smol, None, kv_bits=4, kv_group_size=64).run(A, max_tokens=8).output_ids
    theirs = [int(t) for t, _ in generate_step(mx.array(ids), smol.net, max_tokens=8,
                                               sampler=lambda x: mx.argmax(x, axis=-1), kv_bits=4,
                                               kv_group_size=64, quantized_kv_start=0)]
    eos = set(smol.tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(theirs) if t in eos), len(theirs))
    assert list(ours) == theirs[:cut]
    floaty = kv.Engine(smol, None).run(A, max_tokens=8).output_ids
    assert len(ours) > 1 and floaty[0] == ours[0]


@pytest.mark.parametrize("store", list(STORES))
def test_engine_with_kv_bits_in_every_store(smol, store):
    engine = kv.Engine(smol, STORES[store](), kv_bits=4, kv_group_size=64, verify=True)
    r1, r2, r3 = (engine.run(x, max_tokens=3) for x in (A, B, A))
    n = r1.prompt_tokens
    toks = kv.tokenise(smol, A)
    found = engine.store.lookup(engine.key_of(A), toks, limit=n - 1)
    assert found.snapshot is not None and kv_format(found.snapshot) == "q4g64"
    assert r1.reused_tokens == 0 and r2.reused_tokens > 0 and r3.reused_tokens > 0
    if store in ("radix", "mlx_lm_lru"):
        # an exact hit restores the n-1 tokens the cold run quantized: the same logits, exactly
        assert r3.match == "exact" and r3.reused_tokens == n - 1
        assert r3.verify_diff == 0.0 and r3.output_ids == r1.output_ids
    # reusing a quantized prefix for a new suffix adds error on top of quantization (the suffix
    # attends to quantized KV, where the cold run computed it against float KV)
    assert r2.verify_diff > SMOL_TOL


def test_quantized_kv_start_has_mlx_lms_meaning(smol):
    n = len(kv.tokenise(smol, A).ids)
    for start, want in ((n, "q4g64"), (n + 1, "float32")):
        engine = kv.Engine(smol, kv.RadixStore(), kv_bits=4, quantized_kv_start=start)
        engine.run(A, max_tokens=1)
        snap = engine.store.lookup(engine.key_of(A), kv.tokenise(smol, A), limit=n - 1).snapshot
        assert kv_format(snap) == want, start
    # a float entry below the start is reused; the continuation is quantized once it passes it
    engine = kv.Engine(smol, kv.RadixStore(), kv_bits=4, quantized_kv_start=n + 1)
    engine.run(A, max_tokens=1)
    longer = A + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    r = engine.run(longer, max_tokens=1)
    assert r.reused_tokens == n  # A's whole prompt is a prefix of the continued conversation
    snap = engine.store.lookup(engine.key_of(longer), kv.tokenise(smol, longer), limit=r.prompt_tokens - 1).snapshot
    assert kv_format(snap) == "q4g64"


def test_engine_never_reuses_kv_of_another_format(smol):
    store = kv.RadixStore()
    kv.Engine(smol, store).run(A, max_tokens=1)
    with pytest.raises(SnapshotError, match="the cached KV is float32 .* quantizes its KV \\(q4g64\\)"):
        kv.Engine(smol, store, kv_bits=4).run(A, max_tokens=1)
    store = kv.RadixStore()
    kv.Engine(smol, store, kv_bits=8, kv_group_size=32).run(A, max_tokens=1)
    with pytest.raises(SnapshotError, match="quantized \\(q8g32.*this engine runs float KV"):
        kv.Engine(smol, store).run(A, max_tokens=1)
    with pytest.raises(SnapshotError, match="this engine runs q4g32"):
        kv.Engine(smol, store, kv_bits=4, kv_group_size=32).run(A, max_tokens=1)


def test_bad_settings_are_kvlab_errors(smol, tiny):
    with pytest.raises(QuantizationError, match="kv_group_size 128 does not divide the head dimension 64"):
        kv.Engine(smol, None, kv_bits=4, kv_group_size=128)
    with pytest.raises(QuantizationError, match="No group size mlx supports divides it"):
        kv.Engine(tiny, None, kv_bits=4, kv_group_size=32)
    with pytest.raises(QuantizationError, match="kv_bits must be one of"):
        kv.Engine(smol, None, kv_bits=7)
    with pytest.raises(QuantizationError, match="quantized_kv_start must be an int >= 0"):
        kv.Engine(smol, None, kv_bits=4, quantized_kv_start=-1)
    with pytest.raises(QuantizationError, match="does not divide the head dimension 16"):
        kv.prefill(tiny, [1, 2, 3], kv_bits=4, kv_group_size=32)
    with pytest.raises(QuantizationError, match="group_size 128 does not divide the head dimension 64.*\\(32, 64\\)"):
        kv.quantization_sweep(smol, SAMPLE_TEXTS[:1], bits=(4,), group_sizes=(32, 128))
    with pytest.raises(QuantizationError, match="No group size mlx supports divides it"):
        kv.quantization_sweep(tiny, SAMPLE_TEXTS[:1])
    with pytest.raises(QuantizationError, match="text 0 has .* tokens; lengths up to 200"):
        kv.quantization_sweep(smol, SAMPLE_TEXTS[:1], bits=(4,), lengths=(200,))


@pytest.fixture(scope="module")
def sweep(smol):
    return kv.quantization_sweep(smol, SAMPLE_TEXTS[:1], bits=(2, 3, 4, 6, 8), lengths=(64,), eval_tokens=32)


def test_sweep_bytes_are_the_formula_and_kl_falls_with_bits(sweep):
    assert sweep.height == 11 and sweep["group_size"].drop_nulls().unique().sort().to_list() == [32, 64]
    assert (sweep["bytes_per_token"] == sweep["formula_bytes_per_token"].cast(float)).all()
    q = sweep.filter(sweep["bits"].is_not_null())
    # per token, 30 layers x 3 kv heads x (keys + values) x (head_dim*bits/32 words + 2 scales per group)
    want = [30 * 3 * 2 * (64 * b // 32 * 4 + 2 * (64 // g) * 4) for b, g in zip(q["bits"], q["group_size"])]
    assert q["formula_bytes_per_token"].to_list() == want
    float_row = sweep.filter(sweep["kv_format"] == "float32").row(0, named=True)
    assert float_row["bytes_per_token"] == 30 * 3 * 2 * 64 * 4 and float_row["kl_mean"] == 0.0
    for g in (32, 64):
        kl = q.filter(q["group_size"] == g).sort("bits")["kl_mean"].to_list()
        assert all(a > b for a, b in zip(kl, kl[1:])), (g, kl)
    q8 = q.filter(q["bits"] == 8)
    assert (q8["top1_agree"] >= 0.9).all() and (q8["kl_mean"] < 0.01).all()
    assert (q["peak_bytes"] > q["peak_extra_bytes"]).all() and (q["peak_extra_bytes"] > 0).all()


def test_sweep_kl_matches_an_independent_computation(smol, sweep):
    ids = text_ids(smol)
    _, cache = kv.prefill(smol, ids[:64])
    base = kv.snapshot(cache)
    ref, _ = kv.prefill(smol, ids[64:96], kv.restore(base), all_logits=True)
    got, _ = kv.prefill(smol, ids[64:96], kv.quantize(kv.restore(base), bits=4, group_size=64), all_logits=True)

    def log_softmax(x):
        x = np.array(x, dtype=np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(got)
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    row = sweep.filter(sweep["kv_format"] == "q4g64").row(0, named=True)
    assert row["kl_mean"] == pytest.approx(kl.mean(), rel=1e-3)
    assert row["top1_agree"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).mean())


def test_reuse_error_under_quantization(smol):
    rows = {}
    for bits in (4, 8):
        df = kv.quantized_reuse_error(smol, SAMPLE_TEXTS[1], 64, bits=bits, group_size=64)
        rows[bits] = {r["case"]: r for r in df.iter_rows(named=True)}
        r = rows[bits]
        assert list(r) == ["float cold", "float reuse", "quantized cold", "quantized reuse",
                           "quantized prefix, float suffix"]
        assert r["float cold"]["max_abs_vs_float"] == 0.0
        assert r["float reuse"]["max_abs_vs_float"] < SMOL_TOL  # reuse alone is exact (float error)
        assert r["quantized cold"]["max_abs_vs_quantized_cold"] == 0.0
        assert r["quantized cold"]["max_abs_vs_float"] > SMOL_TOL  # quantization itself
        assert r["quantized reuse"]["max_abs_vs_quantized_cold"] > SMOL_TOL  # what reuse adds
        assert r["quantized reuse"]["stored_kv"] == f"q{bits}g64"
    assert rows[4]["quantized reuse"]["max_abs_vs_quantized_cold"] > rows[8]["quantized reuse"]["max_abs_vs_quantized_cold"]
    # the reuse rows are what the primitives give when done by hand (bits 8)
    ids = text_ids(smol, 1)
    head, tail = ids[:64], ids[64:]
    float_cold, _ = kv.prefill(smol, ids)
    _, qcache = kv.prefill(smol, head, kv_bits=8, kv_group_size=64)
    qsnap = kv.snapshot(qcache)
    by_hand = kv.prefill(smol, tail, kv.restore(qsnap), kv_bits=8, kv_group_size=64)[0]
    assert rows[8]["quantized reuse"]["max_abs_vs_float"] == max_diff(by_hand, float_cold)
    by_hand = kv.prefill(smol, tail, kv.restore(kv.dequantize(qsnap)))[0]
    assert rows[8]["quantized prefix, float suffix"]["max_abs_vs_float"] == max_diff(by_hand, float_cold)
    assert rows[4]["quantized cold"]["kl_vs_float"] > rows[8]["quantized cold"]["kl_vs_float"]


def test_bench_section_files_and_a_model_it_cannot_quantize(smol, tiny):
    from kvlab.bench import Settings, quantization

    rows = quantization.bench_quantized_files(smol, 1, tokens=64)
    assert [(r[0], r[1]) for r in rows] == [(f"{op} 64-token snapshot", f) for op in ("save", "load")
                                            for f in ("float32", "q8g64", "q4g64")]
    mib = {r[1]: r[2] for r in rows[:3]}
    assert mib["float32"] > mib["q8g64"] > mib["q4g64"]
    # the file holds the snapshot's bytes plus a header (metadata, array names)
    assert 64 * 46080 < mib["float32"] * 2**20 < 64 * 46080 + 200_000
    assert 64 * 7200 < mib["q4g64"] * 2**20 < 64 * 7200 + 200_000
    t = quantization.table(Settings("tiny", 1, model=tiny))
    assert t.rows == (("n/a", "-", "-", "-", "-", "-"),) and "cannot be quantized" in t.notes
