"""Issue 33's transcript: on ``kvlab serve --store radix`` client B read client A's prompt through
``/kvlab/requests`` + ``comparison_response_id`` and guessed it token by token through
``cached_tokens``. With one ``--api-key`` (one tenant, as before) that stays so by design: B *is*
A's tenant. With ``--api-keys`` naming two tenants, B gets nothing.

Mutants caught (each checked by breaking the code): the adapter keys lookups without the request's
salt (``cached_tokens`` 16 again); ``/kvlab/requests`` unfiltered (A's response id listed); the
diagnostics log looked up across tenants (A's text in ``previous_text``)."""

import httpx
import pytest

pytestmark = [pytest.mark.serving, pytest.mark.model]

SECRET = "Patient John Smith, SSN 123-45-6789, diagnosis: hepatitis B. Please summarise."


def _chat(server, key, content, **extra):
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": content}],
                   **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _transcript(server, key_a, key_b) -> dict:
    a = _chat(server, key_a, SECRET)
    listed = httpx.get(server.url + "/kvlab/requests", headers={"Authorization": f"Bearer {key_b}"},
                       timeout=30).json()["requests"]
    ids = [row["response_id"] for row in listed]
    guess = _chat(server, key_b, "Patient John Smith, SSN 123-45")  # B's first: nothing of B's cached
    b = _chat(server, key_b, "Patient John Smith, SSN 000",
              prompt_cache_options={"comparison_response_id": a["id"]})
    return {"a_listed": a["id"] in ids, "diagnostics": b["prompt_cache_diagnostics"],
            "guess_cached": guess["usage"]["prompt_tokens_details"]["cached_tokens"]}


def test_one_key_is_one_tenant_as_before(start):
    server = start("radix", api_key="k")
    seen = _transcript(server, "k", "k")
    assert seen["a_listed"]
    assert seen["diagnostics"]["kvlab"]["previous_text"]["after"].startswith("123-45-6789, diagnosis")
    assert seen["guess_cached"] == 16  # the number: 16 tokens of the guess were A's


def test_two_tenants_give_client_b_nothing(start, tmp_path):
    server = start("radix", api_keys={"ka": "alice", "kb": "bob"}, tenant_secret=tmp_path / "secret")
    seen = _transcript(server, "ka", "kb")
    assert not seen["a_listed"]
    assert seen["diagnostics"]["type"] == "comparison_response_not_found"
    assert "123-45" not in str(seen["diagnostics"])
    assert seen["guess_cached"] == 0
