"""`kvlab press --json`: exactly the issue's keys, and values that mean what they say: at ratio 0 the
compressed cache is the uncompressed one (KL 0, top-1 1, ΔNLL 0, all bytes kept); at 0.5 half the
bytes and a positive KL; a task the uncompressed model cannot solve gives no gated accuracy.

Mutant caught (run, fails here): the battery comparing the compressed cache with itself (KL 0 at
every ratio).
"""

import json

import pytest

from kvlab.cli import main
from kvlab.presses.battery import KEYS

pytestmark = pytest.mark.model


def run(capsys, *args) -> dict:
    assert main(["press", "--model", "tiny", *args, "--decode-tokens", "4", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_press_json_has_the_issue_keys_and_honest_values(capsys):
    zero = run(capsys, "--press", "knorm", "--ratio", "0", "--task", "kl", "--tokens", "160")
    assert list(zero) == list(KEYS) == ["press", "ratio", "tokens", "kept_tokens", "bytes_full", "bytes_kept", "kl",
                                        "top1", "delta_nll", "accuracy", "baseline_accuracy", "prefill_s",
                                        "compress_s", "decode_tok_s_full", "decode_tok_s_kept"]
    assert (zero["kl"], zero["top1"], zero["delta_nll"]) == (0.0, 1.0, 0.0)
    assert zero["tokens"] == zero["kept_tokens"] == 160 and zero["bytes_kept"] == zero["bytes_full"]
    assert zero["accuracy"] is None and zero["decode_tok_s_full"] > 0 and zero["decode_tok_s_kept"] > 0
    half = run(capsys, "--press", "snapkv", "--ratio", "0.5", "--task", "kl", "--tokens", "160")
    assert half["kept_tokens"] == 80 and half["bytes_kept"] * 2 == half["bytes_full"] and half["kl"] > 0
    needle = run(capsys, "--press", "streaming_llm", "--ratio", "0.5", "--task", "needle", "--tokens", "120",
                 "--n", "1")
    assert needle["kl"] is None and needle["baseline_accuracy"] == 0.0 and needle["accuracy"] is None
