"""Every store on the seed workloads, with the reuse each design promises asserted exactly.

What each store reuses for request k, given the earlier prompts p_0..p_{k-1} (nothing is evicted
at these sizes) and ``shared`` = min(longest common prefix with an earlier prompt, n_k - 1):
  radix, mlx_lm_lru  shared tokens (the last prompt token is always recomputed);
  paged              shared // 16 * 16 (leading full blocks only);
  system_prompt      the clean system prefix of ``kv.split_at_boundary``, when request k-1 had the
                     same one (one entry), else 0.
Cached and cold logits agree within TOL (float32 tiny model; measured differences are ~1e-5, from
the different split of the prompt into forward passes).
"""

import pytest

import kvlab as kv
from kvlab.workloads import Request
from kvlab.primitives.tokens import common_prefix_len as lcp
from kvlab.primitives.tolerance import tolerance

pytestmark = pytest.mark.model

BS = 16
TOL = tolerance("float32")  # 1e-4: the tiny model is float32
# SmolLM2-135M, 30 layers: by the dtype it loads in (float32 1e-3 here; bfloat16 on a Mac)
MAX_TOKENS = 2

STORES = {
    "radix": lambda: kv.RadixStore(),
    "paged": lambda: kv.PagedStore(block_size=BS, num_blocks=4096),
    "system_prompt": lambda: kv.SystemPromptStore(),
    "mlx_lm_lru": lambda: kv.MlxLmLRUStore(max_size=10),
}


def shared(prompts, k) -> int:
    return min(max((lcp(prompts[j], prompts[k]) for j in range(k)), default=0), len(prompts[k]) - 1)


def system_cut(toks):
    if not toks.messages or toks.messages[0]["role"] != "system":
        return None
    split = kv.split_at_boundary(toks, at="system")
    return split.index if split.clean else None


def expected(store: str, toks: list, k: int) -> int:
    prompts = [t.ids for t in toks]
    if store in ("radix", "mlx_lm_lru"):
        return shared(prompts, k)
    if store == "paged":
        return shared(prompts, k) // BS * BS
    cut = system_cut(toks[k])
    if k == 0 or cut is None or system_cut(toks[k - 1]) != cut or prompts[k - 1][:cut] != prompts[k][:cut]:
        return 0
    return cut


def run(model, store_name, requests, **engine_kw):
    engine = kv.Engine(model, STORES[store_name](), verify=True, **engine_kw)
    results = [engine.run(r, max_tokens=MAX_TOKENS) for r in requests]
    toks = [kv.tokenise(model, list(r.messages)) if r.messages else kv.tokenise(model, list(r.ids))
            for r in requests]
    for r, t in zip(results, toks):
        assert r.prompt_ids == t.ids
        assert r.verify_diff is not None and r.verify_diff <= TOL, r
    return engine, results, toks


def check_reuse(store_name, results, toks):
    got = [r.reused_tokens for r in results]
    want = [expected(store_name, toks, k) for k in range(len(toks))]
    assert got == want
    return got


# -- workloads (small: tiny-model tests take seconds) ---------------------------------------------

@pytest.fixture(scope="module")
def conversation():
    return list(kv.workloads.multi_turn(turns=3))


@pytest.fixture(scope="module")
def agent_raw():
    return list(kv.workloads.agentic_loop(turns=3, system_tokens=150, tools=1, result_tokens=40))


@pytest.fixture(scope="module")
def agent_normalised(agent_raw):
    return [Request(messages=kv.normalise(list(r.messages)), max_tokens=r.max_tokens, name=r.name)
            for r in agent_raw]


@pytest.fixture(scope="module")
def shared_system():
    return list(kv.workloads.shared_system_prompt(num_users=3, system_tokens=150, tools=1))


@pytest.fixture(scope="module")
def repetition():
    return list(kv.workloads.prefix_repetition(prefix_len=64, suffix_len=32, num_prompts=5,
                                               num_prefixes=1, output_len=MAX_TOKENS))


