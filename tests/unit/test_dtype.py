"""Issue 20, dtype and own models without a model: which dtype a model runs in and what its repr
says, the tolerance table, snapshot refusals that say "another dtype", the Hugging Face cache
lookup's errors and the --dtype flags."""

from __future__ import annotations

import pytest

import kvlab as kv
from kvlab.cli import build_parser
from kvlab.errors import KvlabError, ModelNotFoundError
from kvlab.models import dtypes, hub
from kvlab.primitives.snapshot_files import refusal
from kvlab.primitives.tolerance import DEEP_LOGIT_TOLERANCE, LOGIT_TOLERANCE, logits_close, tolerance


def test_stored_dtype_is_kept_unless_asked(monkeypatch):
    # mutant: None -> float32 for half-precision weights (the old Linux rule) fails the first line
    monkeypatch.setattr(dtypes, "half_is_slow", lambda: False)  # a Mac or a GPU
    assert dtypes.choose("bfloat16", None) == ("bfloat16", "stored")
    assert dtypes.choose("float16", None) == ("float16", "stored")  # mutant: fp16 -> bf16 on macOS
    assert dtypes.choose("bfloat16", "float32") == ("float32", "cast from stored bfloat16, as asked")
    assert dtypes.choose("float32", "float32") == ("float32", "stored")
    assert dtypes.default_dtype() == "bfloat16"


def test_half_on_linux_cpu_says_float32_would_be_faster(monkeypatch):
    # mutant: a silent cast, or no note, on Linux CPU
    monkeypatch.setattr(dtypes, "half_is_slow", lambda: True)
    assert dtypes.choose("bfloat16", None) == ("bfloat16", 'stored; dtype="float32" runs faster on this CPU')
    assert dtypes.choose("float32", None) == ("float32", "stored")
    assert dtypes.choose("float32", None, built=True) == ("float32", "built for CPU speed")
    assert dtypes.choose("bfloat16", "bfloat16", built=True) == ("bfloat16", "built as asked")
    assert dtypes.default_dtype() == "float32"


def test_bad_dtype_names_the_choices():
    with pytest.raises(KvlabError, match="use one of float16, bfloat16, float32 or None"):
        dtypes.check_dtype("fp8")


def test_tolerance_table_keeps_float32_and_has_every_dtype():
    # mutant: a loosened float32 bound (the tests always stated 1e-4 and, on SmolLM2, 1e-3)
    assert tolerance("float32") == 1e-4 and tolerance("float32", deep=True) == 1e-3
    assert set(LOGIT_TOLERANCE) == set(DEEP_LOGIT_TOLERANCE) == set(dtypes.DTYPES)
    assert tolerance("bfloat16") == 0.125 and tolerance("float16") == 2e-2
    import mlx.core as mx

    assert tolerance(mx.bfloat16) == 0.125  # an mx dtype, as a Model's or an array's
    a = mx.array([1.0, 2.0, 3.0])
    assert logits_close(a, a + 5e-5, "float32") and not logits_close(a, a + 2e-4, "float32")
    assert logits_close(a.astype(mx.bfloat16), (a + 0.1).astype(mx.bfloat16), "bfloat16")
    with pytest.raises(KvlabError, match="no logit tolerance for dtype 'int8'"):
        tolerance("int8")


class _M:  # what refusal() reads of a model: its fingerprints and dtype
    def __init__(self, fp, dtype, content):
        self.fingerprint, self.dtype, self.content_fingerprint = fp, dtype, content


def test_snapshot_refusal_says_what_differs():
    # mutant: the dtype check dropped -> "another model" for the same model in another dtype
    f32 = _M("f" * 64, "float32", "c" * 64)
    meta = {"fingerprint": "b" * 64, "dtype": "bfloat16", "content": "c" * 64, "kv_format": "bfloat16"}
    why = refusal(meta, f32)
    assert why.startswith("was saved from this model in bfloat16, and the model you passed runs in "
                          "float32") and 'dtype="bfloat16"' in why
    assert refusal({**meta, "fingerprint": "f" * 64}, f32) == ""
    other = refusal({**meta, "content": "d" * 64}, f32)
    assert other == ("was made by model bbbbbbbbbbbb, not by the model you passed (ffffffffffff) "
                     "(bfloat16 vs float32): KV from another model is meaningless")
    # a file from before the dtype header: its KV format gives the dtype, the content is unknown
    old = refusal({"fingerprint": "b" * 64, "kv_format": "bfloat16"}, f32)
    assert "(bfloat16 vs float32)" in old and old.startswith("was made by model bbbbbbbbbbbb")


def test_repo_ids_and_cache_folders(tmp_path, monkeypatch):
    assert hub.is_repo_id("mlx-community/SmolLM2-135M-Instruct-bf16")
    assert not any(map(hub.is_repo_id, ("./x/y", "/abs/p", "a/b/c", "~/m", "../x", "plain")))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.hub_cache() == tmp_path / "c"
    snap = tmp_path / "c" / "models--mlx-community--Qwen3-0.6B-4bit" / "snapshots" / "0123abc"
    assert hub.repo_id_of(snap) == "mlx-community/Qwen3-0.6B-4bit"
    assert hub.repo_id_of(tmp_path) is None


def test_missing_repo_says_where_it_looked_and_how_to_download(tmp_path, monkeypatch):
    # mutant: a download attempt, or an error without the folder and the command
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError) as e:
        kv.load("mlx-community/not-here-4bit")
    text = str(e.value)
    assert str(tmp_path / "models--mlx-community--not-here-4bit") in text
    assert "huggingface-cli download mlx-community/not-here-4bit" in text and "never downloads" in text


def test_dtype_flags_parse():
    # mutant: --dtype missing from serve or bench, or accepting any string
    p = build_parser()
    assert p.parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert p.parse_args(["serve"]).dtype is None
    assert p.parse_args(["bench", "--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--dtype", "int8"])


def test_bench_command_line_names_the_dtype():
    from kvlab.cli.bench import command_of

    args = build_parser().parse_args(["bench", "--model", "tiny", "--dtype", "bfloat16", "--repeats", "1"])
    assert command_of(args) == "kvlab bench --model tiny --repeats 1 --dtype bfloat16"


def test_peers_cannot_follow_a_cast():
    # mutant: a benchmark comparing kvlab in float32 with peers loading the stored bf16
    with pytest.raises(KvlabError, match="runs in float32 but its folder stores bfloat16"):
        dtypes.require_stored_dtype(_Loaded("float32", "bfloat16"), "mlx_lm.server")
    dtypes.require_stored_dtype(_Loaded("bfloat16", "bfloat16"), "mlx_lm.server")


class _Loaded:
    def __init__(self, dtype, stored):
        self.name, self.dtype, self.stored_dtype = "m", dtype, stored
