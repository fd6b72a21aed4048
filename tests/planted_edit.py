"""A one-layer Llama whose head L0H0 writes a stereotype feature and a factual-gender feature, for
the edit tests (issue 52). At the last token ("that") L0H0 attends to the slot and copies three
things from the slot's embedding into its output, each read by the unembedding as she - he:

  a stereotype feature s = 2c - 1 of an occupation (0 for a gendered noun),
  a factual feature f = +1 (female noun) / -1 (male noun) (0 for an occupation),
  NOISE random features of every slot word (seeded), unrelated to either.

Sequences: [BOS, a, WORD, b, THAT] with a in FILLERS_A and b in FILLERS_B (four templates), WORD an
occupation (the items) or a gendered noun (the control, in the same templates). So an edit of L0H0
that erases the covariate and keeps the definitional direction removes the stereotype gradient
and keeps the factual gap; zeroing the head removes both. The other heads write nothing.
"""

from __future__ import annotations

import numpy as np
import torch

import attnprobe
from attnprobe.edits.inputs import Inputs, _pairs
from attnprobe.intervene.engine import record
from attnprobe.intervene.items import Counterfactual, PatchItem
from attnprobe.intervene.selection import folds
from tests.planted import blank_llama

BOS, SHE, HE, THAT = 0, 1, 2, 3
FILLERS_A, FILLERS_B = (4, 5), (6, 7)
OCCUPATIONS = tuple(range(8, 20))
NOUNS = tuple(range(20, 36))  # 8 pairs: (20 female, 21 male), (22, 23), ...
BIAS, SLOT, LAST, STEREO, FACT = range(5)
NOISE = (5, 6, 7, 8)
OUT_S, OUT_F, OUT_N = 9, 10, 11
TYPE = 14
Q, D = 3, 8  # the content dimension of the head (the last rotary pair's first) and head size


def planted_edit_model(seed: int = 0):
    model = blank_llama(40, 1, D)
    stereo = {token: 2 * n / (len(OCCUPATIONS) - 1) - 1 for n, token in enumerate(OCCUPATIONS)}
    fact = {token: 1.0 if n % 2 == 0 else -1.0 for n, token in enumerate(NOUNS)}
    plant_head(model, stereo, fact, (THAT,), (SHE,), (HE,), seed)
    attnprobe.attention.capture.enable(model)
    return model


def plant_head(model, stereo: dict, fact: dict, last, female, male, seed=0, noise=(0.4, 1.5), typed=False):
    """Writes L0H0 into a blank_llama: the tokens of `stereo` (token: s) and `fact` (token: f) are slot
    words carrying s or f and NOISE random features (seeded, each N(0, noise[0]^2)); at the `last`
    tokens the head attends to the slot words and writes s, f and the noise into OUT_S, OUT_F and
    OUT_N, which the unembedding reads as `female` - `male` with weights 3, 3 and noise[1]. `typed`:
    the `stereo` tokens also carry a TYPE feature (N(1, 0.3^2) each) that the head's output holds but
    never writes to the stream: a direction in which the items differ from the gendered words and
    which nothing reads."""
    rng = np.random.default_rng(seed)
    draws = rng.normal(0, noise[0], (model.config.vocab_size, len(NOISE)))
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e[:, BIAS] = 4.0
        for features, dim in ((stereo, STEREO), (fact, FACT)):
            for token, value in features.items():
                e[token, SLOT], e[token, dim] = 1.0, value
                e[token, list(NOISE)] = torch.tensor(draws[token], dtype=e.dtype)
        if typed:
            types = rng.normal(1.0, 0.3, model.config.vocab_size)
            for token in stereo:
                e[token, TYPE] = types[token]
            model.model.layers[0].self_attn.v_proj.weight[2 + len(NOISE), TYPE] = 1.0
        e[list(last), LAST] = 1.0
        attention = model.model.layers[0].self_attn
        attention.q_proj.weight[Q, LAST], attention.k_proj.weight[Q, SLOT] = 20.0, 1.0
        attention.v_proj.weight[0, STEREO], attention.o_proj.weight[OUT_S, 0] = 1.0, 1.0
        attention.v_proj.weight[1, FACT], attention.o_proj.weight[OUT_F, 1] = 1.0, 1.0
        for j, dim in enumerate(NOISE):
            attention.v_proj.weight[2 + j, dim], attention.o_proj.weight[OUT_N, 2 + j] = 1.0, 1.0
        for out, weight in ((OUT_S, 3.0), (OUT_F, 3.0), (OUT_N, noise[1])):
            model.lm_head.weight[list(female), out], model.lm_head.weight[list(male), out] = weight, -weight


