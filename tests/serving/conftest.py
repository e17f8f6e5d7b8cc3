"""Shared fixtures for the serving tests (``start``, which the VLM serving tests share, is in
tests/conftest.py): every server runs on loopback, on a free port, and is stopped (threads
joined, port freed) by the fixture that started it."""

import pytest

EOS = (151645, 151643)  # Qwen3's end tokens


@pytest.fixture
def proxied():
    """proxied(upstream, **kw) -> a running kv.proxy; all are stopped after the test."""
    import kvlab as kv

    made = []

    def _p(upstream, **kw):
        p = kv.proxy(upstream, **kw)
        made.append(p)
        return p

    yield _p
    for p in made:
        p.stop()
        assert not p.running


@pytest.fixture
def client():
    """client(server, key=None) -> the official openai SDK pointed at the server."""
    import openai

    def _client(server, key=None):
        return openai.OpenAI(base_url=server.url + "/v1", api_key=key or "none", timeout=120,
                             max_retries=0)

    return _client


@pytest.fixture
def no_eos():
    """logit_bias that bans the end tokens, so a request generates exactly max_tokens."""
    return {str(t): -100.0 for t in EOS}


@pytest.fixture
def system_prompt():
    return ("You are a careful assistant for a research lab. Answer in one short sentence, cite "
            "no sources, and never use lists. ") * 3
