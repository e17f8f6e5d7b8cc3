"""One request to a kvlab server on any of its APIs, streamed or not, with a tenant's key and an
optional ``cache_salt``; returns the cached tokens the API itself reported (read with the
official SDKs, as a client would)."""

KEYS = {"ka": "alice", "ka2": "alice", "kb": "bob", "kc": "carol"}
ADMIN = "root-key"
APIS = ("chat", "responses", "anthropic")


def ask(server, key, system, user, *, api="chat", stream=False, cache_salt=None, max_tokens=2) -> int:
    """Send one conversation (``system`` then ``user``) and return the reported cached tokens."""
    import anthropic
    import openai

    extra = {"cache_salt": cache_salt} if cache_salt is not None else None
    if api == "anthropic":
        a = anthropic.Anthropic(base_url=server.url, api_key=key, timeout=120, max_retries=0)
        kw = dict(model="claude", max_tokens=max_tokens, system=system, extra_body=extra,
                  messages=[{"role": "user", "content": user}])
        if not stream:
            return a.messages.create(**kw).usage.cache_read_input_tokens
        with a.messages.stream(**kw) as s:
            return s.get_final_message().usage.cache_read_input_tokens
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, timeout=120, max_retries=0)
    if api == "responses":
        kw = dict(model="gpt", instructions=system, input=user, max_output_tokens=max_tokens, temperature=0,
                  extra_body=extra)
        if not stream:
            return c.responses.create(**kw).usage.input_tokens_details.cached_tokens
        events = list(c.responses.create(stream=True, **kw))
        return events[-1].response.usage.input_tokens_details.cached_tokens
    kw = dict(model="m", max_tokens=max_tokens, temperature=0, extra_body=extra,
              messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    if not stream:
        return c.chat.completions.create(**kw).usage.prompt_tokens_details.cached_tokens
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return chunks[-1].usage.prompt_tokens_details.cached_tokens
