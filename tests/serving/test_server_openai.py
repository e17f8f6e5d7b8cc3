"""kvlab serve through the official openai SDK: mlx-lm's routes, kvlab's events and stats, exact
reuse counts, batching visible in the events, cached output == uncached output."""

import socket
import threading

import httpx
import polars as pl
import pytest

from kvlab.keys import CacheKey

pytestmark = [pytest.mark.serving, pytest.mark.model]


def _msgs(system, user):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_identical_request_reuses_all_but_one_token(start, client, system_prompt):
    server = start("radix")
    c = client(server)
    msgs = _msgs(system_prompt, "What is a prefix cache?")
    first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    second = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # radix keeps prompt + output; the last prompt token is always recomputed
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    ev = server.events
    hits = ev.filter(pl.col("event") == "hit")
    assert hits["request"].to_list() == [2] and hits["tokens"].to_list() == [n - 1]
    # one miss row per reason, as in the Engine (kvlab.reuse's schema): the last token is always
    # recomputed (partial_block)
    assert ev.filter(pl.col("event") == "miss").select("request", "tokens", "detail").rows() == [
        (1, n - 1, "first_seen"), (1, 1, "partial_block"), (2, 1, "partial_block")]
    # mlx-lm offers the system segment, the user segment (n - 1) and prompt + output (mlx-lm
    # 0.32 runs the last output token through the model too), in order
    offers = ev.filter((pl.col("event") == "offer") & (pl.col("request") == 1))
    assert offers["segment"].to_list() == ["system", "user", "assistant"]
    assert offers["tokens"].to_list()[1:] == [n - 1, n + 6]
    r1 = server.results[0]
    assert server.store.contains(CacheKey(tuple(r1.prompt_ids) + tuple(r1.output_ids)))
    s = server.stats()
    assert (s["requests"], s["prompt_tokens"], s["reused_tokens"]) == (2, 2 * n, n - 1)
    assert s["request_hit_rate"] == 0.5
    assert [r.reused_tokens for r in server.results] == [0, n - 1]
    assert server.invariants()["ok"], server.invariants()


def test_streaming_completions_and_kvlab_routes(start, client):
    server = start("paged", block_size=16)
    c = client(server)
    stream = c.chat.completions.create(model="anything", messages=[{"role": "user", "content": "Hi " * 40}],
                                       max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(server.results[0].output_ids) <= 5
    text = c.completions.create(model="tiny", prompt="Hi " * 40, max_tokens=3)
    assert text.usage.prompt_tokens > 16
    with httpx.Client(base_url=server.url, timeout=30) as h:
        stats = h.get("/kvlab/stats").json()
        assert stats["store"] == "paged" and stats["requests"] == 2
        assert stats["bytes"] == server.store.nbytes > 0
        everything = h.get("/kvlab/events").json()
        later = h.get("/kvlab/events", params={"since": 5}).json()
        assert [e["seq"] for e in later["events"]] == [e["seq"] for e in everything["events"]][5:]
        assert everything["next"] == len(everything["events"])
        assert h.get("/health").json() == {"status": "ok"}
    # block events carry the segment of the mlx-lm insert that stored them
    stored = server.events.filter(pl.col("event") == "block_stored")
    assert set(stored["segment"].to_list()) <= {"user", "assistant"} and stored.height > 0
    assert (stored["tokens"] == 16).all()


def test_two_requests_share_batch_steps(start, client, no_eos):
    server = start("radix")
    c = client(server)
    # the second request is sent once the first is decoding, so their overlap never depends on
    # how fast two threads reach the server on a loaded machine
    long, short = 256, 48
    first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count 0"}],
                                      max_tokens=long, temperature=0, logit_bias=no_eos, stream=True,
                                      stream_options={"include_usage": True})
    chunks = iter(first)
    next(chunks)
    second = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count 1"}],
                                       max_tokens=short, temperature=0, logit_bias=no_eos)
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == long and second.usage.completion_tokens == short
    ev = server.events
    spans = {}
    for rid in (1, 2):
        mine = ev.filter(pl.col("request") == rid)
        begin = mine.filter(pl.col("event") == "first_token")["step"][0]
        end = mine.filter(pl.col("event") == "finish")["step"][0]
        spans[rid] = (begin, end)
    shared = set(range(spans[1][0], spans[1][1] + 1)) & set(range(spans[2][0], spans[2][1] + 1))
    # each request gets one token per step it decodes in: steps both decoded in = one batch
    assert len(shared) >= 2, spans
    assert server.stats()["step"] < long + short  # fewer steps than the two served one after another


