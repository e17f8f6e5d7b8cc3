"""Compression meets prefix caching (kvlab.compressing): kv.Engine(model, store, press=...).

A context is compressed once and stored under a key with the press in it; the same context again
is a whole-context hit that gives exactly the logits of a fresh compression (verify_diff 0.0, the
Engine's cold run compressing afresh); a match on part of a compressed entry is refused with the
reason; a query-aware press is never stored. Mutants caught (each run, each fails here): the reuse
core serving a shorter compressed entry and prefilling the rest on top (no whole-context rule);
a key without the press span (another press's entry, or an uncompressed one, served); a
query-aware press offered to the store.
"""

import pytest

import kvlab as kv
from kvlab.errors import PressError

pytestmark = pytest.mark.model

DOC = "The vault code is 4417. " + " ".join(f"Filler sentence number {i} about nothing much." for i in range(24))


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def events(engine, request, event):
    f = engine.events
    return f.filter((f["request"] == request) & (f["event"] == event))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_a_compressed_context_is_reused_whole_and_exactly(name, tiny, family):
    m = tiny if name == "qwen3" else family(name)
    e = kv.Engine(m, kv.RadixStore(), press=kv.press("knorm", 0.5), verify=True)
    first = e.run(chat(DOC, "What is the vault code?"), max_tokens=3)
    assert first.reused_tokens == 0 and first.press_tokens > 200 and first.press == "knorm(ratio=0.5)"
    assert events(e, 1, "insert")["detail"].to_list() == ["compressed"]
    second = e.run(chat(DOC, "Say the code again, please."), max_tokens=3)
    assert second.reused_tokens == second.press_tokens == first.press_tokens
    assert second.verify_diff == 0.0  # bit-identical to compressing the context afresh
    # the Inspector's memory view says what the press saved (the engine's compress rows)
    saved = int(events(e, 1, "compress")["bytes"][0])
    assert saved > 0 and events(e, 2, "compress").height == 0
    title = kv.viz.memory_over_time(e.events).layout.title.text
    assert "1 contexts compressed (knorm(ratio=0.5))" in title and "the press saved" in title


def test_another_press_or_no_press_never_shares_an_entry(tiny):
    store = kv.RadixStore()
    kv.Engine(tiny, store, press=kv.press("knorm", 0.5)).run(chat(DOC, "Q?"), max_tokens=1)
    other = kv.Engine(tiny, store, press=kv.press("knorm", 0.25)).run(chat(DOC, "Q?"), max_tokens=1)
    plain = kv.Engine(tiny, store).run(chat(DOC, "Q?"), max_tokens=1)
    assert other.reused_tokens == 0 and plain.reused_tokens == 0


def test_part_of_a_compressed_entry_is_refused_with_the_reason(tiny):
    e = kv.Engine(tiny, kv.RadixStore(), press=kv.press("knorm", 0.5))
    ids = list(range(1000, 1260))
    e.run(ids, context_end=200, max_tokens=1)
    # the entry (200 tokens) is a prefix of this context (230): continuing it is not compressing it
    longer = e.run(ids, context_end=230, max_tokens=1)
    assert longer.reused_tokens == 0 and "matches 200 of this context's 230" in longer.why
    assert "whole-context hit" in longer.why and longer.miss_reasons["not_trimmable"] == 200
    # entries sharing this context's first 180 tokens, then not: cut back, not its compression
    forked = e.run(ids[:180] + list(range(3000, 3080)), context_end=200, max_tokens=1)
    assert forked.reused_tokens == 0 and "compressed cache of 2" in forked.why
    assert "whole-context hit" in forked.why
    exact = e.run(ids[:240], context_end=230, max_tokens=1)
    assert exact.reused_tokens == 230


def test_a_query_aware_press_is_compressed_every_time_and_never_stored(tiny):
    e = kv.Engine(tiny, kv.RadixStore(), press=kv.press("snapkv", 0.5, window_size=16), verify=True)
    for _ in range(2):
        r = e.run(chat(DOC, "What is the vault code?"), max_tokens=2)
        assert r.reused_tokens == 0 and "query-aware" in r.why
    assert events(e, 2, "insert").height == 0 and e.store.entries == 0


def test_a_compressed_entry_survives_the_disk_tier_and_a_restart(tiny, tmp_path):
    press = kv.press("streaming_llm", 0.5)
    kv.Engine(tiny, kv.DiskStore(tmp_path, model=tiny), press=press).run(chat(DOC, "Q?"), max_tokens=1)
    again = kv.Engine(tiny, kv.DiskStore(tmp_path, model=tiny), press=press, verify=True).run(
        chat(DOC, "Another question?"), max_tokens=2)
    assert again.reused_tokens == again.press_tokens > 0 and again.verify_diff == 0.0


def test_stores_that_cut_tokens_and_bad_settings_are_refused(tiny, family):
    with pytest.raises(PressError, match="paged store .*use a store that keeps whole entries"):
        kv.Engine(tiny, kv.PagedStore(), press=kv.press("knorm", 0.5))
    with pytest.raises(PressError, match="no full-attention layer"):
        kv.Engine(family("mamba2"), kv.RadixStore(), press=kv.press("knorm", 0.5))
    e = kv.Engine(tiny, kv.RadixStore(), press=kv.press("knorm", 0.5))
    with pytest.raises(PressError, match="context_end must be an int in 1.."):
        e.run(chat(DOC, "Q?"), context_end=10_000)
    assert "press knorm(ratio=0.5)" in repr(e)
