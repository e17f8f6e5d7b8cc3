"""`kvlab serve` on every cache family: each request succeeds, reuses what `kv.Engine` reuses on the
same requests with the same store (the reuse core is shared), and generates what a cold model does.
And when mlx-lm's generation thread dies, every request hears why (5xx, JSON) and serving goes on.

Tolerance: 1e-4 on float32 log-probabilities of magnitude ~5. Restored KV and recurrent state are
bitwise what a cold prefill computes; what differs is the order of float additions when a prefill
runs in pieces (seen here: <= 1e-5). A wrong state moves them by 1e-2 or more (the long-memory
initialisation of the tiny recurrent models makes sure of that: kvlab.models.families).

Mutants checked by hand (each makes a test here fail):
- kvlab.models.loading without ``materialise`` (gemma4's RoPE freqs left lazy on the loading
  thread): gemma4_text's first request is dropped, the rest get errors;
- the adapter's snapshot without ``tokens=``: mamba2 and rwkv7 reuse 0 where the engine reuses;
- the ledger counting ``ctx.prompt_cache_count`` when mlx-lm's sequential path hands ctx over
  (before its lookup): llama4's stats say 0 reused while responses report cached tokens;
- the restore cutting a wrapped window back (PrefixCache._restorable without its trim): the
  branch request of the sliding and recurrent_gemma cells moves logprobs beyond the tolerance;
- the generator not failing the requests its dead thread held: they hang (client timeout);
- the handler not answering a failure after mlx-lm's 200 was buffered: a dropped connection;
- no restart: the request after the fault gets 503 instead of 200.
"""

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest

from kvlab.models.families import MODEL_TYPES

pytestmark = [pytest.mark.serving, pytest.mark.model]

TOL = 1e-4
TOP = 3  # top log-probabilities compared per response
SYSTEM = "You are a careful assistant for a research lab. Answer in one short sentence, never in lists. " * 2
TURNS = ("What is a prefix cache?", "Why do recurrent layers make it hard?", "Give one example.")
REPLIES = ("It keeps computed keys and values for reuse.", "Their state cannot be cut back to an earlier token.")
BRANCH = "Say it another way, with a different example please."
# a cheap second store on families whose cache mlx-lm's LRU handles differently (trim vs checkpoint)
LRU_FAMILIES = ("qwen3", "gemma3_text", "mamba2", "llama4", "recurrent_gemma")


def conversation() -> list[list[dict]]:
    """A 3-turn chat, then the third turn again with another question (a branch)."""
    msgs, out = [{"role": "system", "content": SYSTEM}], []
    for i, question in enumerate(TURNS):
        msgs = msgs + [{"role": "user", "content": question}]
        out.append(msgs)
        if i < len(REPLIES):
            msgs = msgs + [{"role": "assistant", "content": REPLIES[i]}]
    return out + [out[-1][:-1] + [{"role": "user", "content": BRANCH}]]


def _ask(server, messages, max_tokens=3, **kw):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
            "top_logprobs": TOP, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def _cold_logprobs(model, ids) -> mx.array:
    logits = model.net(mx.array([list(ids)]))[0, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits)


@pytest.mark.parametrize(("model_type", "store"), [(t, "radix") for t in MODEL_TYPES]
                         + [(t, "mlx-lru") for t in LRU_FAMILIES])
def test_family_served_exactly(start, model_type, store):
    import kvlab as kv

    model = kv.load(f"tiny:{model_type}")
    server = start(store, model=model)
    responses = [_ask(server, msgs) for msgs in conversation()]
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:300] for r in responses]
    served = server.results
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]

    # the engine, told to snapshot where mlx-lm's server does, on the same requests and store
    # (llama4 cannot join mlx-lm's batch: kvlab serves its sequential path with the same snapshots)
    engine = kv.Engine(model, kv.make_store(store), keying="prompt+output", max_tokens=3,
                       checkpoints="segment_ends")
    cold = kv.Engine(model, None, max_tokens=3)
    expected = [engine.run(msgs) for msgs in conversation()]
    reference = [cold.run(msgs) for msgs in conversation()]

    assert [r.prompt_ids for r in served] == [r.prompt_ids for r in expected]
    reused = [r.reused_tokens for r in served]
    assert reused == cached == [r.reused_tokens for r in expected], (reused, cached)
    assert reused[0] == 0 and all(n > 0 for n in reused[1:]), reused  # every later turn reuses
    stats = server.stats()
    assert stats["reused_tokens"] == stats["adapter_reused_tokens"] == sum(reused)
    assert stats["adapter_errors"] == 0 and stats["requests"] == 4
    assert [r.output_ids for r in served] == [r.output_ids for r in reference]
    for response, ref in zip(responses, reference):
        cold_lp = _cold_logprobs(model, ref.prompt_ids)
        for top in response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
            assert abs(top["logprob"] - cold_lp[top["id"]].item()) <= TOL, (top, cold_lp[top["id"]].item())
    inv = server.invariants()
    assert inv["ok"], inv


