"""Properties of the from-scratch attention, and agreement with torch on random inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnprobe.verify import reference as ref


def randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_masked_softmax_one_length_per_item():
    scores = randn(2, 3, 5)
    weights = ref.masked_softmax(scores, torch.tensor([2, 5]))
    assert torch.all(weights[0, :, 2:] == 0)  # exactly zero, not tiny
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3, dtype=scores.dtype))
    assert torch.allclose(weights[0, :, :2], torch.softmax(scores[0, :, :2], -1))


def test_masked_softmax_one_length_per_query_and_empty_rows():
    scores = randn(1, 2, 3, 4)  # with a heads axis
    lens = torch.tensor([[1, 0, 4]])
    weights = ref.masked_softmax(scores, lens)
    assert torch.all(weights[0, :, 0, 1:] == 0) and torch.allclose(
        weights[0, :, 0, 0], torch.ones(2, dtype=scores.dtype)
    )
    assert torch.all(weights[0, :, 1] == 0)  # no valid key: all zero, no NaN
    assert torch.allclose(weights[0, :, 2], torch.softmax(scores[0, :, 2], -1))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("case", ["plain", "causal", "bool", "additive", "gqa", "scale"])
def test_sdpa_agrees_with_torch(dtype, tol, case):
    B, H, Hkv, T, S, D = 2, 4, 2 if case == "gqa" else 4, 5, 5 if case == "causal" else 7, 8
    q, k, v = (
        randn(B, H, T, D, dtype=dtype, seed=1),
        randn(B, Hkv, S, D, dtype=dtype, seed=2),
        randn(B, Hkv, S, D, dtype=dtype, seed=3),
    )
    kwargs = {}
    if case == "causal":
        kwargs["is_causal"] = True
    if case == "bool":
        kwargs["attn_mask"] = randn(B, 1, T, S, seed=4) > -0.5
        kwargs["attn_mask"][..., 0] = True  # no empty rows: torch gives NaN there, we give 0
    if case == "additive":
        kwargs["attn_mask"] = randn(B, H, T, S, dtype=dtype, seed=5)
    if case == "gqa":
        kwargs["enable_gqa"] = True
    if case == "scale":
        kwargs["scale"] = 0.37
    ours, weights = ref.scaled_dot_product_attention(q, k, v, **kwargs)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert (ours - theirs).abs().max() <= tol
    assert torch.allclose(weights.sum(-1), torch.ones((), dtype=dtype), atol=tol)
    if case == "bool":
        assert torch.all(weights[~kwargs["attn_mask"].expand_as(weights)] == 0)
    if case == "causal":
        assert torch.all(torch.triu(weights, diagonal=1) == 0)


def test_sdpa_refuses_mask_and_causal_together_and_missing_gqa_flag():
    q = randn(1, 4, 3, 2)
    with pytest.raises(ValueError, match="either"):
        ref.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True
        )
    with pytest.raises(ValueError, match="enable_gqa"):
        ref.scaled_dot_product_attention(q, q[:, :2], q[:, :2])


def test_dropout_keeps_expectation():
    q, k, v = randn(1, 1, 1, 4), randn(1, 1, 64, 4, seed=1), torch.ones(1, 1, 64, 1, dtype=torch.float64)
    outs = [
        ref.scaled_dot_product_attention(q, k, v, dropout_p=0.3, generator=torch.Generator().manual_seed(i))[
            0
        ].item()
        for i in range(400)
    ]
    # E[output] = sum of weights = 1; 400 draws put the mean within a few standard errors of it.
    assert abs(sum(outs) / len(outs) - 1.0) < 0.05


def test_output_invariant_to_joint_key_value_permutation_and_equivariant_to_queries():
    q, k, v = randn(2, 3, 5, 4, seed=1), randn(2, 3, 6, 4, seed=2), randn(2, 3, 6, 4, seed=3)
    out, weights = ref.scaled_dot_product_attention(q, k, v)
    perm_kv, perm_q = torch.randperm(6), torch.randperm(5)
    out_kv, weights_kv = ref.scaled_dot_product_attention(q, k[:, :, perm_kv], v[:, :, perm_kv])
    assert torch.allclose(out_kv, out, atol=1e-12)
    assert torch.allclose(weights_kv, weights[..., perm_kv], atol=1e-12)
    out_q, _ = ref.scaled_dot_product_attention(q[:, :, perm_q], k, v)
    assert torch.allclose(out_q, out[:, :, perm_q], atol=1e-12)


def test_masks():
    causal = ref.causal_mask(3, 5)  # the last 3 of 5 positions query
    assert causal.tolist() == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    local = ref.local_mask(5, window=1)
    assert local[2].tolist() == [False, True, True, True, False]  # |i - j| <= 1
    padding = ref.padding_mask(torch.tensor([2, 4]), 4)
    assert padding.shape == (2, 1, 1, 4) and padding[0, 0, 0].tolist() == [True, True, False, False]


def test_additive_attention_by_hand():
    q, k, v = randn(1, 2, 3, seed=1), randn(1, 4, 5, seed=2), randn(1, 4, 6, seed=3)
    w_q, w_k, w_v = randn(7, 3, seed=4), randn(7, 5, seed=5), randn(7, seed=6)
    out, weights = ref.additive_attention(q, k, v, w_q, w_k, w_v, valid_lens=torch.tensor([3]))
    t = 1
    scores = torch.tensor(
        [float(w_v @ torch.tanh(w_q @ q[0, t] + w_k @ k[0, s])) for s in range(3)], dtype=torch.float64
    )
    expected = torch.softmax(scores, 0)
    assert torch.allclose(weights[0, t, :3], expected, atol=1e-12) and weights[0, t, 3] == 0
    assert torch.allclose(out[0, t], expected @ v[0, :3], atol=1e-12)


def test_multi_head_attention_equals_torch_module():
    torch.manual_seed(0)
    E, H, T = 12, 3, 5
    module = torch.nn.MultiheadAttention(E, H, batch_first=True).double().eval()
    x = randn(2, T, E)
    future = ~ref.causal_mask(T)  # torch's module masks where True
    expected, expected_weights = module(x, x, x, attn_mask=future, average_attn_weights=False)
    ours, weights = ref.multi_head_attention(
        x,
        module.in_proj_weight,
        module.out_proj.weight,
        H,
        b_qkv=module.in_proj_bias,
        b_out=module.out_proj.bias,
    )
    assert (ours - expected).abs().max() <= 1e-12
    assert (weights - expected_weights).abs().max() <= 1e-12


def test_multi_head_attention_keeps_the_causal_mask_beside_a_padding_mask():
    """Round 2's reference dropped the causal mask whenever a padding mask was given."""
    torch.manual_seed(0)
    E, H, T = 12, 3, 5
    module = torch.nn.MultiheadAttention(E, H, batch_first=True).double().eval()
    x = randn(2, T, E)
    keys = torch.tensor([[True] * T, [True] * 3 + [False] * 2])  # (B, S): the second row padded
    expected, expected_weights = module(
        x, x, x, attn_mask=~ref.causal_mask(T), key_padding_mask=~keys, average_attn_weights=False
    )
    weights_of = lambda mask: ref.multi_head_attention(
        x,
        module.in_proj_weight,
        module.out_proj.weight,
        H,
        b_qkv=module.in_proj_bias,
        b_out=module.out_proj.bias,
        attn_mask=mask,
    )
    ours, weights = weights_of(keys[:, None, None, :])  # bool keep-mask (B, 1, 1, S)
    assert (ours - expected).abs().max() <= 1e-12 and (weights - expected_weights).abs().max() <= 1e-12
    additive = torch.zeros(2, 1, 1, T, dtype=torch.float64).masked_fill(
        ~keys[:, None, None, :], float("-inf")
    )
    assert (weights_of(additive)[1] - expected_weights).abs().max() <= 1e-12
    assert weights[0, :, 0, 1:].abs().max() == 0  # the first query sees only itself


