"""The model-free parts of a served VLM: Anthropic image blocks translated to OpenAI image parts,
and the HTTP thread's 400 messages for image parts kvlab will not serve (kvlab.serving.chat_checks).
"""

import pytest

from kvlab.serving import anthropic, chat_checks

PNG_B64 = "iVBORw0KGgo="  # any base64 string: translation does not decode it


def _body(*blocks, role="user"):
    return {"model": "m", "max_tokens": 4, "system": "Be plain.", "messages": [{"role": role, "content": list(blocks)}]}


def test_anthropic_image_blocks_become_openai_parts_in_order():
    chat = anthropic.to_chat(_body({"type": "text", "text": "Look:"},
                                   {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                                                "data": PNG_B64}},
                                   {"type": "text", "text": "What?"},
                                   {"type": "image", "source": {"type": "url", "url": "file:///tmp/a.png"}}))
    assert chat["messages"] == [
        {"role": "system", "content": "Be plain."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{PNG_B64}"}},
                                     {"type": "text", "text": "What?"},
                                     {"type": "image_url", "image_url": {"url": "file:///tmp/a.png"}}]}]
    # text-only content stays one string (mutant: always a part list would change text requests' prompts)
    assert anthropic.to_chat(_body({"type": "text", "text": "a"}, {"type": "text", "text": "b"}))["messages"][1] == \
        {"role": "user", "content": "a\nb"}


@pytest.mark.parametrize("source, says", [
    ({"type": "base64", "media_type": "image/png"}, "must be {'type': 'base64'"),
    ({"type": "file", "file_id": "f"}, "must be {'type': 'base64'"),
    (None, "messages[0].content[0].source"),
])
def test_anthropic_bad_image_sources(source, says):
    with pytest.raises(anthropic.MessagesError) as e:
        anthropic.to_chat(_body({"type": "image", "source": source}))
    assert says in str(e.value) and e.value.status == 400


def test_anthropic_image_in_an_assistant_turn_is_refused():
    with pytest.raises(anthropic.MessagesError) as e:
        anthropic.to_chat(_body({"type": "image", "source": {"type": "base64", "data": PNG_B64}}, role="assistant"))
    assert "messages[0].content[0]: block type 'image' is not supported" in str(e.value)
    assert "image in user turns" in str(e.value)


def _image(url):
    return [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_chat_checks_problems():
    ok = "data:image/png;base64," + PNG_B64
    assert chat_checks.problem(_image(ok), "tiny-vlm", vlm=True) == ""
    assert chat_checks.problem([{"role": "user", "content": "hi"}], "tiny", vlm=False) == ""
    assert chat_checks.problem(_image(ok), "tiny", vlm=False) == (
        "messages[0].content[1] is an image, but tiny is a text model: serve a vision-language model "
        "(kvlab serve --model tiny-vlm, or a local mlx-vlm folder) or send text only")
    for url in ("http://x/a.png", "https://x/a.png"):
        assert chat_checks.problem(_image(url), "tiny-vlm", vlm=True).startswith(
            f"messages[0].content[1]: {url!r} is a web URL; kvlab serve never downloads")
    for local in ("file:///tmp/a.png", "/tmp/a.png"):  # read (or refused) by the VLM, not here
        assert chat_checks.problem(_image(local), "tiny-vlm", vlm=True) == ""
    missing = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    assert "messages[0].content[0] is an image part without an image" in chat_checks.problem(missing, "v", True)
    assert chat_checks.problem([], "v", True).startswith("messages must be a non-empty list")
    assert chat_checks.problem([{"content": "x"}], "v", True) == "messages[0] must be an object with a string 'role'"
    assert [w for w, _ in chat_checks.images(_image(ok) * 2)] == ["messages[0].content[1]", "messages[1].content[1]"]


def test_first_image_difference():
    from kvlab.serving.image_diagnostics import first_difference, with_images

    a, b = (19, 25, "aa"), (19, 25, "bb")
    assert first_difference((a,), (a,)) is None and first_difference((), ()) is None
    assert first_difference((a,), (b,)) == (19, 0)
    assert first_difference((a, (40, 46, "cc")), (a, (40, 46, "dd"))) == (40, 1)
    assert first_difference((a,), ()) == (19, 0) and first_difference((), ((30, 36, "x"),)) == (30, 0)
    # an OpenAI answer whose ids never diverged (33 reusable) is cut back to the image at 19
    fields = {"prompt_cache_diagnostics": {"type": "cache_miss", "cache_missed_tokens": 0, "kvlab": {
        "reusable_tokens": 33, "previous_tokens": 33, "current_tokens": 35, "token_index": None}}}
    out = with_images(fields, (a,), (b,))["prompt_cache_diagnostics"]
    assert out["cache_missed_tokens"] == 14
    assert {k: out["kvlab"][k] for k in ("reusable_tokens", "lost_tokens", "missed_tokens", "token_index")} == \
        {"reusable_tokens": 19, "lost_tokens": 14, "missed_tokens": 16, "token_index": 19}
    # ids that diverge before the image already say where: left alone
    early = {"diagnostics": {"cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 30},
                             "kvlab": {"reusable_tokens": 3, "previous_tokens": 33, "current_tokens": 33}}}
    assert with_images(early, (a,), (b,))["diagnostics"]["cache_miss_reason"]["cache_missed_input_tokens"] == 30
