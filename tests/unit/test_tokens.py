"""tokenise / split_at_boundary with the real Qwen3 tokenizer and chat template (no model weights)."""

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab as kv
from kvlab.errors import BoundaryError, TemplateError

MSGS = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


def test_spans_cover_each_message(qwen_tokenizer):
    t = kv.tokenise(qwen_tokenizer, MSGS)
    assert [s.role for s in t.spans] == ["system", "user", "assistant", "user"]
    for span, msg in zip(t.spans, MSGS):
        assert msg["content"] in t.text[span.char_start:span.char_end]
        decoded = qwen_tokenizer.decode(list(t.ids[span.token_start:span.token_end]))
        assert msg["content"] in decoded
    # spans are contiguous, in order, and end where the generation prompt begins
    assert all(a.token_end == b.token_start for a, b in zip(t.spans, t.spans[1:]))
    assert t.text[t.spans[-1].char_end:] == "<|im_start|>assistant\n"
    assert qwen_tokenizer.decode(list(t.ids)) == t.text


def test_repr_and_html(qwen_tokenizer):
    t = kv.tokenise(qwen_tokenizer, MSGS)
    assert repr(t) == f"Tokens({len(t.ids)} ids, 4 messages [system,user,assistant,user])"
    assert "background:#e8d5ff" in t._repr_html_()  # the system colour


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_decode_encode_round_trip(qwen_tokenizer, text):
    # Qwen's tokenizer NFC-normalises its input, so the round trip holds for NFC text
    text = unicodedata.normalize("NFC", text)
    t = kv.tokenise(qwen_tokenizer, text)
    assert qwen_tokenizer.decode(list(t.ids)) == text
    # offsets are monotone and reach the end (byte tokens of one character share overlapping ranges)
    starts = [a for a, _ in t.offsets]
    assert starts == sorted(starts) and t.offsets[-1][1] == len(text)


def test_split_system_is_clean(qwen_tokenizer):
    t = kv.tokenise(qwen_tokenizer, MSGS)
    s = kv.split_at_boundary(t, at="system")
    assert s.clean and s.message_index == 1
    assert s.index == t.spans[0].token_end
    assert s.prefix_ids + s.suffix_ids == t.ids
    alone = kv.tokenise(qwen_tokenizer, MSGS[:1], add_generation_prompt=False)
    assert alone.ids == s.prefix_ids


def test_split_not_clean_when_template_rewrites_history(qwen_tokenizer):
    """Qwen3's template drops <think> from earlier assistant turns (pitfall 8)."""
    msgs = [MSGS[1], {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4."}, MSGS[3]]
    t = kv.tokenise(qwen_tokenizer, msgs)
    s = kv.split_at_boundary(t, at=2)
    assert not s.clean
    assert "differently" in s.reason
    assert s.prefix_ids + s.suffix_ids == t.ids
    # it still reports how much is shared: the user turn and the assistant header
    assert s.index == len(kv.tokenise(qwen_tokenizer, msgs[:1], add_generation_prompt=True).ids)


def test_split_errors(qwen_tokenizer):
    t = kv.tokenise(qwen_tokenizer, MSGS[1:])
    with pytest.raises(BoundaryError, match="starts with a system message"):
        kv.split_at_boundary(t, at="system")
    with pytest.raises(BoundaryError, match="outside 1..3"):
        kv.split_at_boundary(t, at=7)
    with pytest.raises(BoundaryError, match="no messages"):
        kv.split_at_boundary(kv.tokenise(qwen_tokenizer, "plain text"), at=1)


def test_bad_messages(qwen_tokenizer):
    with pytest.raises(TemplateError, match="empty conversation"):
        kv.tokenise(qwen_tokenizer, [])
    with pytest.raises(TemplateError, match="unknown role"):
        kv.tokenise(qwen_tokenizer, [{"role": "robot", "content": "x"}])
    with pytest.raises(TemplateError, match="'role' and 'content'"):
        kv.tokenise(qwen_tokenizer, [{"content": "x"}])
    with pytest.raises(TemplateError, match="text-only"):
        kv.tokenise(qwen_tokenizer, [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])


WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1,
                max_size=30).filter(lambda s: "<" not in s and s.strip())


@settings(max_examples=40, deadline=None)
@given(system=WORDS, turns=st.lists(st.tuples(WORDS, WORDS), min_size=1, max_size=3))
def test_split_properties(qwen_tokenizer, system, turns):
    msgs = [{"role": "system", "content": system}]
    for user, reply in turns:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    msgs.append({"role": "user", "content": turns[0][0]})
    t = kv.tokenise(qwen_tokenizer, msgs)
    for at in ["system", *range(1, len(msgs) + 1)]:
        s = kv.split_at_boundary(t, at=at)
        assert s.prefix_ids + s.suffix_ids == t.ids
        if s.clean:
            k = s.message_index
            assert s.prefix_ids == kv.tokenise(qwen_tokenizer, msgs[:k], add_generation_prompt=False).ids
            assert s.index == t.spans[k - 1].token_end
        else:
            assert s.reason
