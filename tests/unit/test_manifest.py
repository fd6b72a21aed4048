"""The manifest's one reader: typed fields, measures' entries kept in place, damage in one line."""

import json

import pytest

from attnprobe.errors import RunError
from attnprobe.run.files.manifest import FORMAT, Manifest

RAW = {
    "format": FORMAT,
    "fingerprint": "f" * 64,
    "status": "complete",
    "shard": None,
    "suite": {"name": "gender", "path": "/p/gender.yaml", "sha256": "s" * 64, "templates": {"t0": "The {x}"}},
    "analysis": {"contrast": "pronoun_label"},
    "model": {"spec": "smollm2-135m", "n_layers": 30, "n_heads": 9, "trust_remote_code": False},
    "edits": [],
    "dtype": "float32",
    "seed": 0,
    "settings": {"limit": 10},
    "versions": {"attnprobe": "0.5"},
    "n_prompts": 10,
    "n_chunks": 1,
    "prefix_sharing": {"shared": True},
    "skipped": [],
    "notes": ["a note"],
    "head_effects": {"n_items": 4, "seconds": 1.5},  # a measure's entries
    "n_effect_chunks": 1,
    "started": "2026-11-27T00:00:00+0000",
    "finished": "2026-11-27T00:01:00+0000",
}


def test_a_manifest_round_trips_and_keeps_its_measures_entries(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(RAW))
    m = Manifest.read(tmp_path / "manifest.json")
    assert (m.model.spec, m.model.n_heads, m.suite.templates, m.n_prompts) == (
        "smollm2-135m",
        9,
        {"t0": "The {x}"},
        10,
    )
    assert m.entry("head_effects") == {"n_items": 4, "seconds": 1.5} and m.entry("likelihood", "-") == "-"
    back = m.to_dict()
    assert set(back) == set(RAW)  # the same keys at the top; the records write every field they name
    for key, value in RAW.items():
        kept = {k: back[key][k] for k in value} if key in ("suite", "model") else back[key]
        assert kept == value, key
    assert back["model"]["source"] is None and Manifest.from_dict(back, tmp_path) == m


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda r: r["suite"].update(sha256=12), "suite.sha256 is missing or not a str"),
        (lambda r: r["model"].update(n_layers="30"), "model.n_layers is missing or not a int"),
        (lambda r: r["model"].update(n_layers=True), "model.n_layers is missing or not a int"),
        (lambda r: r.update(notes="a note"), "notes is missing or not a list"),
        (lambda r: r.update(model=[1]), "model is not an object"),
    ],
)
def test_a_field_of_the_wrong_type_is_one_line(tmp_path, damage, named):
    raw = json.loads(json.dumps(RAW))
    damage(raw)
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(RunError, match=f"manifest.json: {named}") as caught:
        Manifest.read(tmp_path / "manifest.json")
    assert "\n" not in str(caught.value)


def test_a_missing_field_a_reader_needs_is_one_line(tmp_path):
    raw = json.loads(json.dumps(RAW))
    del raw["suite"]["sha256"]
    m = Manifest.from_dict(raw, tmp_path)
    m.require("suite.name", "model.spec", where=tmp_path)
    with pytest.raises(RunError, match="suite.sha256 is missing or not a str; the manifest is damaged"):
        m.require("suite.name", "suite.sha256", where=tmp_path)
