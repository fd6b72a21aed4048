"""Long documents: chunked reading of attention rows (longdoc), verify in blocks of rows
(verify_long), `ap.probe` and `attnprobe probe` on texts past one chunk."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import VOCAB
from tiny_families import build

import attnprobe
from attnprobe.cli import main
from attnprobe.errors import CaptureError
from attnprobe.forward.longdoc import layer_masks, read_rows
from attnprobe.model import from_pretrained_objects
from attnprobe.verify import reference as ref
from attnprobe.verify.long import verify_long

# float32: the chunked forward sums keys in another order than one forward of the whole text;
# measured differences are below 2e-6 on 4,200 tokens (11 families).
TOLERANCE = 1e-5


class _Ids:
    """A tokenizer stand-in: these tests pass token ids, never text."""

    pad_token, pad_token_id, padding_side = "<pad>", 0, "right"


def _tiny(name: str, **overrides):
    model = build(name, max_position_embeddings=8192, **overrides)
    return from_pretrained_objects(model, _Ids(), name)


def _random_ids(T: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (T,), generator=torch.Generator().manual_seed(0))


def _eager_rows(pm, ids, rows) -> dict[int, torch.Tensor]:
    pm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = pm.model(input_ids=ids[None], output_attentions=True, use_cache=False)
    finally:
        attnprobe.attention.capture.enable(pm.model)
    return {layer: w[0][:, rows] for layer, w in enumerate(out.attentions)}  # (H, R, T)


def test_rows_of_a_4k_text_equal_eager_on_windowed_and_global_layers():
    pm = _tiny("gemma3_text", sliding_window=64)
    assert [(k.window, k.chunk) for k in layer_masks(pm)] == [(64, None), (None, None)]
    T = 4200
    ids = _random_ids(T)
    rows = [0, 5, 63, 64, 499, 500, 2047, 4000, T - 1]  # across the window and the chunk seams
    got = read_rows(pm, ids, rows, chunk=500)
    expected = _eager_rows(pm, ids, rows)
    for layer in (0, 1):
        assert got[layer].shape == (4, len(rows), T)
        assert (got[layer] - expected[layer]).abs().max() <= TOLERANCE
        assert torch.allclose(got[layer].sum(-1), torch.ones(4, len(rows)), atol=1e-5)
    # the sliding layer sees 64 keys, the global one all of them
    last = got[0][:, -1]
    assert last[:, : T - 64].abs().max() == 0 and (last[:, T - 64 :] > 0).all()
    assert (got[1][:, -1] > 0).all()


def test_chunked_attention_layers_and_a_wrong_window_is_caught():
    pm = _tiny("llama4_text", attention_chunk_size=128)
    assert any(k.chunk == 128 for k in layer_masks(pm))
    ids, rows = _random_ids(700), [127, 128, 300, 699]
    got = read_rows(pm, ids, rows, chunk=250)
    expected = _eager_rows(pm, ids, rows)
    assert max((got[layer] - expected[layer]).abs().max() for layer in got) <= TOLERANCE
    # the comparison can fail: a sliding window one key too wide differs from eager
    pm = _tiny("gemma3_text", sliding_window=64)
    ids, rows = _random_ids(300), [200, 299]
    expected = _eager_rows(pm, ids, rows)
    original = pm.model.config.get_text_config().sliding_window
    pm.model.config.get_text_config().sliding_window = original + 1
    wrong = read_rows(pm, ids, rows, chunk=100)
    assert (wrong[0] - expected[0]).abs().max() > 1e-3


def test_long_reads_are_refused_in_one_line_before_running():
    pm = _tiny("gemma3_text", sliding_window=64)
    with pytest.raises(CaptureError, match=r"needs about .* GiB .* available; ask for fewer rows"):
        read_rows(pm, _random_ids(4000), [3999], available=1000)
    with pytest.raises(CaptureError, match="more than the model's context of 8,192"):
        read_rows(pm, _random_ids(8193), [0])
    with pytest.raises(CaptureError, match=r"rows must be query positions in \[0, 10\)"):
        read_rows(pm, _random_ids(10), [10])


def test_verify_in_blocks_passes_and_catches_a_window_off_by_one(monkeypatch):
    pm = _tiny("gemma3_text", sliding_window=64)
    table = verify_long(pm, _random_ids(1500), block=200)
    assert table["passed"].all() and len(table) == 2 and (table["max_tokens"] == 1500).all()
    assert table["max_dweights_capture"].max() <= 1e-5 and table["max_doutput_capture"].max() <= 1e-5
    original = ref.local_mask
    monkeypatch.setattr(
        ref, "local_mask", lambda T, S=None, window=1, device=None: original(T, S, window + 1, device)
    )
    broken = verify_long(pm, _random_ids(1500), block=200)
    assert not broken["passed"].iloc[0] and broken["passed"].iloc[1]  # the sliding layer fails


def _document(words: int) -> str:
    body = " ".join(["The committee met again and the notes were read aloud."] * words)
    return f"[The nurse] arrived early. {body} Later that day [she] left."


def test_probe_reads_a_long_text_in_chunks_as_it_reads_it_whole(tiny_llama_dir):
    pm = attnprobe.load_model(str(tiny_llama_dir))
    text = _document(120)  # about 1,450 tokens
    whole = attnprobe.probe(pm, [text], long_tokens=10**6)
    chunked = attnprobe.probe(pm, [text], long_tokens=100)
    assert len(whole) == len(chunked) and whole["position"].max() > 1000
    assert (whole["weight"] - chunked["weight"]).abs().max() <= TOLERANCE
    assert (whole.drop(columns="weight") == chunked.drop(columns="weight")).all().all()


def test_probe_command_on_a_text_file(tiny_llama_dir, tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(_document(120))
    out = tmp_path / "rows.csv"
    result = CliRunner().invoke(main, ["probe", str(path), "--model", str(tiny_llama_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "read in chunks of 1,024" in result.output and "GiB besides the model" in result.output
    table = pd.read_csv(out)
    assert set(table["span"].dropna()) == {"span1", "span2"} and (table["source"] == "span2").all()
    sums = table.groupby(["layer", "head"])["weight"].sum()
    assert len(sums) == 4 and ((sums - 1).abs() < 1e-5).all()  # 2 layers x 2 heads, rows sum to 1
    (tmp_path / "plain.txt").write_text("No brackets here.")
    bad = CliRunner().invoke(main, ["probe", str(tmp_path / "plain.txt"), "--model", str(tiny_llama_dir)])
    assert bad.exit_code == 2 and "mark the source span with [brackets]" in bad.output
    assert "Traceback" not in bad.output and len(bad.output.strip().splitlines()) == 1


def test_verify_command_long_goes_to_blocks(tiny_llama_dir):
    result = CliRunner().invoke(main, ["verify", "--model", str(tiny_llama_dir), "--long", "1100"])
    assert result.exit_code == 0, result.output
    assert "one of 1,100 tokens in blocks of 256 rows" in result.output
