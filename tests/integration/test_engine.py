"""The Engine: exact hits still give logits, keyings, drift, verify, events, stats, checkpoints for
non-trimmable caches, and clear errors. Tiny float32 models: cached vs cold logits within TOL."""

import polars as pl
import pytest

import kvlab as kv
from kvlab.errors import BudgetError, KvlabError, RequestError, SnapshotError
from kvlab.stores.base import MISS, EventLog, Match, StoreBase
from kvlab.primitives.tokens import common_prefix_len
from kvlab.workloads import Request

pytestmark = pytest.mark.model

TOL = 1e-4  # float32 tiny models; measured ~1e-5 (the prompt is split into different forward passes)


@pytest.fixture(scope="module")
def conversation():
    return list(kv.workloads.multi_turn(turns=3))


def prompt_lengths(model, requests):
    return [len(kv.tokenise(model, list(r.messages)).ids) for r in requests]


# -- hits -----------------------------------------------------------------------------------------

def test_exact_hit_recomputes_the_last_token(tiny, conversation):
    engine = kv.Engine(tiny, kv.RadixStore(), verify=True)
    first = engine.run(conversation[0], max_tokens=6)
    again = engine.run(conversation[0], max_tokens=6)
    n = first.prompt_tokens
    assert (again.match, again.reused_tokens, again.prefilled_tokens) == ("exact", n - 1, 1)
    assert again.output_ids == first.output_ids  # seed 001's bug: an exact hit must still decode
    assert again.verify_diff <= TOL
    assert engine.store.entries == 1  # the identical insert refreshed the entry


def test_no_store_is_the_cold_baseline(tiny, conversation):
    engine = kv.Engine(tiny)
    r = engine.run(conversation[0], max_tokens=2)
    assert (r.reused_tokens, r.match, r.why) == (0, "miss", "no store")
    assert engine.stats()["bytes"] == 0 and engine.events["event"].to_list() == ["lookup", "miss", "miss"]
    # nothing is ever cached: every token is new, the last one recomputed by rule
    assert engine.events.filter(engine.events["event"] == "miss").select("tokens", "detail").rows() == [
        (r.prompt_tokens - 1, "first_seen"), (1, "partial_block")]


def test_verify_off_records_nothing(tiny, conversation):
    engine = kv.Engine(tiny, kv.RadixStore())
    assert all(engine.run(r, max_tokens=1).verify_diff is None for r in conversation[:2])


# -- keyings and drift ----------------------------------------------------------------------------

def test_prompt_keying_stores_prompts_only(tiny, conversation):
    engine = kv.Engine(tiny, kv.RadixStore(), keying="prompt")
    r = engine.run(conversation[0], max_tokens=5)
    entries = engine.store.entries_frame()
    assert entries["tokens"].to_list() == [r.prompt_tokens] and entries["kind"].to_list() == ["prompt"]


def test_prompt_output_keying_stores_generated_tokens(tiny, conversation):
    engine = kv.Engine(tiny, kv.RadixStore(), keying="prompt+output", verify=True)
    r = engine.run(conversation[0], max_tokens=5)
    entries = engine.store.entries_frame()
    # mlx-lm's generate_step feeds each token before yielding it, so all 5 have KV
    assert entries["tokens"].to_list() == [r.prompt_tokens + len(r.output_ids)]
    assert entries["kind"].to_list() == ["prompt+output"]
    # the same prompt again: the cached entry extends it (trimmed to n-1)
    again = engine.run(conversation[0], max_tokens=1)
    assert (again.match, again.reused_tokens) == ("supersequence", r.prompt_tokens - 1)
    assert again.verify_diff <= TOL


def test_think_stripping_is_recorded_as_drift(tiny):
    """Qwen3's template drops <think>…</think> from assistant turns before the last user message,
    so the next turn's rendering of a reply differs from the ids that were cached."""
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What is 2+2?"}
    reply = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."}
    turn2 = [system, user, reply, {"role": "user", "content": "And 3+3?"}]
    engine = kv.Engine(tiny, kv.RadixStore(), keying="prompt+output", verify=True)
    r1 = engine.run([system, user, reply], max_tokens=3)
    r2 = engine.run(turn2, max_tokens=1)
    where = len(kv.tokenise(tiny, [system, user]).ids)  # right after "<|im_start|>assistant\n"
    assert r1.drift_index is None
    assert r2.drift_index == where == r2.reused_tokens
    cached = kv.tokenise(tiny, [system, user, reply]).ids
    assert tiny.tokenizer.decode([cached[where]]) == "<think>"
    assert r2.verify_diff <= TOL


