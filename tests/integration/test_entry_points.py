"""Token ids are checked where they enter (issue 9 §7): MLX gathers embeddings without a bounds
check, so an id past the vocabulary kills the process (a notebook kernel dies, its state lost) and
a negative id silently wraps. Every entry point is fed such ids in a child process; the child must
survive and report kvlab's TokenIdError naming the position and the value.

Mutant caught: drop `check_ids` from `Model.tokenise` / `snapshots._checked` -> the child dies with
SIGSEGV (returncode < 0) or prints no TokenIdError for the negative id."""

from __future__ import annotations

import pytest
from child_attempts import run_attempts

pytestmark = pytest.mark.model

CHILD = """
    from kvlab.primitives.tokens import from_ids

    m = kv.load("tiny")
    V = m.vocab_size

    engine = kv.Engine(m, kv.RadixStore())
    attempt("engine_huge", lambda: engine.run([10**9, 5], max_tokens=1))
    attempt("engine_negative", lambda: engine.run([5, -5], max_tokens=1))
    attempt("engine_request", lambda: engine.run(kv.Request(ids=(1, V)), max_tokens=1))
    attempt("engine_tokens", lambda: engine.run(from_ids([1, 2, V + 7]), max_tokens=1))
    attempt("prefill_huge", lambda: kv.prefill(m, [1, 2, 10**9]))
    attempt("prefill_negative", lambda: kv.prefill(m, [-5, 5]))
    attempt("from_ids", lambda: from_ids([3, V], m.tokenizer))
    attempt("tokenise_ids", lambda: kv.tokenise(m, [V * 2]))
    attempt("save_missing_dir", lambda: kv.save(kv.snapshot(kv.prefill(m, [1, 2])[1], model=m),
                                                "missing/dir/x.safetensors"))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_attempts(CHILD, tmp_path_factory.mktemp("entry"))


@pytest.mark.parametrize("case, position, value", [
    ("engine_huge", 0, "1000000000"), ("engine_negative", 1, "-5"), ("engine_request", 1, "V"),
    ("engine_tokens", 2, "V+7"), ("prefill_huge", 2, "1000000000"), ("prefill_negative", 0, "-5"),
    ("from_ids", 1, "V"), ("tokenise_ids", 0, "2V")])
def test_out_of_vocabulary_ids_get_a_kvlab_error(results, case, position, value):
    v = results["vocab"]
    value = {"V": str(v), "V+7": str(v + 7), "2V": str(2 * v)}.get(value, value)
    got = results[case]
    assert got.startswith("TokenIdError: "), got
    assert f"position {position} holds id {value}" in got and f"[0, {v})" in got, got


def test_file_errors_name_the_users_path(results):
    got = results["save_missing_dir"]
    assert got.startswith("SnapshotFileError: cannot save to missing/dir/x.safetensors"), got
    assert ".kvlab-" not in got  # not the temporary file's name
