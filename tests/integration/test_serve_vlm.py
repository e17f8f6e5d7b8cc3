"""`kvlab serve` with a VLM (the tiny random-weight qwen2_vl) on loopback: images through the
OpenAI (official SDK) and Anthropic (plain HTTP) routes, keyed as kv.Engine keys them.

The facts asserted, each against a cold server (store "none") answering the same request with
greedy decoding: every answer is token for token the cold one (caching changes no answer), and

  1. two text-only requests sharing a system prompt: the second reuses exactly their common
     prefix (kv.tokenise of the same messages; block-rounded on paged) — usage cached_tokens
     and the /kvlab/requests row agree;
  2. the same image twice (data: URL, then file:// URL and a plain path of the same pixels):
     reuse covers the image, up to where the questions differ;
  3. another image with identical token ids: reuse stops at the image's first placeholder
     (block-rounded on paged), the row's reason is salt_or_extra_keys and its ``why`` names the
     image (mutant: ids-only keys reuse past the image and answer with the wrong image's KV);
  4. text and image requests sent while another is generating (ordered: the first one's first
     streamed chunk arrives before the rest are sent): exact reuse counts, cold answers;
  (bad input: test_serve_vlm_errors.py)
"""

import json
import threading
import urllib.request

import pytest

import kvlab as kv
from kvlab.primitives.tokens import common_prefix_len

pytest.importorskip("mlx_vlm")
openai = pytest.importorskip("openai")

from vlm_requests import ASK, BLOCK, MAX, SYSTEM  # noqa: E402  (tests/integration: helpers)
from vlm_requests import anthropic_body as _anthropic  # noqa: E402
from vlm_requests import data_url as _data_url  # noqa: E402
from vlm_requests import image_msgs as _image_msgs  # noqa: E402
from vlm_requests import png as _png  # noqa: E402
from vlm_requests import post as _post  # noqa: E402
from vlm_requests import sse_events  # noqa: E402
from vlm_requests import text_msgs as _text_msgs  # noqa: E402

pytestmark = [pytest.mark.vlm, pytest.mark.model, pytest.mark.serving]




@pytest.fixture(scope="module")
def vlm():
    return kv.load_vlm("tiny")


@pytest.fixture(scope="module")
def cold(vlm):
    """A server without a store: the answers caching must not change."""
    server = kv.serve(vlm, "none", api_key="")
    yield server
    server.stop()
    assert not server.running


@pytest.fixture
def warm(vlm, start):
    """warm(store, **kw): kvlab serve on the tiny VLM with ``store`` (the shared ``start`` fixture)."""
    return lambda store="radix", **kw: start(store, model=vlm, block_size=BLOCK, **kw)


def _chat(server, messages, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
    return client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=MAX,
                                          temperature=0, **kw)


