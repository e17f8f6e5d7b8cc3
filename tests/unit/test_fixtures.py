"""The committed fixtures in data/ still mean what data/README.md says.

Regenerate: kv.traces.from_workload(kv.workloads.agentic_loop(turns=4, billing_header=True,
system_tokens=800), qwen_tokenizer(), block_size=16).write("data/agentic_loop_trace.jsonl")
"""

import json
from pathlib import Path

import kvlab as kv

DATA = Path(__file__).resolve().parents[2] / "data"


def test_agentic_trace_fixture_matches_a_fresh_export(qwen_tokenizer):
    committed = kv.traces.read(DATA / "agentic_loop_trace.jsonl", block_size=16)
    fresh = kv.traces.from_workload(kv.workloads.agentic_loop(turns=4, billing_header=True, system_tokens=800),
                                    qwen_tokenizer, block_size=16)
    assert committed.frame.to_dicts() == fresh.frame.to_dicts()


def test_billing_header_breaks_sharing_after_the_header_block():
    """With the header, requests share only the blocks before the cch value: the simulator sees it."""
    trace = kv.traces.read(DATA / "agentic_loop_trace.jsonl", block_size=16)
    result = kv.simulate(trace, policy="infinite", block_size=16)
    hits = result.requests["hit_tokens"].to_list()
    assert hits[0] == 0 and all(h == 32 for h in hits[1:])  # 2 full blocks before 'cch=' (token ~35)


def test_billing_header_requests_fixture(qwen_tokenizer):
    a, b = json.loads((DATA / "billing_header_requests.json").read_text())
    div = kv.diverge(kv.tokenise(qwen_tokenizer, a), kv.tokenise(qwen_tokenizer, b))
    assert div.role == "system" and div.message_index == 0
    ta, tb = (kv.tokenise(qwen_tokenizer, kv.normalise(m)) for m in (a, b))
    # once normalised, the whole first request (less its generation prompt) is shared
    assert kv.diverge(ta, tb).common >= ta.spans[-1].token_end > div.token_index
