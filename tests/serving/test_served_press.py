"""`kvlab serve --press NAME:RATIO`: each fresh prompt's context compressed in the server, stored
whole, reused on a whole-context hit, and /kvlab/stats says requests run one at a time.

Mutants caught (each run, each fails here): the provider left batchable (mlx-lm's BatchGenerator
would merge the caches into a plain BatchKVCache: the compressed cache never reaches decode, the
pitfall of an inherited merge); usage counting a fresh compression as cached tokens (mlx-lm counts
every token it did not prefill); mlx-lm's own prompt + output inserts stored (they hold compressed
rows under plain ids); the server's own sequential path (kvlab.serving.sequential, taken when its
--checkpoints snapshot) serving a press's requests without compressing them: a silent 0%.
"""

import httpx
import polars as pl
import pytest

import kvlab as kv
from kvlab.compressing import context_end_of, press_key
from kvlab.keys import cache_key
from kvlab.primitives.kept_cache import KeptKVCache
from kvlab.primitives.tokens import from_ids

pytestmark = [pytest.mark.serving, pytest.mark.model]


def _msgs(system, user):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_served_press_compresses_fresh_prompts_and_reuses_the_context_whole(start, client, system_prompt, tiny):
    server = start("radix", press="knorm:0.5")
    c = client(server)
    first = c.chat.completions.create(model="tiny", messages=_msgs(system_prompt, "What is a cache?"),
                                      max_tokens=4, temperature=0)
    second = c.chat.completions.create(model="tiny", messages=_msgs(system_prompt, "And a press?"),
                                       max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    ids = list(server.results[1].prompt_ids)
    context = context_end_of(from_ids(ids, tiny.tokenizer, chatml_spans=True))  # the system message
    assert second.usage.prompt_tokens_details.cached_tokens == context > 50
    ev = server.events
    assert ev.filter(pl.col("event") == "insert")["detail"].to_list() == ["compressed"]
    assert ev.filter(pl.col("event") == "offer_refused")["request"].to_list() == [1, 2]  # mlx-lm's own
    stats = httpx.get(server.url + "/kvlab/stats", timeout=30).json()
    assert stats["press"] == "knorm(ratio=0.5)" and stats["batching"].startswith("one request at a time (press")
    assert server.generator.model_provider.is_batchable is False
    assert [r.reused_tokens for r in server.results] == [0, context]
    # what the server stored is the compressed context, exactly what kv.compress makes of it
    toks = from_ids(ids)
    entry = server.store.lookup(press_key(cache_key(toks), server.press, context), toks, limit=context)
    live = kv.restore(entry.snapshot)
    assert isinstance(live[1], KeptKVCache) and live[1].offset == context
    fresh = kv.compress(tiny, ids[:context], kv.press("knorm", 0.5))
    assert live[1].kept.tolist() == fresh.kept[1].tolist()
    assert server.invariants()["ok"], server.invariants()
