"""Scored continuations with shared prefixes and a narrowed lm head equal the plain forward."""

from types import SimpleNamespace

import pytest
import torch
from conftest import INTERFACE_FAMILIES, build_tiny

from attnprobe import scoring


class _Tokenizer:
    pad_token_id = 0


def plain(model, prefix, tail) -> float:
    """sum_t log p(tail[t] | prefix + tail[:t]) from one whole forward pass of the sequence alone."""
    ids = torch.tensor([prefix + tail])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)  # (T, V)
    return float(sum(logp[len(prefix) - 1 + t, token] for t, token in enumerate(tail)))


def pairs_sharing_prefixes(seed=0) -> list[tuple[list[int], list[int]]]:
    """Three sentences, each with a question and two candidates of 1-3 tokens (the shape of referent
    choice), and one pair with no neighbour."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for length in (5, 7, 6):
        prefix = torch.randint(3, 90, (length,), generator=generator).tolist() + [40, 41]
        for tail_length in (1, 3):
            pairs.append((prefix, torch.randint(3, 90, (tail_length,), generator=generator).tolist()))
    pairs.append(([7, 8, 9], [10, 11]))
    return pairs


@pytest.mark.parametrize("name", INTERFACE_FAMILIES)
def test_continuations_equal_the_plain_forward(name, monkeypatch):
    model = build_tiny(name, dtype=torch.float64)
    pm = SimpleNamespace(model=model, tokenizer=_Tokenizer())
    pairs = pairs_sharing_prefixes()
    packed = []
    monkeypatch.setattr(
        scoring, "_packs", lambda s, share, most, f=scoring._packs: packed.append(share) or f(s, share, most)
    )
    got = scoring.continuation_logprobs(pm, pairs, batch_size=4)
    want = [plain(model, prefix, tail) for prefix, tail in pairs]
    # float64: packing and a narrowed head change only the order of sums
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-10
    windowed = name in ("mistral", "gemma2", "gemma3")  # windows of 4 tokens are reached: no sharing
    assert packed == [not windowed]


def test_packs_share_prefixes_and_stay_small():
    sequences = [tuple(p + t) for p, t in pairs_sharing_prefixes()]
    packs = scoring._packs(sequences, share=True)
    assert sorted(i for pack in packs for i in pack) == list(range(len(sequences)))
    assert any(len(pack) > 1 for pack in packs)  # candidates after one prefix ride together
    assert [[i] for i in sorted(range(len(sequences)), key=lambda i: sequences[i])] == scoring._packs(
        sequences, share=False
    )


def test_a_large_vocabulary_shrinks_the_batch(monkeypatch):
    """The logits of a pass stay within LOGIT_BUDGET: with a budget of 2 sequences' logits, a pass
    holds at most 2 sequences (advance is told each pass)."""
    model = build_tiny("llama", dtype=torch.float64)
    pm = SimpleNamespace(model=model, tokenizer=_Tokenizer())
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 2 * 3 * model.config.vocab_size)
    passes = []
    pairs = pairs_sharing_prefixes()
    got = scoring.continuation_logprobs(pm, pairs, batch_size=256, advance=passes.append)
    assert max(passes) <= 2 and sum(passes) == len(pairs)
    assert max(abs(g - plain(model, p, t)) for g, (p, t) in zip(got, pairs)) <= 1e-10