def _sequence(a: int, word: int, b: int) -> torch.Tensor:
    return torch.tensor([BOS, a, word, b, THAT])


def planted_inputs(model, covariates) -> Inputs:
    """The edit sweep's inputs: the occupation items (`covariates`: per occupation the covariate
    recorded) and, as the control, every noun in the same four templates (word pairs alternate
    between the two cross-fitting halves; all may be fitted on). No texts: the items stand in."""
    items, control, sign, pair, template = [], [], [], [], []
    for a in FILLERS_A:
        for b in FILLERS_B:
            for n, occupation in enumerate(OCCUPATIONS):
                x = _sequence(a, occupation, b)
                cf = Counterfactual("person", x, 2, 2)
                items.append(PatchItem(f"o{n}-{a}-{b}", f"t{a}-{b}", str(occupation), f"o{n}",
                                       float(covariates[n]), x, (cf,), (SHE,), (HE,)))  # fmt: skip
            for n, noun in enumerate(NOUNS):
                control.append(_sequence(a, noun, b))
                (
                    sign.append(1.0 if n % 2 == 0 else -1.0),
                    pair.append(f"p{n // 2}"),
                    template.append(f"t{a}-{b}"),
                )
    fold_of = folds(items)
    bank, control_bank = record(model, [i.x for i in items]), record(model, control)
    m = len(control)
    return Inputs(
        items=items,
        fold=np.array([fold_of[i.item_id] for i in items]),
        n_templates=4,
        covariate=np.array([i.covariate for i in items]),
        bank=bank,
        reference=bank,
        reference_fold=np.array([fold_of[i.item_id] for i in items]),
        control=control_bank,
        control_sign=np.array(sign),
        control_half=np.array([int(p[1:]) % 2 for p in pair]),
        control_set=np.full(m, "nouns_templates", dtype=object),
        control_pair=np.array(pair, dtype=object),
        control_template=np.array(template, dtype=object),
        control_fit=np.ones(m, bool),
        texts=bank,
        text_is_user=np.zeros(len(items), bool),
        clean_logp=[],
        labels=_pairs([((SHE,), (HE,))] * len(items)),
        control_labels=_pairs([((SHE,), (HE,))] * m),
        slot_at=np.full(len(items), 2),  # the occupation's position in _sequence
        control_at=np.full(m, 2),
    )


A, B = 12, 13  # the dimensions the two MLPs of planted_two_layer_model write the stereotype into
SMALL = 0.05  # their scale


def planted_two_layer_model(seed: int = 0):
    """planted_edit_model with a second layer, the stereotype reaching the logits only through the two
    layers' MLPs at the last token: L0H0 copies s into OUT_S, which the unembedding no longer reads;
    MLP 0 writes s / 2 into A and MLP 1 writes s - A into B (a backup: with A erased it writes all
    of s), and the unembedding reads A + B. The factual feature still goes straight to the logits.
    So erasing MLP 0 alone removes nothing, MLP 1 alone about half, both (each fitted on the model
    edited below it) all of the stereotype; none touches the factual term. Each MLP is linear in what
    it reads: its gate reads the constant BIAS dimension (SiLU of a large value is the value)."""
    one = planted_edit_model(seed)
    model = blank_llama(40, 2, D)
    model.load_state_dict(one.state_dict(), strict=False)  # layer 0 and the embeddings as planted
    with torch.no_grad():
        model.lm_head.weight.copy_(one.lm_head.weight)
        model.lm_head.weight[:, OUT_S] = 0.0
        for dim in (A, B):  # the MLPs write SMALL times the stereotype: erasing it barely moves the rms
            model.lm_head.weight[SHE, dim], model.lm_head.weight[HE, dim] = 3.0 / SMALL, -3.0 / SMALL
        for n, (target, reads) in enumerate(((A, {OUT_S: SMALL / 2}), (B, {OUT_S: SMALL, A: -1.0}))):
            mlp = model.model.layers[n].mlp
            mlp.gate_proj.weight[0, BIAS] = 5.0  # SiLU(5 * BIAS / rms) ~ 5 * BIAS / rms: ~27
            for dim, weight in reads.items():
                mlp.up_proj.weight[0, dim] = weight
            mlp.down_proj.weight[target, 0] = _inverse_gain(model, n)
    attnprobe.attention.capture.enable(model)
    return model


def _inverse_gain(model, layer: int) -> float:
    """1 / (gate x rms) at the last token, so the MLP's output is what its up projection reads in the
    stream's own units (the norm divides by the rms, which the BIAS and LAST dimensions dominate)."""
    rms = ((4.0**2 + 1.0) / 32) ** 0.5
    gate = 5.0 * 4.0 / rms
    return rms / gate
