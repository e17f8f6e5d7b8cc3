"""`kvlab serve --checkpoints POLICY`: the served path snapshots a prompt where the Engine does for the
same policy and store, so on a hybrid model (tiny:qwen3_5: GatedDeltaNet state beside attention, a
cache that cannot be cut back) each request reuses exactly what `kv.Engine` reuses, generates what
a cold model does, and never restores past the point where a branch diverges.

Tolerance: 1e-4 on float32 log-probabilities (see test_families_served: a prefill run in pieces
reorders float additions, <= 1e-5 here; a wrong recurrent state moves them by 1e-2 or more).

Mutants checked by hand (each makes a test here fail):
- ServedCheckpoints.split returning mlx-lm's segments unchanged (the policy ignored): message_ends
  reuses what segment_ends does, not what the engine reuses;
- split giving no segment types (mlx-lm then inserts at no cut): every later turn reuses 0;
- ServedCheckpoints without the store's checkpoint_every block ends: the paged store reuses 0;
- cuts one token late (``a + 1``): the engine's and the served reuse differ;
- the adapter not counting the paged store's checkpoint/window events: its bytes no longer match
  the store's (invariants fail on the paged test);
- the system segment typed ``user``; segment_ends recut although mlx-lm's cut is already it;
- `kvlab serve` parsing --checkpoints with no type check: a bad spec ends in a traceback, exit 1.
"""

import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

pytestmark = [pytest.mark.serving, pytest.mark.model]

TOL = 1e-4
MAX_TOKENS = 3
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hybrid():
    import kvlab as kv

    return kv.load("tiny:qwen3_5")


def _chat(turns=4):
    import kvlab as kv

    wl = kv.workloads.multi_turn(turns, system_tokens=40, user_tokens=16, reply_tokens=20)
    return [list(r.messages) for r in wl]


def _branching():
    import kvlab as kv

    wl = kv.workloads.branching(2, system_tokens=40, user_tokens=16, reply_tokens=20)
    return [list(r.messages) for r in wl]


def _ask(server, messages):
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True,
            "top_logprobs": 3}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    return r


def _served_and_expected(start, model, store, policy, requests):
    import kvlab as kv

    server = start(store, model=model, checkpoints=policy)
    responses = [_ask(server, msgs) for msgs in requests]
    engine = kv.Engine(model, kv.make_store(store), keying="prompt+output", max_tokens=MAX_TOKENS,
                       checkpoints=policy)
    expected = [engine.run(msgs) for msgs in requests]
    cold = kv.Engine(model, None, max_tokens=MAX_TOKENS)
    reference = [cold.run(msgs) for msgs in requests]
    served = server.results
    assert [r.prompt_ids for r in served] == [r.prompt_ids for r in expected]
    assert [r.output_ids for r in served] == [r.output_ids for r in reference]  # greedy = cold
    for response, ref in zip(responses, reference):
        logits = model.net(mx.array([list(ref.prompt_ids)]))[0, -1].astype(mx.float32)
        cold_lp = logits - mx.logsumexp(logits)
        for top in response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
            assert abs(top["logprob"] - cold_lp[top["id"]].item()) <= TOL
    inv = server.invariants()
    assert inv["ok"] and server.stats()["adapter_errors"] == 0, inv
    return server, [r.reused_tokens for r in served], [r.reused_tokens for r in expected]


def test_chat_reuses_what_the_engine_reuses_per_policy(start, hybrid):
    reused = {}
    for policy in ("segment_ends", "message_ends", "every:32"):
        server, served, engine = _served_and_expected(start, hybrid, "radix", policy, _chat())
        assert served == engine, (policy, served, engine)
        assert server.stats()["checkpoints"] == policy
        reused[policy] = served
    # On a growing chat both keep n - 1 of the turn before (the deepest point the next turn
    # shares: the canned reply differs from the generated one); every:32 only its multiples of 32.
    seg, msg, every = reused["segment_ends"], reused["message_ends"], reused["every:32"]
    assert seg == msg and seg[0] == 0 and all(n > 0 for n in seg[1:]), reused
    assert every[0] == 0 and all(0 < e < s and e % 32 == 0 for e, s in zip(every[1:], seg[1:])), reused