def _answer(server, messages, **kw) -> tuple[str, int, tuple]:
    """(text, cached tokens, output ids) of one non-streamed request, read from the response and
    the server's own result for it."""
    r = _chat(server, messages, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, \
        server.results[-1].output_ids


def _cold(cold, messages) -> tuple[str, tuple]:
    text, cached, out = _answer(cold, messages)
    assert cached == 0
    return text, out


def _rounded(n: int, store: str) -> int:
    return n // BLOCK * BLOCK if store == "paged" else n


def _row(server) -> dict:
    return server.requests()[-1]


# -- 1. text-only requests reuse the shared system prompt ---------------------------------------

@pytest.mark.parametrize("store", ["radix", "paged"])
def test_text_requests_reuse_the_shared_system_prompt(vlm, cold, warm, store):
    server = warm(store)
    a, b = _text_msgs("What is a cat?"), _text_msgs("Name three colours.")
    shared = common_prefix_len(kv.tokenise(vlm, a).ids, kv.tokenise(vlm, b).ids)
    assert shared > len(kv.tokenise(vlm, [{"role": "user", "content": "x"}]).ids)  # the system prompt
    for msgs, expect in ((a, 0), (b, _rounded(shared, store))):
        text, cached, out = _answer(server, msgs)
        assert cached == expect and _row(server)["reused_tokens"] == expect
        assert (text, out) == _cold(cold, msgs)
    with urllib.request.urlopen(server.url + "/kvlab/stats", timeout=30) as r:
        stats = json.loads(r.read())
    assert (stats["requests"], stats["reused_tokens"]) == (2, _rounded(shared, store))
    assert stats["batching"] == "one request at a time (VLM)" and stats["model"] == "tiny-vlm"
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    cached = [ln for ln in metrics.splitlines() if ln.startswith("kvlab_cached_tokens_total")]
    assert cached and float(cached[0].rsplit(" ", 1)[1]) == _rounded(shared, store), cached


# -- 2. the same image twice: reuse covers it ----------------------------------------------------



@pytest.mark.parametrize("store", ["radix", "paged"])
def test_same_image_reuses_past_the_image(vlm, cold, warm, store, tmp_path):
    server = warm(store)
    png = _png(1)
    (tmp_path / "cat.png").write_bytes(png)
    first = _image_msgs(_data_url(png), ASK.format("colour"))
    seen = [kv.tokenise(vlm, first).ids]
    (im,) = kv.tokenise(vlm, first).images
    text, cached, out = _answer(server, first)
    assert cached == 0 and (text, out) == _cold(cold, first)
    # offered to the store: checkpoints inside the prompt (--checkpoints segment_ends), then the
    # prompt + output when it finished (mlx-lm's final insert)
    rid, n = server.results[-1].request_id, len(seen[0])
    offers = [(r["segment"], r["tokens"]) for r in server.events.rows(named=True)
              if r["event"] == "offer" and r["request"] == rid]
    assert offers[-1] == ("assistant", n + len(out))
    assert offers[:-1] and all(seg == "user" and 0 < t < n for seg, t in offers[:-1])
    for url, what in ((f"file://{tmp_path / 'cat.png'}", "shape"), (str(tmp_path / "cat.png"), "texture")):
        msgs = _image_msgs(url, ASK.format(what))
        again = kv.tokenise(vlm, msgs)
        assert again.images[0].hash == im.hash  # the pixels are hashed, not the URL
        shared = max(common_prefix_len(ids, again.ids) for ids in seen)
        seen.append(again.ids)
        assert _rounded(shared, store) >= im.token_end  # the questions differ well after the image
        text, cached, out = _answer(server, msgs)
        assert cached == _rounded(shared, store) and _row(server)["reused_tokens"] == cached
        assert (text, out) == _cold(cold, msgs)


# -- 3. another image, identical ids: reuse stops at the image ---------------------------------

@pytest.mark.parametrize("store", ["radix", "paged"])
def test_other_image_stops_reuse_at_its_placeholders(vlm, cold, warm, store, tmp_path):
    server = warm(store, record=tmp_path / "run.jsonl")
    a = _image_msgs(_data_url(_png(2)), ASK.format("colour"))
    b = _image_msgs(_data_url(_png(3)), ASK.format("colour"))
    ta, tb = kv.tokenise(vlm, a), kv.tokenise(vlm, b)
    assert ta.ids == tb.ids and ta.images[0].hash != tb.images[0].hash  # vllm-mlx#718's setup
    (im,) = tb.images
    previous = None
    for msgs, expect in ((a, 0), (b, _rounded(im.token_start, store))):
        ask = {"extra_body": {"prompt_cache_options": {"comparison_response_id": previous.id}}} if previous else {}
        previous = _chat(server, msgs, **ask)
        text, cached = previous.choices[0].message.content, previous.usage.prompt_tokens_details.cached_tokens
        out = server.results[-1].output_ids
        assert cached == expect and _row(server)["reused_tokens"] == expect
        assert (text, out) == _cold(cold, msgs)  # mutant ids-only keys: image 2's KV answers
    # the provider's diagnostics: the ids are identical, the comparison stops at the image
    diag = previous.model_extra["prompt_cache_diagnostics"]
    assert diag["cache_missed_tokens"] == len(ta.ids) - im.token_start
    assert (diag["kvlab"]["reusable_tokens"], diag["kvlab"]["token_index"]) == (im.token_start, im.token_start)
    assert diag["kvlab"]["image"].startswith(f"image 0 at token {im.token_start} differs")
    assert diag["kvlab"]["store"]["reused_tokens"] == expect
    row = _row(server)
    assert row["main_reason"] == "salt_or_extra_keys"
    # every token the store could have held (all but the last; full blocks on paged) was cached
    # under the other image's key; the rest are the last token / partial block
    holdable = len(tb.ids) // BLOCK * BLOCK if store == "paged" else len(tb.ids) - 1
    assert row["miss_reasons"]["salt_or_extra_keys"] == holdable - expect
    assert sum(row["miss_reasons"].values()) == row["missed_tokens"] == len(tb.ids) - expect
    assert f"image 0 (tokens {im.token_start}:{im.token_end}, message 1) differs" in row["why"]
    server.stop()  # the recording is complete once the server has stopped
    lines = [json.loads(ln) for ln in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [(ln["api"], ln["status"], ln["reused_tokens"], ln["model"]) for ln in lines] == \
        [("chat", "ok", 0, "tiny-vlm"), ("chat", "ok", expect, "tiny-vlm")]


# -- 4. requests sent while another generates: ordered by an event, never by time -------------

def _shared(vlm, msgs, pool) -> int:
    """The longest prefix of ``msgs``'s key (ids and image namespace) any key in ``pool`` shares."""
    mine = kv.cache_key(kv.tokenise(vlm, msgs)).symbols()
    return max(common_prefix_len(mine, kv.cache_key(kv.tokenise(vlm, p)).symbols()) for p in pool)


def test_concurrent_text_and_image_requests(vlm, cold, warm):
    server = warm("radix")
    a, b = _data_url(_png(4)), _data_url(_png(5))
    first = _image_msgs(a, ASK.format("colour"))
    rest = {"text": _text_msgs("Name three colours."), "same image": _image_msgs(a, ASK.format("shape")),
            "other image": _image_msgs(b, ASK.format("colour"))}
    # each one's reuse comes from the first request whatever order the rest are served in
    expect = {}
    for name, msgs in rest.items():
        others = [first] + [m for n, m in rest.items() if n != name]
        expect[name] = _shared(vlm, msgs, [first])
        assert expect[name] == _shared(vlm, msgs, others)
    assert expect["other image"] == kv.tokenise(vlm, first).images[0].token_start
    assert expect["same image"] > kv.tokenise(vlm, first).images[0].token_end

    stream = _chat(server, first, stream=True, stream_options={"include_usage": True})
    chunks = iter(stream)
    head = next(c for c in chunks if c.choices and c.choices[0].delta.content)  # it is generating
    got, errors = {}, []

    def send(name):
        try:
            r = _chat(server, rest[name])
            got[name] = (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)
        except Exception as e:  # noqa: BLE001  reported below with the request's name
            errors.append((name, e))

    threads = [threading.Thread(target=send, args=(n,)) for n in rest]
    for t in threads:
        t.start()
    text = head.choices[0].delta.content
    usage = None
    for c in chunks:
        text += "".join(ch.delta.content or "" for ch in c.choices)
        usage = c.usage or usage
    for t in threads:
        t.join()
    assert not errors
    assert usage.prompt_tokens_details.cached_tokens == 0 and text == _cold(cold, first)[0]
    for name, msgs in rest.items():
        assert got[name] == (_cold(cold, msgs)[0], expect[name]), name
    rows = {r["request_id"]: r for r in server.requests()}
    assert sorted(r["reused_tokens"] for r in rows.values()) == sorted([0, *expect.values()])
    assert server.invariants()["ok"]


# -- Anthropic /v1/messages with an image block ------------------------------------------------

def test_anthropic_image_blocks(vlm, cold, warm):
    server = warm("radix")
    png = _png(6)
    status, msg = _post(server, "/v1/messages", _anthropic(png, ASK.format("colour")))
    assert status == 200 and msg["usage"]["cache_read_input_tokens"] == 0
    assert msg["content"][0]["text"] == _cold(cold, _image_msgs(_data_url(png), ASK.format("colour")))[0]
    # streamed, the same image with another question: reuse covers the image
    other = _anthropic(_png(8), ASK.format("colour"), diagnostics={"previous_message_id": msg["id"]})
    status, diag = _post(server, "/v1/messages", other)  # the same ids, another image
    start = kv.tokenise(vlm, _image_msgs(_data_url(png), "?")).images[0].token_start
    n = len(kv.tokenise(vlm, _image_msgs(_data_url(png), ASK.format("colour"))).ids)
    assert status == 200 and diag["usage"]["cache_read_input_tokens"] == start
    assert diag["diagnostics"]["cache_miss_reason"]["cache_missed_input_tokens"] == n - start
    assert diag["diagnostics"]["kvlab"]["image"].startswith(f"image 0 at token {start} differs")
    req = urllib.request.Request(server.url + "/v1/messages", headers={"Content-Type": "application/json"},
                                 data=json.dumps(_anthropic(png, ASK.format("shape"), stream=True)).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        events = sse_events(r.read())
    shared = _shared(vlm, _image_msgs(_data_url(png), ASK.format("shape")),
                     [_image_msgs(_data_url(png), ASK.format("colour"))])
    start = next(e for e in events if e["type"] == "message_start")
    assert start["message"]["usage"]["cache_read_input_tokens"] == shared
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == _cold(cold, _image_msgs(_data_url(png), ASK.format("shape")))[0]
    assert [r["api"] for r in server.requests()] == ["messages"] * 3
