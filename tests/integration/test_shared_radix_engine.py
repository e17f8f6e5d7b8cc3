"""SharedRadixStore through kv.Engine on real models: the same reuse as RadixStore on every workload
with an unbounded budget, cached logits equal to uncached ones, what the two keep apart under a
budget, quantized KV, and the refusal of hybrid models.

Tolerance: cached vs uncached logits on the float32 tiny model, max |Δ| < 1e-4 (prefill in one
pass vs restored prefix + the rest; measured ~5e-6).
"""

import pytest

import kvlab as kv
from kvlab.primitives.tolerance import tolerance
import mlx.core as mx
from kvlab.primitives.kv_format import kv_format
from kvlab.stores import RadixStore, SharedRadixStore

pytestmark = pytest.mark.model

TOL = tolerance("float32")  # 1e-4: float32 tiny model(s), cached vs cold max |logit difference|


def workloads(model):
    w = kv.workloads
    return {"multi_turn": w.multi_turn(turns=4),
            "agentic_loop": w.agentic_loop(turns=4, system_tokens=300),
            "agentic_loop_no_header": w.agentic_loop(turns=4, system_tokens=300, billing_header=False),
            "shared_system_prompt": w.shared_system_prompt(num_users=6, system_tokens=300),
            "prefix_repetition": w.prefix_repetition(prefix_len=128, suffix_len=32, num_prompts=12,
                                                     num_prefixes=3, tokenizer=model.tokenizer)}


def run(model, store, requests, *, salts=None, **engine):
    e = kv.Engine(model, store, **engine)
    salts = salts or [None] * len(requests)
    return e, [e.run(r, max_tokens=4, salt=s) for r, s in zip(requests, salts)]


@pytest.mark.parametrize("keying", ["prompt", "prompt+output"])
def test_unbounded_reuse_equals_radix_and_logits_equal_cold(tiny, keying):
    for name, wl in workloads(tiny).items():
        r_engine, radix = run(tiny, RadixStore(), wl.requests, keying=keying)
        engine, shared = run(tiny, SharedRadixStore(), wl.requests, keying=keying, verify=True)
        assert [r.reused_tokens for r in shared] == [r.reused_tokens for r in radix], name
        assert [r.match for r in shared] == [r.match for r in radix], name
        assert sum(r.reused_tokens for r in shared) > 0, name
        assert max(r.verify_diff for r in shared) < TOL, name
        assert engine.store.nbytes <= r_engine.store.nbytes and engine.stats()["evictions"] == 0


def test_salts_part_the_tree_as_in_radix(tiny):
    wl = kv.workloads.shared_system_prompt(num_users=6, system_tokens=200)
    salts = ["tenant-a", "tenant-b", "tenant-a", None, "tenant-b", None]
    _, radix = run(tiny, RadixStore(), wl.requests, salts=salts)
    engine, shared = run(tiny, SharedRadixStore(), wl.requests, salts=salts, verify=True)
    reused = [r.reused_tokens for r in shared]
    assert reused == [r.reused_tokens for r in radix]
    assert reused[0] == reused[1] == reused[3] == 0 and min(reused[2], reused[4], reused[5]) > 100
    assert max(r.verify_diff for r in shared) < TOL
    # three namespaces, three copies of the system prompt: one subtree under the root each
    assert len(engine.store.root.children) == 3


def test_multimodal_mix_on_the_tiny_vlm():
    vlm = kv.load_vlm("tiny")
    wl = kv.workloads.multimodal_mix(num_requests=6, image_every=2)
    _, radix = run(vlm, RadixStore(), wl.requests)
    engine, shared = run(vlm, SharedRadixStore(), wl.requests, verify=True)
    reused = [r.reused_tokens for r in shared]
    assert reused == [r.reused_tokens for r in radix]
    assert max(r.verify_diff for r in shared) < TOL
    # same question, different image: reuse stops at the first image token, never past it
    images = [i for i, r in enumerate(wl.requests) if r.has_images]
    first_image = min(shared[i].prompt_ids.index(vlm.image_token_id) for i in images)
    assert all(reused[i] <= first_image for i in images[1:])


