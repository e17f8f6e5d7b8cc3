"""Issue 20 on the tiny model: a half-precision folder keeps its dtype (weights and KV), a cast is
asked for and said, a bf16 snapshot is refused by the same model in float32 as "another dtype",
a Hugging Face cache repo id loads offline under its repo id, and a benchmark against peers refuses
a dtype they cannot run."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import kvlab as kv
from kvlab.errors import KvlabError, SnapshotError
from kvlab.models import dtypes
from kvlab.primitives.statefile import digest

import mlx.core as mx  # noqa: E402  (after kvlab: OpenBLAS first)

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory, tiny):
    """The tiny model's folder with its weights stored in bfloat16 (no kvlab manifest: a user's)."""
    out = tmp_path_factory.mktemp("models") / "tiny-bf16"
    shutil.copytree(tiny.path, out, ignore=shutil.ignore_patterns("kvlab.json", "model*.safetensors"))
    for w in tiny.path.glob("model*.safetensors"):
        mx.save_safetensors(str(out / w.name), {k: v.astype(mx.bfloat16) for k, v in mx.load(str(w)).items()},
                            {"format": "mlx"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return out


def test_a_bf16_folder_loads_and_caches_in_bf16(bf16_folder):
    # mutant: cast(None) -> float32 for half weights (the old Linux rule): dtype and KV are float32
    m = kv.load(bf16_folder)
    assert (m.dtype, m.stored_dtype) == ("bfloat16", "bfloat16")
    assert m.module.model.embed_tokens.weight.dtype == mx.bfloat16
    _, cache = kv.prefill(m, list(range(1, 20)))
    assert {c.state[0].dtype for c in cache} == {mx.bfloat16}  # KV bytes are what mlx-lm holds
    if dtypes.half_is_slow():  # Linux CPU: said, not done
        assert 'bfloat16 (stored; dtype="float32" runs faster on this CPU)' in repr(m)


def test_asking_for_float32_casts_and_the_repr_says_so(bf16_folder):
    # mutant: dtype= ignored for a folder, or the note dropped from repr / _repr_html_
    half, full = kv.load(bf16_folder), kv.load(bf16_folder, dtype="float32")
    assert (full.dtype, full.stored_dtype) == ("float32", "bfloat16")
    assert "float32 (cast from stored bfloat16, as asked)" in repr(full)
    assert "float32 (cast from stored bfloat16, as asked)" in full._repr_html_()
    assert full.module.model.embed_tokens.weight.dtype == mx.float32
    assert full.fingerprint != half.fingerprint and full.content_fingerprint == half.content_fingerprint


def test_a_bf16_snapshot_is_refused_as_another_dtype(bf16_folder, tiny, tmp_path):
    # mutant: refusal without the dtype check -> "made by model" for the same model in float32
    half, full = kv.load(bf16_folder), kv.load(bf16_folder, dtype="float32")
    ids = list(range(1, 33))
    _, cache = kv.prefill(half, ids)
    path = kv.save(kv.snapshot(cache, tokens=ids, model=half), tmp_path / "s.safetensors", model=half)
    assert kv.load_snapshot(path, half).offset == 32
    with pytest.raises(SnapshotError, match="saved from this model in bfloat16, and the model you passed "
                                            "runs in float32.*dtype=\"bfloat16\""):
        kv.load_snapshot(path, full)
    with pytest.raises(SnapshotError, match="was made by model .*KV from another model"):
        kv.load_snapshot(path, tiny)  # float32 too, but other weights: another model
    # a file written before the dtype header (no dtype, no content) still loads into its model
    arrays, meta = mx.load(str(path), return_metadata=True)
    old = {k: v for k, v in meta.items() if k not in ("dtype", "content", "digest")}
    old["digest"] = digest(arrays, json.dumps(old, sort_keys=True))
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, old)
    assert kv.load_snapshot(tmp_path / "old.safetensors", half).token_ids == tuple(ids)
    with pytest.raises(SnapshotError, match=r"\(bfloat16 vs float32\)"):
        kv.load_snapshot(tmp_path / "old.safetensors", full)


def fake_hub(root, repo_id, folder):
    """A Hugging Face cache layout (refs/main -> snapshots/<commit>/ of symlinks into blobs/)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / "3f2a9c0d1e"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("3f2a9c0d1e")
    for f in folder.iterdir():
        if f.is_file() and f.name != "kvlab.json":
            blob = repo / "blobs" / f"blob-{f.name}"
            shutil.copy(f, blob)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


def test_a_repo_id_loads_from_the_hf_cache_offline(tiny, tmp_path, monkeypatch):
    # mutant: repo ids not looked up (ModelNotFoundError), or named by the commit hash
    snap = fake_hub(tmp_path / "hub", "mlx-community/tiny-qwen3-test", tiny.path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = kv.load("mlx-community/tiny-qwen3-test")
    assert m.name == "mlx-community/tiny-qwen3-test" and m.path == snap.resolve()
    assert m.fingerprint == tiny.fingerprint  # the same bytes as the folder loaded directly
    assert kv.load(snap).name == "mlx-community/tiny-qwen3-test"  # the snapshot path itself


def test_bench_refuses_a_dtype_the_peers_cannot_run(tiny):
    # mutant: the check dropped -> kvlab serve in bf16 measured against peers in float32
    from kvlab.bench import run
    from kvlab.bench.serving import servers_for

    with pytest.raises(KvlabError, match="tiny runs in bfloat16 but its folder stores float32"):
        run("tiny", 1, only=["serving"], dtype="bfloat16")
    with pytest.raises(KvlabError, match="runs in bfloat16 but its folder stores float32"):
        servers_for(kv.load("tiny", dtype="bfloat16"))
    # the stored dtype: every kvlab serve is told it explicitly
    assert {n: f.keywords for n, f in servers_for(tiny).items() if n.startswith("kvlab serve")} == {
        f"kvlab serve {s}": {"dtype": "float32"} for s in ("radix", "paged", "system", "mlx-lru")}