def test_rotary_preserves_norm_and_depends_on_relative_position():
    inv_freq = ref.rope_inverse_frequencies(8, 10000.0)
    q, k = randn(8, dtype=torch.float32), randn(8, dtype=torch.float32, seed=1)

    def rotated(x, position):
        return ref.apply_rotary(x[None], ref.rope_angles(torch.tensor([position]), inv_freq))[0]

    assert torch.allclose(rotated(q, 7).norm(), q.norm(), atol=1e-5)
    assert abs(rotated(q, 9) @ rotated(k, 4) - rotated(q, 15) @ rotated(k, 10)) < 1e-4  # only m - n matters
    assert abs(rotated(q, 9) @ rotated(k, 4) - rotated(q, 9) @ rotated(k, 5)) > 1e-3


def test_partial_and_interleaved_rotary():
    x = randn(3, 8, dtype=torch.float32)
    angles = ref.rope_angles(
        torch.arange(3), ref.rope_inverse_frequencies(4, 100.0)
    )  # rotate 4 of 8 features
    half = ref.apply_rotary(x, angles)
    assert torch.equal(half[:, 4:], x[:, 4:])  # pass-through part untouched
    # The interleaved layout is the half layout with features reordered (0, 2, 1, 3).
    order = torch.tensor([0, 2, 1, 3, 4, 5, 6, 7])
    inter = ref.apply_rotary(x[:, order], angles, interleaved=True)
    assert torch.allclose(inter[:, order], half, atol=1e-6)


