"""Captured weights equal transformers' eager attention of each prompt run alone."""

import pytest
import torch
from conftest import INTERFACE_FAMILIES, TINY_CONFIGS, build_tiny, eager_twin, padded_batch

from attnprobe.attention.capture import run_with_capture
from attnprobe.errors import CaptureError

# fp32 eager vs our float32 recomputation differ only by matmul summation order (~1e-7).
TOL = 1e-5
LENGTHS = [9, 6, 3, 1]


def eager_alone(twin, ids, mask, b):
    length = int(mask[b].sum())
    with torch.no_grad():
        out = twin(input_ids=ids[b : b + 1, :length], output_attentions=True)
    return [a[0] for a in out.attentions], length  # per layer (H, L, L)


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_all_rows_match_eager_alone(family):
    model = build_tiny(family)
    ids, mask = padded_batch(LENGTHS)
    captured = run_with_capture(model, ids, mask)
    twin = eager_twin(model)
    for b in range(len(LENGTHS)):
        reference, length = eager_alone(twin, ids, mask, b)
        for layer, expected in enumerate(reference):
            got = captured.weights[layer][b]  # (H, T, S)
            assert (got[:, :length, :length] - expected).abs().max() <= TOL
            # rows sum to one and put no weight on padding or on the future
            assert torch.allclose(got[:, :length].sum(-1), torch.ones(()), atol=TOL)
            assert got[:, :length, length:].abs().max() == 0 if length < ids.shape[1] else True
            assert torch.triu(got[:, :length, :length], diagonal=1).abs().max() == 0


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_selected_rows_and_layers(family):
    model = build_tiny(family)
    ids, mask = padded_batch(LENGTHS)
    rows = torch.tensor([[8, 2], [5, 0], [2, 1], [0, 0]])  # each item's rows lie inside its own length
    captured = run_with_capture(model, ids, mask, rows=rows, layers=[1])
    assert set(captured.weights) == {1}
    twin = eager_twin(model)
    for b in range(len(LENGTHS)):
        reference, length = eager_alone(twin, ids, mask, b)
        got = captured.weights[1][b]  # (H, R, S)
        for r, row in enumerate(rows[b].tolist()):
            assert (got[:, r, :length] - reference[1][:, row]).abs().max() <= TOL
            assert got[:, r, length:].abs().max() == 0 if length < ids.shape[1] else True


@pytest.mark.parametrize("family", INTERFACE_FAMILIES)
def test_outputs_equal_eager_model(family):
    """The registered function changes only what is recorded, not what the model computes."""
    model = build_tiny(family)
    ids, mask = padded_batch(LENGTHS)
    captured = run_with_capture(model, ids, mask, logit_positions=torch.arange(ids.shape[1]))
    with torch.no_grad():
        eager_logits = eager_twin(model)(input_ids=ids, attention_mask=mask).logits
    for b, length in enumerate(LENGTHS):
        # SDPA and eager sum in different orders; logits of a 2-layer fp32 model agree to ~1e-6.
        assert (captured.logits[b, :length] - eager_logits[b, :length]).abs().max() <= 1e-4


def test_result_does_not_depend_on_batch_neighbours():
    model = build_tiny("llama")
    ids, mask = padded_batch([9, 6, 3])
    alone = run_with_capture(model, ids[1:2, :6], mask[1:2, :6])
    batched = run_with_capture(model, ids, mask)
    for layer in alone.weights:
        assert (batched.weights[layer][1, :, :6, :6] - alone.weights[layer][0]).abs().max() <= 1e-6


def test_bfloat16_model_records_float32_weights():
    model = build_tiny("llama", dtype=torch.bfloat16)
    ids, mask = padded_batch([7, 4])
    captured = run_with_capture(model, ids, mask, rows=torch.tensor([[6], [3]]))
    assert captured.weights[0].dtype == torch.float32
    assert torch.allclose(captured.weights[0][0].sum(-1), torch.ones(()), atol=1e-6)


def test_weights_stay_float32_under_autocast():
    """Under torch.autocast the q.k products of the recorded rows still run in float32."""
    from attnprobe.attention.capture import attention_weights

    generator = torch.Generator().manual_seed(0)
    query, key = (
        torch.randn(2, 4, 3, 16, generator=generator) * 4,
        torch.randn(2, 2, 7, 16, generator=generator) * 4,
    )
    plain = attention_weights(query, key, None, 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = attention_weights(query, key, None, 0.25)
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


def test_rows_outside_the_batch_are_refused():
    model = build_tiny("llama")
    ids, mask = padded_batch([5, 3])
    with pytest.raises(CaptureError, match=r"rows must lie in \[0, 5\)"):
        run_with_capture(model, ids, mask, rows=torch.tensor([[5], [0]]))
    with pytest.raises(CaptureError, match="shape"):
        run_with_capture(model, ids, mask, rows=torch.tensor([1, 2]))


@pytest.mark.slow
def test_smollm_padded_batch_matches_eager_alone(smollm):
    tok = smollm.tokenizer
    texts = ["The nurse said that she would be late.", "The engineer told the clerk that he", "Hi"]
    enc = tok(texts, return_tensors="pt", padding=True)
    lengths = enc["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) == 3  # really padded
    rows = torch.tensor([[length - 1, 0] for length in lengths])
    captured = run_with_capture(smollm, enc["input_ids"], enc["attention_mask"], rows=rows)
    smollm.model.set_attn_implementation("eager")
    try:
        for b, length in enumerate(lengths):
            with torch.no_grad():
                out = smollm.model(input_ids=enc["input_ids"][b : b + 1, :length], output_attentions=True)
            for layer in range(smollm.info.n_layers):
                expected = out.attentions[layer][0][:, rows[b]]  # (H, R, L)
                got = captured.weights[layer][b]
                assert (got[:, :, :length] - expected).abs().max() <= TOL
                assert got[:, :, length:].abs().max() == 0 if length < enc["input_ids"].shape[1] else True
    finally:
        smollm.model.set_attn_implementation("attnprobe")