def test_no_drift_when_history_is_prefix_stable(tiny, conversation):
    engine = kv.Engine(tiny, kv.RadixStore())
    assert [engine.run(r, max_tokens=1).drift_index for r in conversation] == [None, None, None]


def test_a_new_system_prompt_is_not_drift(tiny):
    wl = kv.workloads.agentic_loop(turns=2, system_tokens=100, tools=1, result_tokens=20)
    engine = kv.Engine(tiny, kv.RadixStore(), keying="prompt+output")
    assert [engine.run(r, max_tokens=1).drift_index for r in wl] == [None, None]


# -- events, stats, results -----------------------------------------------------------------------

def test_events_and_stats(tiny, conversation):
    engine = kv.Engine(tiny, kv.RadixStore())
    seen = []
    engine.on_result(lambda e, r: seen.append(r.request_id))
    results = [engine.run(r, max_tokens=2) for r in conversation]
    ev = engine.events
    assert ev.columns == ["request", "event", "tokens", "bytes", "entry", "t", "detail"]
    # one miss row per reason: the new tokens, and the last token (always recomputed)
    # the core's schema (kvlab.reuse), the server's too: every insert is preceded by its offer
    assert ev["event"].to_list() == ["lookup", "miss", "miss", "offer", "insert",
                                     "lookup", "hit", "miss", "miss", "offer", "insert", "evict",
                                     "lookup", "hit", "miss", "miss", "offer", "insert", "evict"]
    assert ev["request"].to_list() == [1] * 5 + [2] * 7 + [3] * 7
    misses = ev.filter(ev["event"] == "miss")
    assert misses["detail"].to_list() == ["first_seen", "partial_block"] * 3
    assert misses.group_by("request").agg(pl.col("tokens").sum()).sort("request")["tokens"].to_list() == [
        r.prompt_tokens - r.reused_tokens for r in results]
    assert ev["t"].is_sorted()
    assert ev.filter(ev["event"] == "evict")["detail"].to_list() == ["subsumed", "subsumed"]
    hits = ev.filter(ev["event"] == "hit")["tokens"].to_list()
    assert hits == [r.reused_tokens for r in results[1:]]
    inserts = ev.filter(ev["event"] == "insert")
    assert inserts["tokens"].to_list() == [r.prompt_tokens for r in results]
    assert inserts["bytes"][-1] == engine.store.nbytes

    n = prompt_lengths(tiny, conversation)
    s = engine.stats()
    assert s["token_hit_rate"] == (n[0] + n[1]) / sum(n)   # vLLM's: reused tokens / prompt tokens
    assert s["request_hit_rate"] == 2 / 3                   # vllm-mlx's: requests with any reuse
    assert (s["requests"], s["entries"], s["evictions"], s["bytes"]) == (3, 1, 0, engine.store.nbytes)
    assert seen == [1, 2, 3]
    frame = engine.results_frame()
    assert frame.height == 3 and frame["reused_tokens"].to_list() == [0, n[0], n[1]]
    assert "token hit" in repr(engine) and "<table>" in engine._repr_html_()
    assert repr(results[1]).startswith("Result(#2 prefix") and "reused" in results[1]._repr_html_()


# -- non-trimmable caches: checkpoints ------------------------------------------------------------

def test_hybrid_checkpoints_serve_prefix_and_exact_hits(tiny_hybrid, conversation):
    engine = kv.Engine(tiny_hybrid, kv.RadixStore(), verify=True)
    assert engine.checkpoints and not engine.trimmable
    results = [engine.run(r, max_tokens=2) for r in conversation]
    n = prompt_lengths(tiny_hybrid, conversation)
    assert [r.reused_tokens for r in results] == [0, n[0], n[1]]
    again = engine.run(conversation[2], max_tokens=2)
    # the entry for the whole prompt cannot drop its last token; the checkpoint at n-1 serves it
    assert again.reused_tokens == n[2] - 1
    assert "cannot be trimmed" in again.why and f"fell back to the checkpoint of {n[2] - 1} tokens" in again.why
    assert again.output_ids == results[2].output_ids
    assert all(r.verify_diff <= TOL for r in results + [again])
    kinds = engine.store.entries_frame()["kind"].to_list()
    assert "checkpoint" in kinds and not any(engine.store.entries_frame()["trimmable"].to_list())


