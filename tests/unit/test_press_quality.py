"""The quality battery's pieces without a model: generated tasks (needle depth, fillers, decoys,
paraphrase, variable chains), the teacher-forced comparison and the baseline gate.

Mutants caught (each run, each fails here): KL taken the other way round, KL(Q || P); accuracy
counted over every question instead of those the baseline answers; a needle inserted at the end
whatever its depth.
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import math

import mlx.core as mx
import pytest

from kvlab.presses import tasks
from kvlab.presses.quality import compare, gated


def test_compare_is_kl_of_full_against_compressed_and_nll_change():
    p, q = mx.array([[math.log(0.9), math.log(0.1)]]), mx.array([[math.log(0.4), math.log(0.6)]])
    got = compare(p, q, [1])
    assert got["kl"] == pytest.approx(0.9 * math.log(0.9 / 0.4) + 0.1 * math.log(0.1 / 0.6), abs=1e-6)
    assert got["delta_nll"] == pytest.approx(-math.log(0.6) + math.log(0.1), abs=1e-6)  # NLL_Q - NLL_P
    assert got["top1"] == 0.0 and compare(p, p, [0]) == {"kl": 0.0, "top1": 1.0, "delta_nll": 0.0}


def test_accuracy_counts_only_what_the_baseline_answers():
    assert gated([True, False, True, False], [False, True, True, True]) == (0.5, 0.5)
    assert gated([False, False], [True, True]) == (None, 0.0)
    assert gated([], []) == (None, None)


def test_needles_sit_at_their_depth_with_decoys_and_paraphrases():
    for depth in (0.1, 0.5, 0.9):
        t = tasks.needle(words=300, depth=depth, seed=3)
        at = t.context.index("The secret code for")
        assert abs(at / len(t.context) - depth) < 0.1
        assert t.questions[0].answer in t.context
    decoyed = tasks.needle(words=300, decoys=2, seed=4)
    assert decoyed.context.count("The secret code for") == 3
    para = tasks.needle(words=120, paraphrased=True, seed=5).questions[0]
    assert "secret code" not in para.text and para.prefix.startswith("The secret code for")
    rep = tasks.needle(words=120, filler="repetitive", seed=6).context
    assert rep.count("The grass is green.") >= 4


def test_multikey_asks_every_key_and_variable_tracking_chains_to_the_value():
    mk = tasks.multikey(words=200, keys=4, seed=1)
    assert len(mk.questions) == 4 and all(q.answer in mk.context for q in mk.questions)
    vt = tasks.variable_tracking(words=200, chain=4, seed=2)
    assert "VAR A = " + vt.questions[0].answer in vt.context and "VAR D = VAR C." in vt.context
    assert "VAR D" in vt.questions[0].text
    assert [t.meta["filler"] for t in tasks.suite("vt", 2, words=50)] == ["repetitive", "heterogeneous"]
    with pytest.raises(ValueError, match="needle, multikey or vt"):
        tasks.suite("ruler", 1)