# -- the generation thread dies ---------------------------------------------------------------------

MARK = " XQZJVFAULT"


class FaultyNet:
    """The tiny model's network, raising on any input that carries the marker ids (a model bug
    that kills mlx-lm's generation thread), and able to hold one decode step until released."""

    def __init__(self, net, marker):
        self.net, self.marker = net, list(marker)
        self.hold: threading.Event | None = None
        self.holding = threading.Event()

    def __call__(self, inputs, *args, **kwargs):
        for row in inputs.tolist():
            if any(row[i:i + len(self.marker)] == self.marker for i in range(len(row))):
                raise RuntimeError("injected fault: a marked prompt")
        if self.hold is not None and inputs.shape[1] == 1:
            hold, self.hold = self.hold, None
            self.holding.set()
            hold.wait(60)
        return self.net(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.net, name)


@pytest.fixture
def faulty(tiny):
    marker = tiny.tokenizer.encode(MARK, add_special_tokens=False)
    model = dataclasses.replace(tiny, module=FaultyNet(tiny.module, marker))
    assert tiny.tokenise([{"role": "user", "content": "hello" + MARK}]).ids  # renders
    return model


def _marked():
    return [{"role": "user", "content": "please fail" + MARK + " now"}]


def _until(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_generation_thread_death_answers_every_request(start, faulty, no_eos):
    server = start("radix", model=faulty)
    net = faulty.net
    net.hold = threading.Event()
    release = net.hold
    with ThreadPoolExecutor(2) as pool:
        # B is decoding (its step held) when A, whose prompt kills the thread, is queued; once
        # released, mlx-lm runs at most 25 steps (its TimeBudget) before taking A, so B (64
        # tokens) is still running when A's prefill raises
        b = pool.submit(_ask, server, [{"role": "user", "content": "count to fifty"}], 64, logit_bias=no_eos)
        assert net.holding.wait(60)
        a = pool.submit(_ask, server, _marked())
        _until(lambda: server.generator.requests.qsize() == 1, "A to be queued")
        release.set()
        a, b = a.result(), b.result()
    for r in (a, b):
        assert r.status_code == 500 and "injected fault: a marked prompt" in r.text, r.text
    # A failed before its headers (mlx-lm's error shape), B after mlx-lm buffered its 200
    assert a.json()["error"] == "generation failed: mlx-lm's generation thread died (RuntimeError: " \
        "injected fault: a marked prompt); the request was not completed, retry it"
    assert b.json()["error"]["type"] == "server_error"
    # a new generation thread serves what comes next
    ok = _ask(server, [{"role": "user", "content": "still there?"}])
    assert ok.status_code == 200, ok.text
    stats = server.stats()
    assert stats["generation_restarts"] == 1 and stats["failure"] is None
    assert stats["requests"] == 1 and stats["failed"] == 2
    events = server.events
    assert events.filter(events["event"] == "restart").height == 1
    inv = server.invariants()
    assert inv["ok"], inv


def test_generation_gives_up_after_repeated_deaths(start, faulty):
    from kvlab.serving.generator import MAX_DEATHS

    server = start("radix", model=faulty)
    for _ in range(MAX_DEATHS + 1):
        r = _ask(server, _marked())
        assert r.status_code == 500 and "injected fault" in r.text, r.text
    server.wait()  # returns: generation failed for good (kvlab serve then exits 1)
    assert server.failure is not None and server.failure.status == 503
    later = _ask(server, [{"role": "user", "content": "hello?"}])
    assert later.status_code == 503, later.text
    assert f"died {MAX_DEATHS + 1} times in a row, last with RuntimeError: injected fault" in later.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 503
    stats = server.stats()
    assert stats["generation_restarts"] == MAX_DEATHS and "died" in stats["failure"]
