"""Prefix sharing: prompts packed as a trie forward each shared token once and record exactly what
a plain forward of each prompt records."""

import copy

import pandas as pd
import pytest
import torch
from conftest import INTERFACE_FAMILIES, TINY_CONFIGS, VOCAB
from transformers import AutoModelForCausalLM, LlamaConfig

import attnprobe
from attnprobe.attention.capture import run_with_capture
from attnprobe.forward.packing import pack_trie, pad_right, run_with_shared_prefixes
from attnprobe.forward.sharing import prefix_sharing_blocker
from attnprobe.run.plan import Batch, Encoded, plan_batches, plan_chunks, plan_sha256, sharing_summary

SKIP = ("head_effects", "direct_attribution")  # the phases of their own these runs do not read

GENDER = "probes/gender.yaml"
# packs of sequences: a shared prefix with suffixes of 1-3 tokens, one sequence that is a prefix of
# another (its last token is an inner node of the trie), a pack of one, and lengths that need padding
PACKS = [
    [(5, 6, 7, 8, 9, 10), (5, 6, 7, 8, 9, 11, 12), (5, 6, 7, 8, 9, 13, 14, 15)],
    [(20, 21, 22), (20, 21, 22, 23, 24), (20, 30, 31, 32)],
    [(40, 41, 42, 43, 44, 45, 46, 47, 48, 49)],
]


def test_pack_trie_holds_each_shared_prefix_once():
    tokens, depths, parents, where = pack_trie(PACKS[1])
    assert tokens == [20, 21, 22, 23, 24, 30, 31, 32] and depths == [0, 1, 2, 3, 4, 1, 2, 3]
    assert parents == [-1, 0, 1, 2, 3, 0, 5, 6]
    assert where == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 5, 6, 7]]


def _tiny(name: str, dtype) -> torch.nn.Module:
    """A tiny model of the family with any sliding window wider than the test sequences (a window the
    prompts reach blocks sharing; see test_sharing_is_refused_with_its_reason)."""
    config = copy.deepcopy(TINY_CONFIGS[name])
    config.vocab_size, config.initializer_range = VOCAB, 0.3
    if getattr(config, "sliding_window", None):
        config.sliding_window = 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    attnprobe.attention.capture.enable(model)
    return model


@pytest.mark.parametrize("name", INTERFACE_FAMILIES)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_packed_forward_equals_the_plain_forward(name, dtype, tolerance):
    model = _tiny(name, dtype)
    sequences = [s for pack in PACKS for s in pack]
    ids, mask = pad_right(sequences, 0)  # (B, T), padded on the right
    positions = torch.tensor(
        [[len(s) - 2, len(s) - 1] for s in sequences]
    )  # (B, 2) per-sequence logit positions
    plain = run_with_capture(model, ids, mask, logit_positions=positions)
    packed = run_with_shared_prefixes(model, PACKS, 0, logit_positions=positions)
    assert set(plain.weights) == set(packed.weights) == set(range(model.config.num_hidden_layers))
    for layer, weights in plain.weights.items():
        for b, s in enumerate(sequences):  # rows of real tokens (a pad row's weights mean nothing)
            assert (
                packed.weights[layer][b, :, : len(s)] - weights[b, :, : len(s)]
            ).abs().max() <= tolerance, (name, layer, b)
    assert (packed.logits - plain.logits).abs().max() <= tolerance
    rows = torch.tensor([[0, len(s) - 1] for s in sequences])  # a few rows only, as the run records them
    few = run_with_shared_prefixes(model, PACKS, 0, rows=rows, layers=[1])
    assert set(few.weights) == {1}
    expected = plain.weights[1].gather(
        2, rows[:, None, :, None].expand(-1, plain.weights[1].shape[1], -1, ids.shape[1])
    )
    assert (few.weights[1] - expected).abs().max() <= tolerance


