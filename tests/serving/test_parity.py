"""The Engine and `kvlab serve` run one reuse core (kvlab.reuse): the same requests through both,
for every store and every cache family (dense, hybrid, sliding window, chunked attention, pure
recurrent), reuse the same tokens, miss the others for the same reasons and leave the store holding
the same bytes after every request.

The Engine is set up as mlx-lm's server runs a request: it keys prompt + output (mlx-lm inserts
prompt + output when a request finishes) and snapshots the prompt at mlx-lm's segment ends
(``checkpoints="segment_ends"``: the end of the system segment and n - 1), so what mlx-lm adds is
inserted on both sides. Llama 4's chunked cache cannot join mlx-lm's batch: its requests take
mlx-lm's sequential path, which kvlab serves with the same snapshots (kvlab.serving.sequential).
The requests: two users sharing a system prompt, a continuation, a branch (the same history with
another reply) and a repeat.

Mutants caught (each checked by hand): the adapter keying without message spans (the system
store reuses nothing when served), the adapter looking up n tokens instead of n - 1 (served reuse
differs on every repeat); llama4 served by mlx-lm's own sequential path, which snapshots nothing
(radix, shared-radix and paged reuse less than the engine); the adapter's segment inserts of kind system/prompt
instead of the Engine's checkpoint (a paged store keeps the served system checkpoint that the
Engine's deeper one supersedes: sliding and chunked reuse 48 served, 0 in the engine); disk files
written with a window's ring phase (sliding: the server's files 2 bytes longer); mlx-lm's LRU
snapshotting a longer recurrent entry without its ids (mamba2: SnapshotError in every lookup)."""

import pytest

import kvlab as kv

pytestmark = [pytest.mark.serving, pytest.mark.model]

STORES = ["radix", "shared-radix", "paged", "system", "mlx-lru", "disk", "tiered"]
SYSTEM = ("You are a careful assistant for a research lab. Answer in one short sentence, cite no "
          "sources, and never use lists. ") * 2
MAX_TOKENS = 3


def _conversations():
    sys = {"role": "system", "content": SYSTEM}
    a = [sys, {"role": "user", "content": "What is a prefix cache?"}]
    b = [sys, {"role": "user", "content": "Why do caches miss?"}]
    follow = {"role": "user", "content": "And a radix tree?"}
    c = a + [{"role": "assistant", "content": "Saved attention keys and values."}, follow]
    d = a + [{"role": "assistant", "content": "A memo of earlier prompts."}, follow]
    return [a, b, c, d, a]


def _store(name, model, folder):
    if name in ("disk", "tiered"):
        return kv.make_store(name, disk_path=folder, model=model)
    return kv.make_store(name)


# one model per cache family: how the reuse core cuts, checkpoints and restores differs by family
# (a session fixture's name, or a tiny model type)
FAMILIES = {"dense": "tiny", "hybrid": "tiny_hybrid", "sliding": "gemma3_text", "chunked": "llama4",
            "recurrent": "mamba2"}


@pytest.mark.parametrize("name", STORES)
@pytest.mark.parametrize("kind", FAMILIES)
def test_engine_and_server_reuse_alike(request, start, client, no_eos, tmp_path, family, name, kind):
    model = request.getfixturevalue(FAMILIES[kind]) if FAMILIES[kind].startswith("tiny") else family(FAMILIES[kind])
    engine = kv.Engine(model, _store(name, model, tmp_path / "engine"), keying="prompt+output",
                       checkpoints="segment_ends", max_tokens=MAX_TOKENS)
    server = start(_store(name, model, tmp_path / "server"), model=model)
    c = client(server)
    engine_bytes, server_bytes = [], []
    for i, msgs in enumerate(_conversations(), start=1):
        engine.run(msgs)
        engine_bytes.append(engine.store.nbytes)
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                  logit_bias=no_eos)
        # the response has ended, so its prompt + output insert is done (kvlab serve's promise)
        server_bytes.append(server.adapter.nbytes)
    served = sorted(server.results, key=lambda r: r.request_id)
    assert [r.prompt_ids for r in engine.results] == [r.prompt_ids for r in served]
    # greedy on both sides: the same outputs, so the same prompt + output inserts
    assert [r.output_ids for r in engine.results] == [r.output_ids for r in served]
    reused = [r.reused_tokens for r in engine.results]
    assert reused == [r.reused_tokens for r in served]
    assert [r.miss_reasons for r in engine.results] == [r.miss_reasons for r in served]
    assert engine_bytes == server_bytes
    # every later request reuses, or says why not: the system store cannot cut a cache that cannot
    # be cut back to the system boundary (mlx-lm's segments end after the user header), and a
    # paged store lets a deeper checkpoint supersede a window's (the second user then recomputes)
    assert reused[0] == 0 and (kind != "dense" or all(reused[1:])), reused
    for r in served[1:]:
        assert r.reused_tokens or (r.why and r.miss_reasons["not_trimmable"]), (r.why, r.miss_reasons)
    assert server.invariants()["ok"], server.invariants()
