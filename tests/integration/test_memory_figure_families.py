"""The memory-over-time figure counts what hybrid and sliding models' stores hold: checkpoints
(recurrent states, windows) and window KV besides entries and blocks.

Mutant caught: the figure summing insert / evict / block events only (its total misses every
checkpoint's bytes: shared-radix on qwen3_5 shows 178,176 B of the 358,400 it holds).
"""

import pytest

import kvlab as kv
from kvlab.stores import PagedStore, SharedRadixStore

pytestmark = pytest.mark.model


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3_text"])
@pytest.mark.parametrize("make", [lambda: SharedRadixStore(budget_bytes=4 << 20),
                                  lambda: PagedStore(16, budget_bytes=4 << 20)], ids=["shared-radix", "paged"])
def test_memory_total_is_what_the_store_holds(model_type, make):
    store = make()
    engine = kv.Engine(kv.load(f"tiny:{model_type}"), store, max_tokens=2)
    for request in kv.workloads.multi_turn(4, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=2):
        engine.run(request)
    fig = kv.viz.memory_over_time(engine.events, budget_bytes=store.budget_bytes)
    total = next(t for t in fig.data if t.name == "total")
    assert store.components()["checkpoints"] > 0
    assert total.y[-1] == store.nbytes
