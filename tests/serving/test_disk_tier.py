"""`kvlab serve --disk PATH`: a TieredStore behind mlx-lm's server whose disk tier survives a
restart: the second server, with an empty RAM tier, serves the first server's prefix from disk.
Mutant caught: not flushing the RAM tier when the server stops -> the second server reuses 0."""

import pytest

pytestmark = [pytest.mark.serving, pytest.mark.model]


def test_a_restarted_server_reuses_what_the_first_cached(start, client, system_prompt, tmp_path):
    msgs = [{"role": "system", "content": system_prompt},
            {"role": "user", "content": "What is a prefix cache?"}]
    first = start("radix", disk=tmp_path / "kv")
    r1 = client(first).chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    first.stop()
    assert list((tmp_path / "kv").rglob("*.safetensors")), "the first server left nothing on disk"

    second = start("radix", disk=tmp_path / "kv")
    assert second.store.ram.entries == 0  # a fresh process has an empty RAM tier
    r2 = client(second).chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    n = r2.usage.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens == n - 1
    assert second.store.stats()["hits_disk"] == 1
    assert r2.choices[0].message.content == r1.choices[0].message.content


def test_disk_tier_needs_a_radix_or_paged_ram_store(start, tmp_path):
    from kvlab.errors import KvlabError

    with pytest.raises(KvlabError, match="'radix' or 'paged' RAM store, not 'system'"):
        start("system", disk=tmp_path / "kv")
