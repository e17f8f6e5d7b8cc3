"""Checkpoint policies (issue 18 §3): each policy's exact positions on a hand-built 40-token prompt,
parse errors that say what to write instead, the offline optimum's plan and that it reuses at least
what every policy does at the same bytes, and the cost-aware policy saying it waits for a repeated
sighting (§4). No model: the engine's semantics (a request restores the deepest checkpoint that is a
prefix of it and at most n - 1 tokens long, then takes its own checkpoints past that) are replayed
over token ids.

Mutants caught (each checked by breaking the code): ``log_spaced`` stepping linearly; ``every:N``
reaching n; ``tail`` counting from n - 1; ``last_message`` taking the last message's
end; the cost-aware policy trusting a first sighting (its first positions) or forgetting what it
declined (no "waits" reason); ``plan_optimal`` crediting only the first request a checkpoint serves,
or taking the lowest gain per byte first; a parse that accepts ``every:0``."""

import pytest

from kvlab.checkpoints import (POLICIES, CostAware, Every, NominalCost, StateBytes, Tail, check_policy,
                               parse_policy, plan_optimal, positions, reachable)
from kvlab.errors import KvlabError
from kvlab.primitives.tokens import Span, Tokens

SB = StateBytes(1000, ((None, 10),))


def chat(ids, bounds, roles=("system", "user", "assistant", "user")):
    """Tokens of ``ids`` with messages ending at ``bounds`` (a generation prompt after the last)."""
    starts = (0, *bounds[:-1])
    spans = tuple(Span(i, roles[i % len(roles)], a, b, a, b) for i, (a, b) in enumerate(zip(starts, bounds)))
    return Tokens(tuple(ids), "", spans)


IDS = tuple(range(100, 140))
TOKS = chat(IDS, (10, 25, 33, 37))  # n = 40: messages end at 10, 25, 33, 37; 38-39 generation prompt


@pytest.mark.parametrize("spec, expected", [
    ("none", ()),
    ("message_ends", (10, 25, 33, 37, 39)),
    ("tail", (29,)),
    ("tail:11", (29,)),
    ("tail:39", (1,)),
    ("tail:40", ()),
    ("every:8", (8, 16, 24, 32)),
    ("every:40", ()),
    ("last_message", (33,)),
    ("log_spaced", (8, 24, 32, 36, 38, 39)),
])
def test_positions_on_a_hand_built_prompt(spec, expected):
    assert positions(spec, TOKS) == expected
    assert parse_policy(spec).positions(TOKS) == expected


def test_segment_ends_without_a_chat_is_the_tip_and_with_one_needs_the_tokenizer():
    assert positions("segment_ends", TOKS) == (39,)
    msgs = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})
    with pytest.raises(KvlabError, match="pass the tokenizer"):
        positions("segment_ends", Tokens(IDS, "", TOKS.spans, messages=msgs))


def test_specs_round_trip_and_show_themselves():
    assert POLICIES == ("message_ends", "segment_ends", "none", "tail", "every", "last_message",
                        "log_spaced", "cost_aware", "optimal")
    for spec in ("message_ends", "segment_ends", "none", "tail:11", "every:256", "last_message",
                 "log_spaced", "cost_aware"):
        policy = parse_policy(spec)
        assert policy.spec == spec == check_policy(spec) == parse_policy(policy.spec).spec
        assert spec in repr(policy) and spec in policy._repr_html_()
    assert parse_policy("every:256") == Every(256) and parse_policy("tail") == Tail(11)
    assert parse_policy(True).spec == "message_ends" and parse_policy(False).spec == "none"
    assert parse_policy(Every(64)) == Every(64)
    assert parse_policy("cost_aware").memory is not parse_policy("cost_aware").memory


@pytest.mark.parametrize("spec, words", [
    ("every", "every needs a positive whole number of tokens after the colon, e.g. every:256"),
    ("every:0", "every needs a positive whole number"),
    ("every:abc", "every needs a positive whole number"),
    ("tail:-3", "tail needs a positive whole number of tokens after the colon, e.g. tail:11"),
    ("none:3", "'none' takes no argument"),
    ("bogus", "unknown checkpoint policy 'bogus'; use one of message_ends"),
    ("optimal", "plan_optimal"),
    (3.5, "got float 3.5"),
])
def test_parse_errors_say_what_to_write(spec, words):
    with pytest.raises(KvlabError) as e:
        parse_policy(spec)
    assert words in str(e.value)


def test_state_bytes():
    assert SB(0) == 1000 and SB(37) == 1370
    assert StateBytes(100, ((None, 10), (32, 4)))(50) == 100 + 500 + 128


def test_plan_optimal_on_three_requests():
    a = tuple(range(10))
    b = a + tuple(range(50, 60))        # continues a
    c = a[:5] + tuple(range(80, 87))     # branches off a after 5 tokens
    sb = StateBytes(100, ((None, 10),))
    assert reachable([a, b, c]) == [0, 9, 5]
    full = plan_optimal([a, b, c], sb)
    assert full.planned_reuse == (0, 9, 5) and full.planned_bytes == sb(5) + sb(9)
    assert [full.positions(Tokens(s, "")) for s in (a, b, c)] == [(5, 9), (5, 9), (5,)]
    # a[:5] serves two requests for 150 B: taken first; a[:9] (190 B) no longer fits in 300 B
    tight = plan_optimal([a, b, c], sb, budget=300)
    assert tight.planned_reuse == (0, 5, 5) and tight.planned_bytes == 150
    assert plan_optimal([a, b, c], sb, budget=0).planned_reuse == (0, 0, 0)