def _encoded(ids: tuple[int, ...], prompt_id: int) -> Encoded:
    prompt = type("P", (), {"prompt_id": prompt_id})()
    return Encoded(prompt, ids, {}, len(ids))


def test_the_plan_packs_trie_neighbours_and_the_hash_covers_the_packs():
    encoded = [_encoded(s, k) for k, s in enumerate(s for pack in PACKS for s in pack)]
    shared = plan_batches(
        encoded, batch_size=3, share_prefixes=True
    )  # at most 3 prompts a batch (and a pack)
    plain = plan_batches(encoded, batch_size=3)
    assert all(isinstance(b, Batch) for b in shared) and not any(b.shared for b in plain)
    packs = [[encoded[i].forward_ids for i in pack] for b in shared for pack in b.packs]
    assert sorted(packs) == sorted(PACKS)  # runs of neighbours in token order
    summary = sharing_summary(plan_chunks(shared, 16), encoded, None)
    assert summary == {
        "enabled": True,
        "reason": None,
        "tokens_forwarded": 11 + 8 + 10,
        "tokens_without_sharing": 43,
    }
    one = plan_batches(
        encoded, batch_size=8, share_prefixes=True
    )  # unrelated prompts share a row too (no padding)
    assert [len(pack) for b in one for pack in b.packs] == [7]
    assert sharing_summary(plan_chunks(one, 16), encoded, None)["tokens_forwarded"] == 29
    assert plan_sha256(plan_chunks(shared, 16), encoded) != plan_sha256(plan_chunks(plain, 16), encoded)


def test_sharing_is_refused_with_its_reason():
    assert "bypasses attnprobe's attention function" in prefix_sharing_blocker(TINY_CONFIGS["gpt_neo"], 5)
    assert (
        prefix_sharing_blocker(TINY_CONFIGS["mistral"], 6)
        == "prompts of up to 6 tokens reach its sliding window of 4"
    )
    assert prefix_sharing_blocker(TINY_CONFIGS["mistral"], 2) is None
    hybrid = LlamaConfig(num_hidden_layers=2)
    hybrid.layer_types = ["full_attention", "mamba"]
    assert (
        prefix_sharing_blocker(hybrid, 5) == "'llama' has mamba layers, which keep no plain key/value cache"
    )


@pytest.mark.slow
def test_a_shared_run_equals_a_plain_run(smollm, tmp_path):
    runs = {
        share: attnprobe.run_suite(
            GENDER,
            model=smollm,
            out=tmp_path / str(share),
            limit=150,
            progress=False,
            skip=SKIP,
            share_prefixes=share,
        )
        for share in (True, False)
    }
    on, off = runs[True].manifest.prefix_sharing, runs[False].manifest.prefix_sharing
    assert on["enabled"] and on["tokens_forwarded"] < 0.6 * on["tokens_without_sharing"]
    assert off == {
        "enabled": False,
        "reason": "switched off",
        "tokens_forwarded": on["tokens_without_sharing"],
        "tokens_without_sharing": on["tokens_without_sharing"],
    }
    keys = ["prompt_id", "layer", "head", "source", "target"]
    weights = runs[True].attention.merge(runs[False].attention, on=keys)
    assert (
        len(weights) == len(runs[False].attention)
        and (weights.weight_x - weights.weight_y).abs().max() <= 1e-5
    )
    logprobs = runs[True].logprobs.merge(
        runs[False].logprobs, on=["prompt_id", "cut", "candidate", "candidate_label"]
    )
    assert len(logprobs) == len(runs[False].logprobs)
    # float32 rounding: on the plain path alone, torch's choice of SDPA kernel (flash or math) moves
    # these log-probabilities by up to 3.5e-5; in float64 the two paths agree exactly (tiny models above)
    assert (logprobs.logprob_x - logprobs.logprob_y).abs().max() <= 1e-4
    pd.testing.assert_frame_equal(runs[True].prompts, runs[False].prompts)