def test_hybrid_without_checkpoints_says_why(tiny_hybrid, conversation):
    engine = kv.Engine(tiny_hybrid, kv.RadixStore(), checkpoints=False)
    for r in conversation:
        engine.run(r, max_tokens=1)
    again = engine.run(conversation[2], max_tokens=1)
    n = prompt_lengths(tiny_hybrid, conversation)
    assert again.reused_tokens == n[1]  # the previous prompt's entry, not n-1
    assert "cannot be trimmed" in again.why and "layer 0 (ArraysCache)" in again.why


def test_hybrid_shared_system_prompt_reuses_the_boundary_checkpoint(tiny_hybrid):
    wl = kv.workloads.shared_system_prompt(num_users=2, system_tokens=100, tools=1)
    engine = kv.Engine(tiny_hybrid, kv.RadixStore(), verify=True)
    a, b = (engine.run(r, max_tokens=1) for r in wl)
    cut = kv.split_at_boundary(kv.tokenise(tiny_hybrid, list(wl[1].messages))).index
    assert (a.reused_tokens, b.reused_tokens) == (0, cut)
    assert "cannot be trimmed" in b.why and b.verify_diff <= TOL


def test_hybrid_system_prompt_store(tiny_hybrid):
    wl = kv.workloads.shared_system_prompt(num_users=2, system_tokens=100, tools=1)
    engine = kv.Engine(tiny_hybrid, kv.SystemPromptStore(), verify=True)
    results = [engine.run(r, max_tokens=1) for r in wl]
    cut = kv.split_at_boundary(kv.tokenise(tiny_hybrid, list(wl[0].messages))).index
    assert [r.reused_tokens for r in results] == [0, cut]
    assert engine.store.entry.tokens == cut and results[1].verify_diff <= TOL


# -- clear errors ---------------------------------------------------------------------------------

def test_snapshot_from_another_model(tiny, tiny_hybrid, tmp_path):
    logits, cache = kv.prefill(tiny, [1, 2, 3, 4])
    path = kv.save(kv.snapshot(cache, model=tiny), tmp_path / "s.safetensors", tokens=[1, 2, 3, 4])
    with pytest.raises(SnapshotError, match="not by the model you passed"):
        kv.load_snapshot(path, tiny_hybrid)
    # a store filled by one model and read by another
    store = kv.RadixStore()
    msgs = [{"role": "user", "content": "Name three colours, please."}]
    kv.Engine(tiny, store).run(msgs, max_tokens=1)
    with pytest.raises(SnapshotError, match="KV made by model .* give each model its own store"):
        kv.Engine(tiny_hybrid, store).run(msgs, max_tokens=1)


def test_request_longer_than_the_context(tiny):
    engine = kv.Engine(tiny, kv.RadixStore())
    with pytest.raises(RequestError, match=r"request of 4096 tokens \+ 8 to generate exceeds the "
                                           r"model's context of 4096 tokens"):
        engine.run(Request(ids=tuple(range(100, 4196))), max_tokens=8)
    assert engine.results == []


@pytest.mark.parametrize("empty", [[], "", ()])
def test_empty_request(tiny, empty):
    with pytest.raises(RequestError, match="empty request"):
        kv.Engine(tiny).run(empty)


def test_empty_workload_request_and_bad_inputs(tiny):
    with pytest.raises(RequestError, match="ids is empty"):
        Request(ids=())
    with pytest.raises(RequestError, match="cannot run a int"):
        kv.Engine(tiny).run(42)
    with pytest.raises(KvlabError, match="keying must be one of"):
        kv.Engine(tiny, keying="output")