@pytest.mark.parametrize("store", list(STORES))
def test_conversation(tiny, store, conversation):
    engine, results, toks = run(tiny, store, conversation)
    got = check_reuse(store, results, toks)
    prev = [len(t.ids) for t in toks[:-1]]
    for k in (1, 2):  # each turn's prompt extends the previous prompt
        assert toks[k].ids[: prev[k - 1]] == toks[k - 1].ids
    cut = kv.split_at_boundary(toks[0]).index
    assert got == {"radix": [0, *prev], "mlx_lm_lru": [0, *prev],
                   "paged": [0, *(n // BS * BS for n in prev)],
                   "system_prompt": [0, cut, cut]}[store]
    assert results[0].match == "miss" and all(r.match == "prefix" for r in results[1:])


@pytest.mark.parametrize("store", list(STORES))
def test_agentic_loop_billing_header_breaks_reuse(tiny, store, agent_raw):
    engine, results, toks = run(tiny, store, agent_raw)
    got = check_reuse(store, results, toks)
    for k in (1, 2):
        divs = [kv.diverge(toks[j], toks[k]) for j in range(k)]
        d = max(divs, key=lambda d: d.common)
        # the first differing token is inside the header's cch value, a few dozen tokens in
        line = toks[k].text.splitlines()[toks[k].text[: d.char_b].count("\n")]
        assert line.startswith("x-anthropic-billing-header:")
        assert d.char_b >= toks[k].text.index("cch=") + len("cch=")
        assert 20 < d.token_index < 60
        assert got[k] == {"radix": d.token_index, "mlx_lm_lru": d.token_index,
                          "paged": d.token_index // BS * BS, "system_prompt": 0}[store]
    if store == "system_prompt":
        evicts = engine.events.filter(engine.events["event"] == "evict")
        assert evicts["detail"].to_list() == ["invalidated", "invalidated"]
        assert "differs from the cached one" in results[2].why


@pytest.mark.parametrize("store", list(STORES))
def test_agentic_loop_normalised(tiny, store, agent_normalised):
    engine, results, toks = run(tiny, store, agent_normalised)
    got = check_reuse(store, results, toks)
    prev = [len(t.ids) for t in toks[:-1]]
    cut = kv.split_at_boundary(toks[0]).index
    assert got == {"radix": [0, *prev], "mlx_lm_lru": [0, *prev],
                   "paged": [0, *(n // BS * BS for n in prev)],
                   "system_prompt": [0, cut, cut]}[store]
    assert engine.stats()["request_hit_rate"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("store", list(STORES))
def test_shared_system_prompt(tiny, store, shared_system):
    engine, results, toks = run(tiny, store, shared_system)
    got = check_reuse(store, results, toks)
    cut = kv.split_at_boundary(toks[0]).index
    assert all(kv.split_at_boundary(t).index == cut for t in toks)
    if store == "system_prompt":
        assert got == [0, cut, cut]
        assert engine.store.nbytes == engine.store.entry.snapshot.nbytes > 0
        assert engine.store.entry.tokens == cut
    else:
        assert all(g >= cut // BS * BS for g in got[1:])


@pytest.mark.parametrize("store", list(STORES))
def test_prefix_repetition_cold_then_warm(tiny, store, repetition):
    """Seed 004 in miniature: 1 prefix of 64, 5 prompts of 64 + 32, block size 16."""
    engine, results, toks = run(tiny, store, repetition + repetition)
    got = check_reuse(store, results, toks)
    n = len(repetition)
    cold, warm = got[:n], got[n:]
    if store == "paged":
        assert cold == [0] + [64] * (n - 1)        # 4 blocks of the shared prefix
        assert warm == [(96 - 1) // BS * BS] * n   # 5 blocks: the last token is recomputed
        assert sum(warm) == n * 5 * BS
    elif store == "system_prompt":
        assert got == [0] * 2 * n
        assert "needs a chat conversation" in results[-1].why
    else:
        assert cold == [0] + [64] * (n - 1)
        assert warm == [95] * n
        assert all(r.match == "exact" for r in results[n:])


# -- store-specific facts -------------------------------------------------------------------------

def test_paged_stores_a_shared_prefix_once(tiny, repetition):
    engine, results, toks = run(tiny, "paged", repetition)
    store = engine.store
    cfg = tiny.config
    per_block = BS * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    distinct = {h for t in toks for h in kv.block_hashes(t.ids, BS)}
    assert len(distinct) == 4 + len(repetition) * 2
    assert store.entries == len(distinct)
    assert store.nbytes == len(distinct) * per_block
    stored = engine.events.filter(engine.events["event"] == "block_stored")
    assert stored.height == len(distinct) and set(stored["bytes"].to_list()) == {per_block}
    assert set(stored["entry"].to_list()) == {h.hex() for h in distinct}
    frame = store.blocks_frame()
    assert frame["ref_cnt"].sum() == 0 and frame["free_position"].null_count() == 0


def test_paged_evicts_and_reports_block_removed(tiny, repetition):
    engine = kv.Engine(tiny, kv.PagedStore(block_size=BS, num_blocks=8), verify=True)
    for r in repetition:
        engine.run(r, max_tokens=MAX_TOKENS)
    removed = engine.events.filter(engine.events["event"] == "block_removed")
    assert engine.store.entries <= 8 and removed.height > 0
    assert engine.stats()["evictions"] == removed.height == engine.store.evictions


def test_paged_budget_smaller_than_one_request(tiny, repetition):
    engine = kv.Engine(tiny, kv.PagedStore(block_size=BS, num_blocks=3))
    with pytest.raises(kv.BudgetError, match=r"needs 6 blocks of 16 tokens but the pool has num_blocks=3"):
        engine.run(repetition[0], max_tokens=1)


def test_paged_on_a_hybrid_model_reuses_at_block_ends(tiny_hybrid, conversation):
    # the paged store keeps the recurrent (conv) state as checkpoints at block ends: each turn
    # reuses up to the deepest block end inside the shared history, exactly. Mutants caught: the
    # store refusing recurrent layers (0 reused), a checkpoint matched past the divergence (logits
    # move beyond TOL), checkpoint bytes left out of the store's total
    engine = kv.Engine(tiny_hybrid, kv.PagedStore(block_size=BS, num_blocks=1024), verify=True)
    results = [engine.run(r, max_tokens=MAX_TOKENS) for r in conversation]
    assert [r.reused_tokens for r in results] == [0, 128, 240]
    assert all(r.verify_diff <= TOL for r in results)
    parts = engine.store.components()
    assert parts["window"] == 0 and parts["recurrent"] > 0
    assert engine.store.nbytes == parts["full"] + parts["recurrent"]


def test_system_prompt_store_only_one_entry(tiny, shared_system, conversation):
    engine = kv.Engine(tiny, kv.SystemPromptStore())
    for r in [shared_system[0], shared_system[1], conversation[0], conversation[1], shared_system[2]]:
        engine.run(r, max_tokens=1)
    assert engine.store.entries == 1
    reused = [r.reused_tokens for r in engine.results]
    cut_a = kv.split_at_boundary(kv.tokenise(tiny, list(shared_system[0].messages))).index
    cut_b = kv.split_at_boundary(kv.tokenise(tiny, list(conversation[0].messages))).index
    assert reused == [0, cut_a, 0, cut_b, 0]
    ev = engine.events
    assert ev.filter(ev["detail"] == "invalidated").height == 2


def test_system_prompt_store_needs_a_system_message(tiny):
    engine = kv.Engine(tiny, kv.SystemPromptStore())
    r = engine.run([{"role": "user", "content": "Hi there"}], max_tokens=1)
    assert r.reused_tokens == 0 and "starts with a system message" in r.why


def test_mlx_lm_lru_kinds_and_deep_copies(tiny, repetition):
    store = kv.MlxLmLRUStore(max_size=3)
    engine = kv.Engine(tiny, store, verify=True)
    a, b = repetition[0], repetition[1]
    shorter = Request(ids=a.ids[:50])
    longer = Request(ids=a.ids + (7, 8, 9))
    kinds = [engine.run(r, max_tokens=1).match for r in (a, a, shorter, longer, b)]
    # a: cold; a again: exact; a's first 50 ids: a longer entry trimmed (supersequence);
    # a + 3 ids: the entry for a is a prefix; b: shares the 64-token prefix with a longer entry (lcp)
    assert kinds == ["miss", "exact", "supersequence", "prefix", "lcp"]
    assert [r.reused_tokens for r in engine.results] == [0, 95, 49, 96, 64]
    assert store.entries <= 3 and store.nbytes == store.cache.nbytes
    assert all(r.verify_diff <= TOL for r in engine.results)
    ev = engine.events
    assert ev.filter(ev["event"] == "evict")["detail"].to_list().count("subsumed") >= 1


def test_mlx_lm_lru_serves_a_hybrid_repeat_from_its_checkpoint(tiny_hybrid):
    """mlx-lm's LRU answers an identical prompt with the entry of the whole prompt, which a hybrid
    cache cannot be cut back from; the store then serves the checkpoint at n - 1 instead. Mutant
    caught: without that second look, the repeat reuses nothing (the core refuses the cut)."""
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 12},
            {"role": "user", "content": "What is a prefix cache?"}]
    engine = kv.Engine(tiny_hybrid, kv.MlxLmLRUStore(max_size=10), verify=True)
    first, again = engine.run(msgs, max_tokens=2), engine.run(msgs, max_tokens=2)
    assert (again.match, again.reused_tokens) == ("exact", first.prompt_tokens - 1)
    assert again.verify_diff <= TOL


def test_mlx_lm_lru_max_size_evicts(tiny, repetition):
    store = kv.MlxLmLRUStore(max_size=2)
    engine = kv.Engine(tiny, store)
    for r in repetition[:4]:
        engine.run(r, max_tokens=1)
    assert store.entries == 2 and store.evictions == 2
    assert engine.stats()["evictions"] == 2


@pytest.mark.parametrize("store", list(STORES))
def test_images_never_match_other_images(tiny, store):
    """Same ids, different image hashes (extra keys): no reuse past the image's first token."""
    system = {"role": "system", "content": "You describe images for engineers in one line."}
    msgs = [system, {"role": "user", "content": "What is in this picture? Describe it briefly."}]
    ids = kv.tokenise(tiny, msgs).ids
    cut = kv.split_at_boundary(kv.tokenise(tiny, msgs)).index
    start = cut + 3  # the "image" sits in the user message, after the system prompt
    image = lambda h: ((start, start + 4, h),)  # noqa: E731
    reqs = [Request(messages=tuple(msgs), extra_keys=image("sha-A")),
            Request(messages=tuple(msgs), extra_keys=image("sha-B")),
            Request(messages=tuple(msgs)),
            Request(messages=tuple(msgs), extra_keys=image("sha-A"))]
    engine = kv.Engine(tiny, STORES[store](), verify=True)
    got = [engine.run(r, max_tokens=1).reused_tokens for r in reqs]
    n = len(ids)
    assert got == {"radix": [0, start, start, n - 1],
                   "paged": [0, start // BS * BS, start // BS * BS, (n - 1) // BS * BS],
                   "mlx_lm_lru": [0, start, start, n - 1],  # CacheKey.symbols, as radix
                   "system_prompt": [0, cut, cut, cut]}[store]


# -- the embedded model ---------------------------------------------------------------------------

@pytest.mark.embedded
def test_embedded_conversation_and_agent_loop(smol):
    conv = list(kv.workloads.multi_turn(turns=3, system_tokens=40, user_tokens=20, reply_tokens=30))
    agent = [Request(messages=kv.normalise(list(r.messages)), name=r.name)
             for r in kv.workloads.agentic_loop(turns=3, system_tokens=100, tools=1, result_tokens=30)]
    for requests in (conv, agent):
        engine = kv.Engine(smol, kv.RadixStore(), verify=True)
        results = [engine.run(r, max_tokens=MAX_TOKENS) for r in requests]
        toks = [kv.tokenise(smol, list(r.messages)) for r in requests]
        prev = [len(t.ids) for t in toks[:-1]]
        assert [r.reused_tokens for r in results] == [0, *prev]
        assert all(r.verify_diff <= tolerance(smol.dtype, deep=True) for r in results)


@pytest.mark.parametrize("store", list(STORES))
def test_stores_show_themselves(tiny, store, conversation):
    engine, _, _ = run(tiny, store, conversation[:2])
    text, page = repr(engine.store), engine.store._repr_html_()
    assert "\n" not in text and text.split("(")[0] in page