@pytest.mark.parametrize("store", ["radix", "paged", "system", "mlx-lru"])
def test_cached_output_equals_uncached(start, client, store, system_prompt, no_eos):
    """At temperature 0 a request served from the cache generates the tokens it generates with
    caching off."""
    users = ["Name one prime number.", "Name one colour of the sky."]
    outputs = {}
    for name in (store, "none"):
        server = start(name)
        c = client(server)
        for u in users:
            c.chat.completions.create(model="tiny", messages=_msgs(system_prompt, u), max_tokens=12,
                                      temperature=0, logit_bias=no_eos)
        outputs[name] = [r.output_ids for r in server.results]
        reused = [r.reused_tokens for r in server.results]
        if name == "none":
            assert reused == [0, 0]
        else:
            assert reused[1] > 40, reused  # the shared system prompt came from the cache
        server.stop()
        assert server.invariants()["ok"], server.invariants()
    assert outputs[store] == outputs["none"]


def test_stop_joins_threads_and_frees_the_port(tiny):
    import kvlab as kv

    before = threading.active_count()
    with kv.serve(tiny, "radix", api_key="") as server:
        port = server.port
        assert server.url == f"http://127.0.0.1:{port}"
        httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()
        assert threading.active_count() > before
    assert threading.active_count() == before
    with socket.socket() as s:  # nothing listens there any more (closed connections may linger
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # in TIME_WAIT: that is TCP)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_mlx_lru_one_token_prompts_keep_serving(start, client):
    """mlx-lm's LRUPromptCache hands back a cache trimmed to 0 tokens when a longer entry shares
    nothing usable (a one-token prompt: the last token is always recomputed). The observer must
    record a miss and keep the server alive. Mutant caught: naming the entry of a 0-token hit
    (tuple(None)) kills the generation thread and the second request times out."""
    server = start("mlx-lru")
    c = client(server)
    for _ in range(3):
        r = c.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens == 1
    assert [x.reused_tokens for x in server.results] == [0, 0, 0]
    assert server.events.filter(pl.col("event") == "hit").height == 0


def test_models_lists_the_served_model_and_a_load_run_uses_it(start, client, tiny):
    """issue 22: GET /v1/models answered 200 with an empty body (mlx-lm lists the Hugging Face
    cache after its headers), the SDK's models.list() failed and kvlab load fell back to
    "default_model". Mutant caught: routing /v1/models back to mlx-lm (empty body: the SDK raises)."""
    import kvlab as kv

    server = start("radix")
    listed = client(server).models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [("tiny", "model", "kvlab")]
    assert isinstance(listed.data[0].created, int)
    r = kv.generate_load(server.url, "fixed", tokenizer=tiny, input_len=64, output_len=3, system_tokens=16,
                         concurrency=1, num_requests=3, progress=False)
    assert r.settings["model"] == "tiny"                            # no model= given: the listed id
    # the server renders each prompt to exactly 64 tokens; max_tokens is an upper bound
    assert r.frame["prompt_tokens"].to_list() == [64, 64, 64]
    assert r.summary["prompt_token_mismatches"] == 0
    assert all(1 <= n <= 3 for n in r.frame["output_tokens"].to_list())
    # requests share exactly the system message's rendering (5 + 16) and "<|im_start|>user\n" (3)
    assert r.frame["reused_tokens"].to_list()[1:] == [24, 24]
