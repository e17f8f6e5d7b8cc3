"""kv.workloads.fixed: prompts of exactly input_len tokens as the chat template renders them,
behind a shared system prompt of exactly system_tokens, sharing nothing else (issue 22)."""

from __future__ import annotations

import os

import pytest

import kvlab as kv
from kvlab.errors import RequestError
from kvlab.workloads import fixed, rendered_ids

pytestmark = pytest.mark.model


def _check_exact(model, input_len, system_tokens):
    wl = fixed(num_requests=4, seed=1, tokenizer=model, input_len=input_len, output_len=7,
               system_tokens=system_tokens)
    ids = [rendered_ids(model, r.messages) for r in wl]
    # mutant: measuring the user content alone (not the rendering) -> every length is off
    assert [len(x) for x in ids] == [input_len] * 4
    assert [r.max_tokens for r in wl] == [7] * 4
    head = list(wl[0].messages[:-1])
    if system_tokens:
        system = wl[0].messages[0]
        assert all(r.messages[0] == system for r in wl)     # one shared system prompt
        grown = (len(rendered_ids(model, [system])) -
                 len(rendered_ids(model, [{"role": "system", "content": ""}])))
        assert grown == system_tokens                       # exact in rendered tokens
    else:
        assert [m["role"] for m in wl[0].messages] == ["user"]
    # nothing shared past the system prompt and the user turn's opening template tokens
    opening = rendered_ids(model, [*head, {"role": "user", "content": ""}])
    shared = len(os.path.commonprefix([opening, ids[0]]))
    assert len(os.path.commonprefix(ids)) == shared
    return wl, shared


@pytest.mark.parametrize("input_len", [64, 300, 1000])
@pytest.mark.parametrize("system_tokens", [0, 40])
def test_tiny_prompts_are_exact_in_rendered_tokens(tiny, input_len, system_tokens):
    _, shared = _check_exact(tiny, input_len, system_tokens)
    # Qwen3: "<|im_start|>user\n" (3 tokens) after the system message's own rendering (5 + S)
    assert shared == (3 if not system_tokens else 5 + system_tokens + 3)


@pytest.mark.embedded
@pytest.mark.parametrize("input_len", [64, 300, 1000])
@pytest.mark.parametrize("system_tokens", [0, 40])
def test_smollm2_prompts_are_exact_in_rendered_tokens(smol, input_len, system_tokens):
    _, shared = _check_exact(smol, input_len, system_tokens)
    # SmolLM2's template inserts its own 18-token default system prompt when none is given
    assert shared == (24 if not system_tokens else 5 + system_tokens + 3)


def test_every_request_starts_with_its_own_token(tiny):
    # 300 requests over ~4096 safe ids: independent draws would repeat a first token ~11 times.
    # mutant: drawing the lead token at random instead of from a permutation -> duplicates
    wl = fixed(num_requests=300, tokenizer=tiny, input_len=20)
    firsts = [rendered_ids(tiny, r.messages)[3] for r in wl]  # after "<|im_start|>user\n"
    assert len(set(firsts)) == 300
    assert [len(rendered_ids(tiny, r.messages)) for r in wl[:3]] == [20, 20, 20]


def test_seeded_and_named(tiny):
    a, b = fixed(3, seed=5, tokenizer=tiny, input_len=64), fixed(3, seed=5, tokenizer=tiny, input_len=64)
    assert a.digest() == b.digest() and a.digest() != fixed(3, seed=6, tokenizer=tiny, input_len=64).digest()
    assert [r.name for r in a] == ["fixed-1", "fixed-2", "fixed-3"]
    assert a.params == dict(num_requests=3, seed=5, input_len=64, output_len=128, system_tokens=0)
    assert repr(a).startswith("Workload('fixed', 3 requests") and "<table>" in a._repr_html_()


def test_lengths_it_cannot_honour_are_refused(tiny):
    with pytest.raises(RequestError) as e:
        fixed(2, tokenizer=tiny, input_len=50, system_tokens=40)
    # the system message renders as 5 + 40 tokens; an empty user turn and the generation prompt 8
    assert str(e.value) == ("input_len=50 leaves no room for a user message: the chat template and "
                            "the system prompt take 53 tokens; pass input_len >= 54")
    smallest = fixed(2, tokenizer=tiny, input_len=54, system_tokens=40)
    assert [len(rendered_ids(tiny, r.messages)) for r in smallest] == [54, 54]
    with pytest.raises(RequestError) as e:
        fixed(2, tokenizer=tiny, input_len=5)
    assert str(e.value) == ("input_len=5 leaves no room for a user message: the chat template takes 8 "
                            "tokens; pass input_len >= 9")
    with pytest.raises(RequestError, match="pass tokenizer="):
        fixed(2, input_len=64)
    with pytest.raises(RequestError, match="needs input_len="):
        fixed(2, tokenizer=tiny)
    with pytest.raises(RequestError, match="system_tokens must be an int >= 0"):
        fixed(2, tokenizer=tiny, input_len=64, system_tokens=-1)
    with pytest.raises(RequestError, match="output_len must be a positive int, got 0"):
        fixed(2, tokenizer=tiny, input_len=64, output_len=0)


def test_safe_ids_moved_but_sessions_still_offers_them(tiny):
    from kvlab.serving import sessions

    assert sessions.safe_ids is kv.workloads.safe_ids
    ids = list(kv.workloads.safe_ids(tiny)[:50])
    hf = kv.tokens.hf_tokenizer(tiny)
    assert hf.encode(hf.decode(ids), add_special_tokens=False) == ids