def test_branch_reuses_up_to_its_checkpoint_never_past_the_divergence(start, hybrid):
    requests = _branching()  # turn-1, turn-2, branch-1, branch-2
    server, served, engine = _served_and_expected(start, hybrid, "radix", "message_ends", requests)
    assert served == engine, (served, engine)
    results = server.results
    events = server.events
    offers = events.filter(events["event"] == "offer")
    for i in (2, 3):
        ids = results[i].prompt_ids
        earlier = [r.prompt_ids + r.output_ids for r in results[:i]]
        diverge = max(_common(ids, e) for e in earlier)
        # what earlier requests left in the store: each offer is a prefix of theirs
        kept = [n for rid, n in zip(offers["request"], offers["tokens"])
                if rid in {r.request_id for r in results[:i]}]
        lengths = [n for n in kept if any(n <= len(e) and e[:n] == ids[:n] for e in earlier)]
        best = max(n for n in lengths if n <= min(diverge, len(ids) - 1))
        assert 0 < served[i] == best <= diverge, (i, served[i], best, diverge)


def test_paged_store_reuses_at_block_ends(start, hybrid):
    server, served, engine = _served_and_expected(start, hybrid, "paged", "segment_ends", _chat(3))
    assert served == engine, (served, engine)
    assert served[0] == 0 and all(n > 0 and n % 16 == 0 for n in served[1:]), served


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("spec", ["every:0", "tail:x", "bogus", "optimal"])
def test_bad_policy_is_a_usage_error(spec):
    r = subprocess.run([sys.executable, "-m", "kvlab.cli", "serve", "--model", "tiny", "--checkpoints", spec],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "argument --checkpoints: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert ("plan_optimal" if spec == "optimal" else f"checkpoint policy {spec!r}") in r.stderr, r.stderr


def test_split_recuts_mlx_lm_segments_at_the_policy_positions():
    """Model-free: the segments mlx-lm is handed. Mutants: a cut one token late, or the system
    segment typed ``user``, or segment_ends recut on a store without block ends (not mlx-lm's
    own list any more) each fail here."""
    from types import SimpleNamespace

    from kvlab.primitives.tokens import Span, Tokens
    from kvlab.serving.checkpointing import ServedCheckpoints

    def store(every=None):
        return SimpleNamespace(capabilities=SimpleNamespace(checkpoint_every=every, block_size=every and 8))

    hybrid_model = SimpleNamespace(layout=SimpleNamespace(kind_set={"full", "recurrent"}), tokenizer=None)
    ids = tuple(range(100, 140))  # 40 tokens: system 0-12, user 12-30, generation prompt 30-40
    toks = Tokens(ids, "", (Span(0, "system", 0, 12, 0, 0), Span(1, "user", 12, 30, 0, 0)))
    mlx_segments, mlx_types = [list(ids[:12]), list(ids[12:])], ["system", "user"]

    default = ServedCheckpoints("segment_ends", hybrid_model, store())
    segments, types = default.split(toks, list(ids), mlx_segments, mlx_types)
    assert segments is mlx_segments and types is mlx_types  # mlx-lm's own cut, untouched

    plan = ServedCheckpoints("message_ends", hybrid_model, store())
    assert plan.positions(toks) == (12, 30, 39)
    segments, types = plan.split(toks, list(ids), mlx_segments, mlx_types)
    assert [len(s) for s in segments] == [12, 18, 9, 1] and sum(segments, []) == list(ids)
    assert types == ["system", "user", "user"]  # one a cut: no insert past n - 1

    paged = ServedCheckpoints("segment_ends", hybrid_model, store(every=16))
    assert not paged.is_mlx_default
    toks_seg = Tokens(ids, "", toks.spans)  # no messages: segment_ends cuts at n - 1 = 39 only,
    assert paged.positions(toks_seg) == (16, 32)  # moved down to a block end of 8, with every 16

    none = ServedCheckpoints("none", hybrid_model, store(every=16))
    assert none.positions(toks) == () and none.split(toks, list(ids), mlx_segments, mlx_types) == ([list(ids)], [])
