"""``kvlab audit --profile fast`` gives the expected verdicts for four servers (issue 33): plain
mlx_lm.server (audited through a kvlab proxy) and vllm-mlx share their cache across keys, by timing
and by metadata; kvlab serve without tenants shares; kvlab serve with ``--api-keys`` shows nothing
across tenants while the same key is still detected (the positive control).

The fast profile rejects only at D+ >= 0.73 (30 + 30 samples, alpha 1e-8 over two measures): the
hit probes restore ~1900 of ~2000 tokens, the misses prefill them all (kvlab.audit.procedure: at
load average ~9 on 2 cores the slowest hit took 255 ms and the fastest miss 340 ms; at 1000 letters
they overlapped and two test suites at once hid the positive controls). A loaded machine delays hit
and miss probes alike (one shuffled order), which can only lower D+; "not detected" needs nothing
from the machine. What the tests assert besides the verdicts does not read the clock: the smallest
detectable length lies within what the hits shared, and the metadata verdicts count tokens. Every
server runs on loopback, in its own process, as the peers do, stopped by process id when its block
ends (a server inside the pytest worker shares its GIL with the audit's client, and two suites at
once on 2 cores then hid the positive controls); the tenant server is asked for /health with one
of its keys.

Mutants caught: a kvlab serve that keys requests without their tenant's salt (cross-tenant:
"shared" and a metadata leak); an audit whose hit probes share nothing with the victim's prompt
(the positive controls fail); metadata read from the victim's key instead of the attacker's; an audit
that repeats its prompts on every run (a fixed default seed: the rerun's metadata verdict is silent)."""

import contextlib
import io
import json

import pytest

from kvlab.audit import PROFILES, audit
from kvlab.cli import main
from kvlab.serving.peers import start_kvlab_proxy, start_kvlab_serve, start_mlx_lm, start_vllm_mlx

pytestmark = [pytest.mark.serving, pytest.mark.model]


def test_mlx_lm_server_shares_across_keys_through_a_proxy(tiny):
    with start_mlx_lm(tiny) as peer, start_kvlab_proxy(peer.url) as p:
        report = audit(p.url, "victim", "attacker", levels=["cross-tenant"], profile="fast")
    (lv,) = report.levels
    assert lv.verdict == "shared" and lv.metadata_leak and "cached_tokens" in lv.metadata
    shared = round(PROFILES["fast"].fractions[0] * PROFILES["fast"].prompt_letters)
    assert report.smallest_detectable_tokens is not None and 1 <= report.smallest_detectable_tokens <= shared


@pytest.mark.peers
def test_vllm_mlx_shares_across_keys():
    with start_vllm_mlx("tiny", "batched") as peer:
        report = audit(peer.url, "victim", "attacker", levels=["cross-tenant"], profile="fast")
    (lv,) = report.levels
    # its usage never reports cached tokens: its /v1/cache/stats counters tell instead
    assert lv.verdict == "shared" and lv.metadata_leak and "cached_tokens" not in lv.metadata
    assert "/v1/cache/stats.engine_cache.hits" in lv.metadata


def test_kvlab_serve_without_tenants_shares_and_a_rerun_draws_new_prompts(tiny):
    """Run twice against one server: a rerun that repeated the first run's prompts (a fixed default
    seed) would find its miss probes cached and its metadata verdict silent."""
    with start_kvlab_serve(tiny, "radix") as server:
        first, second = (audit(server.url, "victim", "attacker", levels=["cross-tenant"], profile="fast")
                         for _ in range(2))
        assert first.seed != second.seed
    for report in (first, second):
        (lv,) = report.levels
        assert lv.verdict == "shared" and lv.metadata_leak


def test_kvlab_serve_with_tenants_shares_nothing_across_them(tiny, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("ka alice\nkb bob\n")
    tenants = ["--api-keys", keys, "--tenant-secret", tmp_path / "secret"]
    out = io.StringIO()
    with start_kvlab_serve(tiny, "radix", extra_args=tenants, health_key="ka") as server, \
            contextlib.redirect_stdout(out):
        assert main(["audit", server.url, "--victim-key", "ka", "--attacker-key", "kb", "--profile", "fast",
                     "--json"]) == 0
    report = json.loads(out.getvalue())
    assert list(report) == ["target", "profile", "seed", "levels", "smallest_detectable_shared_tokens"]
    assert report["target"] == server.url and report["profile"] == "fast"
    same, cross = report["levels"]
    assert [list(lv) for lv in report["levels"]] == [["level", "verdict", "ks_d", "p", "hit_median_s",
                                                      "miss_median_s", "samples", "metadata_leak"]] * 2
    # the positive control: the victim's own key still sees its cache, by timing and metadata
    assert same["level"] == "same-key" and same["verdict"] == "shared" and same["metadata_leak"]
    assert same["p"] < 1e-8 and same["samples"] == 60 and same["hit_median_s"] < same["miss_median_s"]
    assert cross["level"] == "cross-tenant" and cross["verdict"] == "not detected"
    assert cross["p"] > 1e-8 and not cross["metadata_leak"]