def test_budget_smaller_than_one_entry(tiny, conversation):
    with pytest.raises(BudgetError, match=r"radix: one entry needs \d+ bytes but the budget is 4096 "
                                          r"bytes; raise budget_bytes"):
        kv.Engine(tiny, kv.RadixStore(budget_bytes=4096)).run(conversation[0], max_tokens=1)
    with pytest.raises(BudgetError, match=r"system: one entry needs \d+ bytes"):
        kv.Engine(tiny, kv.SystemPromptStore(budget_bytes=4096)).run(conversation[0], max_tokens=1)
    with pytest.raises(BudgetError, match="must be a positive int"):
        kv.RadixStore(budget_bytes=0)
    with pytest.raises(BudgetError, match="num_blocks must be a positive int"):
        kv.PagedStore(num_blocks=0)


# -- a match that cannot be trimmed, run_all --------------------------------------------------------

class OffersItsEntryWhole(StoreBase):
    """A store that answers every lookup with its one entry, untrimmed, trusting the Engine to trim
    it to the shared tokens (as a third-party store may)."""

    name = "offers-whole"

    def __init__(self):
        self.snap, self.log = None, EventLog()

    @property
    def nbytes(self) -> int:
        return self.snap.nbytes if self.snap is not None else 0

    @property
    def entries(self) -> int:
        return int(self.snap is not None)

    def lookup(self, key, tokens, *, limit):
        if self.snap is None:
            return MISS
        shared = min(common_prefix_len(self.snap.token_ids, key.ids), limit)
        return Match("lcp", shared, self.snap, self.snap.offset, 1) if shared else MISS

    def insert(self, key, tokens, snap, *, kind="prompt"):
        self.snap = self.snap or snap


def test_untrimmable_match_falls_back_to_a_miss_with_the_why(tiny_hybrid, conversation):
    store = OffersItsEntryWhole()
    engine = kv.Engine(tiny_hybrid, store, checkpoints=False, verify=True)
    first = engine.run(conversation[1], max_tokens=2)
    edited = [*conversation[1].messages[:-1],
              {"role": "user", "content": conversation[1].messages[-1]["content"] + " Say it differently."}]
    r = engine.run(edited, max_tokens=2)
    offered = store.lookup(engine.key_of(edited), None, limit=r.prompt_tokens - 1)
    assert 0 < offered.tokens < store.snap.offset == first.prompt_tokens  # a trim was needed
    assert (r.match, r.reused_tokens, r.prefilled_tokens) == ("miss", 0, r.prompt_tokens)
    assert r.why.startswith("could not trim the matched entry: layer 0 (ArraysCache) cannot be trimmed")
    cold = kv.Engine(tiny_hybrid, None).run(edited, max_tokens=2)
    assert r.output_ids == cold.output_ids and r.verify_diff == 0.0
    rows = engine.events.filter((engine.events["request"] == 2) & engine.events["event"].is_in(["hit", "miss"]))
    # the tokens the store offered could not be trimmed to fit; this store reports no inserts,
    # so the rest look new to the engine
    assert rows.select("event", "tokens", "entry", "detail").rows() == [
        ("miss", r.prompt_tokens - 1 - offered.tokens, None, "first_seen"), ("miss", 1, None, "partial_block"),
        ("miss", offered.tokens, None, "not_trimmable")]
    assert r.miss_reasons["not_trimmable"] == offered.tokens


def test_run_all_runs_every_request_in_order(tiny):
    wl = kv.workloads.shared_system_prompt(num_users=3, system_tokens=60)
    each = kv.Engine(tiny, kv.RadixStore())
    one_by_one = [each.run(r, max_tokens=2) for r in wl]
    engine = kv.Engine(tiny, kv.RadixStore())
    frame = engine.run_all(wl, max_tokens=2)
    assert frame.height == 3 and frame["request_id"].to_list() == [1, 2, 3]
    assert frame["reused_tokens"].to_list() == [r.reused_tokens for r in one_by_one]
    assert frame["reused_tokens"][0] == 0 and min(frame["reused_tokens"][1:]) > 0
    assert frame["output_ids"].to_list() == [list(r.output_ids) for r in one_by_one]
    assert frame["match"].to_list() == [r.match for r in one_by_one]
    assert all(len(ids) <= 2 for ids in frame["output_ids"].to_list())
    assert frame.equals(engine.results_frame()) and engine.stats()["requests"] == 3
    assert engine.run_all([], max_tokens=2).height == 3  # nothing new: the same frame