BUDGETS = {"shared_system_prompt": 1.2, "prefix_repetition": 2.5}  # x the longest prompt's KV


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_under_eviction_they_keep_different_things(tiny, name):
    """RadixStore evicts whole entries, SharedRadixStore unshared leaf tokens: at the same budget
    the shared tree still holds the common prefix of an entry RadixStore dropped, so a later
    request reuses it there and not with RadixStore. Where the two differ, the shared tree reuses
    what an unbounded cache would."""
    wl = workloads(tiny)[name]
    per_token = 1024  # tiny: 4 layers x 2 x 2 KV heads x 16 x float32
    longest = max(len(tiny.tokenise(list(r.messages)).ids) if r.messages else len(r.ids) for r in wl.requests)
    budget = int(BUDGETS[name] * longest * per_token)
    _, unbounded = run(tiny, SharedRadixStore(), wl.requests)
    r_engine, radix = run(tiny, RadixStore(budget), wl.requests)
    s_engine, shared = run(tiny, SharedRadixStore(budget), wl.requests, verify=True)
    assert r_engine.stats()["evictions"] > 0 and s_engine.stats()["evictions"] > 0
    assert s_engine.store.nbytes <= budget and r_engine.store.nbytes <= budget
    differ = [i for i, (a, b) in enumerate(zip(radix, shared)) if a.reused_tokens != b.reused_tokens]
    assert differ, "the two stores kept the same things"
    for i in differ:
        assert shared[i].reused_tokens > radix[i].reused_tokens
        assert shared[i].reused_tokens == unbounded[i].reused_tokens
    assert max(r.verify_diff for r in shared) < TOL


def test_quantized_kv_is_joined_and_float_edges_are_quantized(smol):
    a = [{"role": "user", "content": "What is the capital of France?"}]
    b = a + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    for start in (0, 10_000):
        out = {}
        for name, store in (("radix", RadixStore()), ("shared", SharedRadixStore())):
            engine = kv.Engine(smol, store, kv_bits=4, kv_group_size=64, verify=True,
                               quantized_kv_start=start)
            out[name] = [engine.run(x, max_tokens=2) for x in (a, b, a)]
        assert [(r.reused_tokens, r.match) for r in out["shared"]] == [
            (r.reused_tokens, r.match) for r in out["radix"]]
        if start == 0:
            r3 = out["shared"][2]  # a's n-1 tokens again: the quantized KV the cold run makes too
            assert r3.reused_tokens == r3.prompt_tokens - 1 and r3.verify_diff == 0.0
    # a float edge (a's prompt, below quantized_kv_start) under a quantized one: joined quantized
    n = len(kv.tokenise(smol, a).ids)
    store = SharedRadixStore()
    engine = kv.Engine(smol, store, kv_bits=4, kv_group_size=64, quantized_kv_start=n + 1)
    engine.run(a, max_tokens=1)
    r = engine.run(b, max_tokens=1)
    assert r.reused_tokens == n
    kinds = {n_.kv.layers[0].kind for n_ in store.root.walk() if n_.kv is not None}
    assert kinds == {"KVCache", "QuantizedKVCache"}
    snap = store.lookup(engine.key_of(b), kv.tokenise(smol, b), limit=r.prompt_tokens - 1).snapshot
    radix = kv.Engine(smol, RadixStore(), kv_bits=4, kv_group_size=64, quantized_kv_start=n + 1)
    radix.run(a, max_tokens=1)
    radix.run(b, max_tokens=1)
    ref = radix.store.lookup(radix.key_of(b), kv.tokenise(smol, b), limit=r.prompt_tokens - 1).snapshot
    assert kv_format(snap) == kv_format(ref) == "q4g64"
    m = snap.offset  # RadixStore's entry holds b's whole prompt; the Engine would trim it to m
    for x, y in zip(snap.layers, ref.layers):
        for p, q in zip((*x.state[0], *x.state[1]), (*y.state[0], *y.state[1])):
            assert mx.array_equal(p, q[..., :m, :]).item()


def test_hybrid_models_reuse_what_radix_does_at_its_checkpoints():
    # (more families and workloads: test_shared_radix_families.py) mutant: no checkpoints kept
    hybrid = kv.load("tiny-hybrid")
    wl = kv.workloads.multi_turn(turns=3)
    engine, results = run(hybrid, SharedRadixStore(), wl.requests, verify=True)
    _, radix = run(hybrid, RadixStore(), wl.requests)
    assert [r.reused_tokens for r in results] == [r.reused_tokens for r in radix] == [0, 135, 249]
    assert max(r.verify_diff for r in results) <= 1e-4
    assert engine.store.components()["recurrent"] > 0