def replay(policy, prompts, state_bytes):
    """What ``policy`` reuses and holds over ``prompts`` with no budget (the Engine's rules)."""
    held, reused = set(), []
    for toks in prompts:
        ids = toks.ids
        r = max((len(p) for p in held if len(p) < len(ids) and ids[:len(p)] == p), default=0)
        reused.append(r)
        held |= {ids[:p] for p in policy.positions(toks) if p > r}
    return sum(reused), sum(state_bytes(len(p)) for p in held)


def branching_prompts():
    """A 3-turn chat and a branch off each turn (as ``kv.workloads.branching``), 1 id per token."""
    ids, bounds, turns = list(range(1000, 1012)), [12], []
    for k in range(3):
        ids += list(range(2000 + 100 * k, 2009 + 100 * k))
        bounds.append(len(ids))
        turns.append(chat(ids + [7, 8], tuple(bounds)))
        ids += list(range(3000 + 100 * k, 3015 + 100 * k))
        bounds.append(len(ids))
    branches = []
    for k, t in enumerate(turns):
        tail = list(t.ids) + list(range(5000 + 100 * k, 5011 + 100 * k)) + list(range(6000, 6006)) + [7, 8]
        ends = tuple(s.token_end for s in t.spans) + (len(t.ids) + 11, len(tail) - 2)
        branches.append(chat(tail, ends))
    return turns + branches


@pytest.mark.parametrize("spec", ["message_ends", "tail:11", "tail:3", "every:8", "last_message",
                                  "log_spaced", "cost_aware", "none"])
def test_optimal_reuses_at_least_every_policy_at_equal_bytes(spec):
    prompts = branching_prompts()
    policy = parse_policy(spec)
    if isinstance(policy, CostAware):
        policy = CostAware(NominalCost(), SB)
    reused, nbytes = replay(policy, prompts, SB)
    best = plan_optimal([t.ids for t in prompts], SB, budget=nbytes)
    assert best.planned_bytes <= nbytes
    assert sum(best.planned_reuse) >= reused
    assert sum(best.planned_reuse) <= sum(reachable([t.ids for t in prompts]))


def test_cost_aware_waits_for_a_repeated_sighting_and_says_so():
    policy = CostAware(NominalCost(), SB)
    first = TOKS
    second = chat(IDS[:37] + tuple(range(900, 908)), (10, 25, 33, 37, 43))  # n = 45: a new last turn
    # nothing seen yet: message ends wait, the tip (chance 1/2 before any evidence) is taken
    assert policy.why_missed(first, 0) == ""
    assert policy.positions(first) == (39,)
    # the second prompt shares the first's messages (seen once: chance 1/2) but not its tip
    why = policy.why_missed(second, 0)
    assert why.startswith("cost_aware waits for a repeated sighting: the prefix of 37 tokens (to the "
                          "end of message 3) was seen once before and not checkpointed then, so 37 "
                          "tokens were prefilled again")
    assert policy.why_missed(second, 37) == ""  # nothing of it missed
    # value per byte p/(1000 + 10 p) grows with p: 37 is best, 25 and 33 within half of it, 10 not;
    # the tip's chance fell to 1/3 (the first tip was not continued) but it is still within half
    assert policy.positions(second) == (25, 33, 37, 44)
    assert policy.positions(second) == (25, 33, 37, 44)  # asking again counts no new sighting
    # 10, 25, 33, 37 and the second prompt's 43 were declined on first sight
    assert repr(policy.memory) == "Sightings(2 prompts, 7 prefixes, 5 waiting for a repeat)"


def test_prefill_stops_move_policy_positions_to_block_ends_for_a_recurrent_model_in_a_paged_store():
    """Mutants: positions left where the policy put them (345 is no block end: the paged store
    keeps no recurrent state there), block ends every block instead of every checkpoint_every,
    or the rule applied to a model without recurrent layers (its windows can be kept anywhere)."""
    from types import SimpleNamespace

    from kvlab.checkpoints import prefill_stops

    paged = SimpleNamespace(checkpoint_every=256, block_size=16)
    hybrid, sliding = SimpleNamespace(kind_set={"full", "recurrent"}), SimpleNamespace(kind_set={"full", "window"})
    assert prefill_stops((345, 871), 872, paged, hybrid) == (256, 336, 512, 768, 864)
    assert prefill_stops((345, 871), 872, paged, sliding) == (345, 871)
    radix = SimpleNamespace(checkpoint_every=None, block_size=None)
    assert prefill_stops((871, 345, 0, 872), 872, radix, hybrid) == (345, 871)
    assert prefill_stops((5,), 872, paged, hybrid) == (256, 512, 768)  # a position in the first block


def test_a_paged_store_checkpoints_every_256_tokens_by_default_on_a_block_end():
    from kvlab.errors import BlockSizeError
    from kvlab.stores import PagedStore

    assert PagedStore(block_size=16).capabilities.checkpoint_every == 256
    assert PagedStore(block_size=100).capabilities.checkpoint_every == 300
    assert PagedStore(block_size=16, checkpoint_every=32).capabilities.checkpoint_every == 32
    with pytest.raises(BlockSizeError, match="checkpoint_every must be a positive multiple of block_size=16"):
        PagedStore(block_size=16, checkpoint_every=40)
