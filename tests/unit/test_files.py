"""kvlab.primitives.files: an atomic write leaves the whole new content or, when it fails, the
target as it was and no temporary file beside it.

Mutant caught: drop the cleanup in atomic_write_with's except branch -> the failure tests find a
``.<name>.<random>.tmp`` left in the folder."""

from __future__ import annotations

import os

import polars as pl
import pytest

from kvlab.primitives.files import atomic_write, atomic_write_with


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_text_and_bytes_land_whole_and_alone(tmp_path):
    out = atomic_write(tmp_path / "new" / "deeper" / "a.md", "# été\n")  # parents are created
    assert out == tmp_path / "new" / "deeper" / "a.md" and out.read_bytes() == "# été\n".encode()
    assert atomic_write(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    atomic_write(tmp_path / "b.bin", b"second")  # replaces an existing file
    assert (tmp_path / "b.bin").read_bytes() == b"second"
    assert names(tmp_path) == ["b.bin", "new"] and names(tmp_path / "new" / "deeper") == ["a.md"]


def test_a_writer_callback_gets_a_temporary_sibling(tmp_path):
    frame = pl.DataFrame({"a": [1, 2, 3]})
    seen = []

    def write(tmp):
        seen.append(tmp)
        frame.write_parquet(tmp)

    out = atomic_write_with(tmp_path / "r.parquet", write)
    assert pl.read_parquet(out).equals(frame) and names(tmp_path) == ["r.parquet"]
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".r.parquet.") and seen[0].suffix == ".tmp"
    # a prefix and suffix of the caller's choosing (mx.save_safetensors insists on .safetensors)
    atomic_write_with(tmp_path / "s.safetensors", write, prefix=".kvlab-", suffix=".safetensors")
    assert seen[1].name.startswith(".kvlab-") and seen[1].name.endswith(".safetensors")
    assert names(tmp_path) == ["r.parquet", "s.safetensors"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_file_and_no_temporary(tmp_path, error):
    def half_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise error

    with pytest.raises(type(error)):
        atomic_write_with(tmp_path / "t.jsonl", half_then_fail)
    assert names(tmp_path) == []
    # over an existing file: the old content stays, still nothing beside it
    atomic_write(tmp_path / "t.jsonl", "old")
    with pytest.raises(type(error)):
        atomic_write_with(tmp_path / "t.jsonl", half_then_fail)
    assert names(tmp_path) == ["t.jsonl"] and (tmp_path / "t.jsonl").read_text() == "old"


def test_a_writer_that_removes_its_temporary_still_fails_cleanly(tmp_path):
    def remove_then_fail(tmp):
        tmp.unlink()
        raise ValueError("bad frame")

    with pytest.raises(ValueError, match="bad frame"):
        atomic_write_with(tmp_path / "x.parquet", remove_then_fail)
    assert names(tmp_path) == []


def test_a_folder_is_built_aside_and_replaces_the_old_one(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.json").write_text("{}")  # an invalid leftover

    def build(tmp):
        assert tmp.is_dir() and names(tmp) == []
        (tmp / "config.json").write_text('{"ok": 1}')

    assert atomic_write_with(target, build, folder=True) == target
    assert names(target) == ["config.json"] and names(tmp_path) == ["model"]

    def fails(tmp):
        (tmp / "weights").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write_with(tmp_path / "other", fails, folder=True)
    assert names(tmp_path) == ["model"] and names(target) == ["config.json"]


def test_temporaries_get_the_usual_permissions_not_private_ones(tmp_path):
    old = os.umask(0o022)
    try:
        out = atomic_write(tmp_path / "readme.md", "x")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644  # mkstemp would give 0o600
