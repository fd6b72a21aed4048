"""Scored continuations with shared prefixes and a narrowed lm head equal the plain forward."""

from types import SimpleNamespace

import pytest
import torch
from conftest import INTERFACE_FAMILIES, build_tiny

from attnprobe.forward import scoring


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
        scoring,
        "_passes",
        lambda pairs, s, share, *rest, f=scoring._passes: packed.append(share) or f(pairs, s, share, *rest),
    )
    got = scoring.continuation_logprobs(pm, pairs, batch_size=4)
    want = [plain(model, prefix, tail) for prefix, tail in pairs]
    # float64: packing and a narrowed head change only the order of sums
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-10
    windowed = name in ("mistral", "gemma2", "gemma3")  # windows of 4 tokens are reached: no sharing
    assert packed == [not windowed]


def test_passes_share_prefixes_and_stay_small():
    pairs = pairs_sharing_prefixes()
    sequences = [tuple(p + t) for p, t in pairs]
    passes = scoring._passes(pairs, sequences, True, 256, 1000)
    packs = [pack for one in passes for pack in one]
    assert sorted(i for pack in packs for i in pack) == list(range(len(sequences)))
    assert any(len(pack) > 1 for pack in packs)  # candidates after one prefix ride together
    assert len(passes) == 1
    alone = scoring._passes(pairs, sequences, False, 256, 1000)
    assert sorted(pack for one in alone for pack in one) == [[i] for i in range(len(sequences))]
    # at most 4 scored tokens a pass (a pack alone may exceed it)
    capped = scoring._passes(pairs, sequences, False, 256, 4)
    assert all(sum(len(pairs[i][1]) for pack in one for i in pack) <= 4 for one in capped)


def test_a_long_prompt_shares_itself_with_its_continuations():
    """Issue 29: a prompt longer than PACK_TOKENS forwarded once for all of its options, not once each."""
    from attnprobe.forward.packing import PACK_TOKENS, neighbour_packs

    prompt = tuple(range(3, 3 + PACK_TOKENS + 10))
    sequences = [prompt + tail for tail in ((90,), (91, 92), (93,))] + [(5, 6)]
    packs, sizes = neighbour_packs(sequences, list(range(4)), most=256)
    assert packs[0][:3] == [0, 1, 2] and sizes[0] == len(prompt) + 4 + 2  # the prompt once, then tails


def test_likelihood_parts_equal_the_plain_forward():
    """token_logprobs: per-token values whose sums over any span equal the plain forward's."""
    model = build_tiny("llama", dtype=torch.float64)
    pm = SimpleNamespace(model=model, tokenizer=_Tokenizer())
    pairs = pairs_sharing_prefixes()
    for (prefix, tail), values in zip(pairs, scoring.token_logprobs(pm, pairs, batch_size=3)):
        assert len(values) == len(tail)
        for k in range(len(tail)):
            assert abs(float(values[k]) - plain(model, prefix + tail[:k], tail[k : k + 1])) <= 1e-10


def test_a_large_vocabulary_shrinks_the_batch(monkeypatch):
    """The logits of a pass stay within LOGIT_BUDGET: with a budget of 3 scored tokens' logits, the
    10 scored tokens take at least 4 passes (advance is told each pass), and the values stay exact."""
    model = build_tiny("llama", dtype=torch.float64)
    pm = SimpleNamespace(model=model, tokenizer=_Tokenizer())
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 3 * model.config.vocab_size)
    passes = []
    pairs = pairs_sharing_prefixes()
    got = scoring.continuation_logprobs(pm, pairs, batch_size=256, advance=passes.append)
    assert sum(len(tail) for _, tail in pairs) == 14 and len(passes) >= 5 and sum(passes) == len(pairs)
    assert max(abs(g - plain(model, p, t)) for g, (p, t) in zip(got, pairs)) <= 1e-10


def test_row_logsumexp_in_blocks_equals_torchs():
    """The blocked reduction (a block of rows stays in the cache) is torch's, row for row, whatever
    the number of rows against the block."""
    logits = torch.randn(37, 1000, generator=torch.Generator().manual_seed(0)) * 4
    for rows in (1, 16, 36, 37, 64):
        torch.testing.assert_close(scoring.row_logsumexp(logits, rows), torch.logsumexp(logits, -1))
