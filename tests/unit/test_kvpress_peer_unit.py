"""kvpress_peer without kvpress: bad cases are refused before any subprocess, a CUDA torch is
refused with what to install, and agreement/explain on hand-made kept sets."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from kvlab.cli import main
from kvlab.errors import KvlabError, PeerError
from kvlab.presses import kvpress_peer as kp


def test_bad_cases_are_refused_with_the_fix():
    with pytest.raises(KvlabError, match="no peer for press 'h2o'; known: streaming_llm, knorm, snapkv"):
        kp.Case([1, 2, 3], "h2o", 0.5)
    with pytest.raises(KvlabError, match=r"ratio 1 is outside \[0, 1\)"):
        kp.Case([1, 2, 3], "knorm", 1)
    with pytest.raises(KvlabError, match="SnapKVPress has no option window; it takes window_size, kernel_size"):
        kp.Case([1, 2, 3], "snapkv", 0.5, {"window": 32})
    with pytest.raises(KvlabError, match="KnormPress has no option n_sink; it takes none"):
        kp.kept_positions([1, 2, 3], "knorm", 0.5, n_sink=2)  # refused before the venv is touched


def test_a_case_asks_kvpress_for_kvlabs_settings():
    # mutant: snapkv's window and pooling not passed (kvpress's defaults happen to match today,
    # so the request itself is checked)
    req = kp.Case(range(10), "snapkv", 0.25, {"kernel_size": 7}).request()
    assert req == {"ids": list(range(10)), "press": "SnapKVPress", "ratio": 0.25,
                   "options": {"window_size": 64, "kernel_size": 7}, "attn": "sdpa", "verify": False}
    assert kp.Case([1, 2], "observed_attention", 0.5).request()["attn"] == "eager"
    assert kp.Case([1, 2], "streaming_llm", 0.5).request()["options"] == {"n_sink": 4}
    assert set(kp.names()) >= {"streaming_llm", "knorm", "snapkv", "expected_attention", "tova"}


def test_only_a_cpu_torch_is_installed(monkeypatch, tmp_path):
    # mutant: any torch accepted -> on Linux pip pulls the CUDA build (gigabytes) into the venv
    assert kp.cpu_torch_problem("2.13.0+cpu", "linux") == ""
    assert kp.cpu_torch_problem("2.13.0", "darwin") == ""
    assert "not a CPU build" in kp.cpu_torch_problem("2.13.0", "linux")

    # a venv that already holds PyPI's plain (CUDA) torch on Linux: refused, naming the fix
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, stdout="2.13.0\n", stderr="")
    monkeypatch.setattr(kp.subprocess, "run", fake_run)
    monkeypatch.setattr(kp.sys, "platform", "linux")
    with pytest.raises(PeerError, match=r"needs a CPU build of torch 2\.13\.0: pip would install torch "
                                         r"2\.13\.0, not a CPU build.*--index-url"):
        kp._torch_to_install(tmp_path)


def test_kvpress_is_not_a_server(capsys):
    # mutant: `kvlab peer kvpress` falls through to starting a server that does not exist
    assert main(["peer", "kvpress"]) == 2
    assert "kvpress is not a server: `kvlab peer kvpress --install`" in capsys.readouterr().err


def _peer(kept, scores, ratio=0.5):
    case = kp.Case(range(scores[0].shape[1]), "knorm", ratio)
    meta = {"versions": {"kvpress": "0.5.5"}, "dtype": "float32"}
    return kp.PeerKept(case, kept, scores, None, meta)


def test_agreement_explain_and_summary():
    # mutants: Jaccard over one side's set instead of the union; explain calling a far swap a tie
    scores = [np.array([[9.0, 1.0, 5.0, 5.0 + 1e-7, 0.0, 7.0]] * 2), None]
    theirs = _peer([np.array([[0, 3, 5], [0, 3, 5]], np.int32), None], scores)
    # head 0: a near-tie swap (2 for 3); head 1: a far swap (4, score 0, for 0, score 9)
    ours = [np.array([[0, 2, 5, -1], [3, 4, 5, -1]]), None]  # -1: a pad, not a position
    frame = kp.agreement(ours, theirs)
    assert frame.select("layer", "head", "exact", "only_ours").rows() == [(0, 0, False, 1), (0, 1, False, 1)]
    assert frame["jaccard"].to_list() == [0.5, 0.5]
    why = kp.explain(ours, theirs)
    assert why["verdict"].to_list() == ["near_tie", "differs"]
    assert why["only_ours"].to_list() == [[2], [4]] and why["only_theirs"].to_list() == [[3], [0]]
    # kvpress kept 0 (9) over its best dropped (5); it dropped 4 (0) under its worst kept (5 + 1e-7)
    assert why["gap_theirs"][1] == pytest.approx(5.0 + 1e-7)
    assert kp.summary(frame) == "agreement: 0 of 2 heads exact over 1 layers; Jaccard min 0.500, mean 0.500"
    assert kp.summary(kp.agreement(theirs, theirs)).startswith("agreement: 2 of 2 heads exact")
    # a layer only one side compressed: no counts on the other side, never exact
    one_sided = kp.agreement([None, None], theirs)
    assert one_sided["n_ours"].is_null().all() and not one_sided["exact"].any()
    with pytest.raises(KvlabError, match="ours has 1 layers and theirs 2"):
        kp.agreement(ours[:1], theirs)
    # margins: last kept minus first dropped (5 + 1e-7 vs 5), relative to the median |score|
    m = theirs.margins()
    assert m.height == 2 and m["margin"][0] == pytest.approx(1e-7, abs=1e-12)
    assert "KnormPress knorm ratio 0.5: 6 tokens -> 3 per head" in repr(theirs)