@pytest.mark.parametrize(
    "scheme,params",
    [
        ("linear", {"factor": 4.0}),
        (
            "llama3",
            {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
)
def test_rope_frequency_schemes_by_formula(scheme, params):
    base = ref.rope_inverse_frequencies(16, 10000.0)
    ours = ref.rope_inverse_frequencies(16, 10000.0, scheme, **params)
    if scheme == "linear":
        assert torch.allclose(ours, base / 4)
        return
    wavelength = 2 * math.pi / base
    for b, o, w in zip(base.tolist(), ours.tolist(), wavelength.tolist()):
        if w < 64 / 4:  # fast pairs keep their speed
            assert o == pytest.approx(b)
        elif w > 64 / 1:  # slow pairs are slowed by the factor
            assert o == pytest.approx(b / 8)
        else:  # in between: a blend that lies between the two
            assert b / 8 <= o <= b


def test_rope_schemes_match_transformers_tables():
    """The frequency tables equal transformers' own (a check of our formulas, not used by verify)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = ref.rope_inverse_frequencies(64, 500000.0, "llama3", **params)
    assert torch.allclose(ours, theirs, rtol=1e-6)


def test_alibi():
    assert torch.allclose(ref.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    twelve = ref.alibi_slopes(12)  # 8 from the power of two below, then every other slope of 16 heads
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert torch.allclose(twelve, torch.tensor(expected))
    bias = ref.alibi_bias(torch.tensor([0.5]), 3)
    assert bias[0].tolist() == [[0.0, 0.5, 1.0], [-0.5, 0.0, 0.5], [-1.0, -0.5, 0.0]]


def test_soft_cap_and_norms():
    x = torch.tensor([-1000.0, -0.01, 0.0, 0.01, 1000.0])
    capped = ref.soft_cap(x, 50.0)
    assert capped.abs().max() <= 50.0 and torch.allclose(capped[1:4], x[1:4], atol=1e-8)
    v = randn(2, 6)
    w = randn(6, seed=1)
    unit = ref.rms_norm(v, torch.ones(6, dtype=v.dtype), 0.0, compute_dtype=None)
    assert torch.allclose(unit.pow(2).mean(-1), torch.ones(2, dtype=v.dtype))
    assert torch.allclose(
        ref.rms_norm(v, w, 1e-6, offset=1.0, compute_dtype=None),
        ref.rms_norm(v, 1.0 + w, 1e-6, compute_dtype=None),
    )
    ln = ref.layer_norm(v, w, None, 1e-5)
    assert torch.allclose(ln, F.layer_norm(v, (6,), w, None, 1e-5), atol=1e-12)
