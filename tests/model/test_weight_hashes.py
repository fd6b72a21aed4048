"""The weights' hashes of a model loaded from a folder are cached (run.files.layout.weight_hashes):
a second load of unchanged files reads them back instead of copying every weight to the CPU; a file
replaced under the same name, size and modification time, a model handed in (which may have been
changed in memory) and a damaged entry are hashed again."""

import os
import shutil

import pytest
import torch

import attnprobe
from attnprobe.run.files import layout


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPROBE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "hashes"


def _refuse(*args):
    raise AssertionError("hashed again")


def test_a_second_load_reads_the_hashes_and_a_handed_in_model_is_hashed(tiny_llama_dir, cache, monkeypatch):
    pm = attnprobe.load_model(str(tiny_llama_dir))
    first = layout.weight_hashes(pm, loaded_here=True)
    assert first == (layout.weights_sha(pm), layout.content_sha(pm.model)) and first[0]
    assert len(list(cache.glob("*.json"))) == 1
    again = attnprobe.load_model(str(tiny_llama_dir))
    monkeypatch.setattr(layout, "content_sha", _refuse)
    assert layout.weight_hashes(again, loaded_here=True) == first  # from the cache
    with pytest.raises(AssertionError, match="hashed again"):
        layout.weight_hashes(again)  # handed in: as it is in memory


def test_a_replaced_file_or_a_damaged_entry_is_hashed_again(tiny_llama_dir, cache, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    first = layout.weight_hashes(attnprobe.load_model(str(folder)), loaded_here=True)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    pm = attnprobe.load_model(str(folder))
    with torch.no_grad():
        next(pm.model.parameters()).add_(1.0)  # other values, the same shapes
    pm.model.save_pretrained(tmp_path / "other")
    shutil.copyfile(tmp_path / "other" / "model.safetensors", weights)  # as `cp -p` would leave it
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    replaced = layout.weight_hashes(attnprobe.load_model(str(folder)), loaded_here=True)
    assert replaced[1] != first[1] and replaced[0] != first[0]
    for entry in cache.glob("*.json"):
        entry.write_text("{not json")
    assert layout.weight_hashes(attnprobe.load_model(str(folder)), loaded_here=True) == replaced


def test_random_weights_are_hashed_once_per_config(tiny_llama_dir, cache, monkeypatch):
    spec = f"random:{tiny_llama_dir}"
    first = layout.weight_hashes(attnprobe.load_model(spec), loaded_here=True)
    assert first[1] == layout.content_sha(attnprobe.load_model(spec).model)  # the same draw
    monkeypatch.setattr(layout, "content_sha", _refuse)
    assert layout.weight_hashes(attnprobe.load_model(spec), loaded_here=True) == first
    other = attnprobe.load_model(spec, dtype="float64")
    with pytest.raises(AssertionError, match="hashed again"):
        layout.weight_hashes(other, loaded_here=True)  # another dtype: another key


def test_a_commands_own_runs_reuse_the_hashes_it_checked(tiny_llama_dir, cache, monkeypatch):
    """`edit --also` runs each suite on the model it checked: hashes_known spares a copy per run."""
    pm = attnprobe.load_model(str(tiny_llama_dir))
    known = layout.weight_hashes(pm)
    monkeypatch.setattr(layout, "content_sha", _refuse)
    with layout.hashes_known(pm, known):
        assert layout.weight_hashes(pm) == known
    with pytest.raises(AssertionError, match="hashed again"):
        layout.weight_hashes(pm)  # outside the block: as it is in memory
