"""A two-layer Llama with planted heads whose roles are known, for the paths table (issue 38).

Each occupation token stores two copies of its covariate c (scaled to g = 2c - 1): a *gender*
feature and a *key* feature. At the last token ("that"):

  L0H0  moves the key feature from the occupation to the last token (attends to the slot marker)
  L1H0  the mover: attends to the occupation and copies its gender feature to the output
  L1H1  the computer: its query reads the moved key feature and picks which of two cue tokens to
        attend to (CUE_SHE or CUE_HE); its values carry the cues, none of the occupation
  L1H2  reads elsewhere: attends to the last token itself and copies the key feature L0H0 moved there
  (the other heads, L0H1-3 and L1H3, have no weights: zero outputs)

So L1H0 carries the gradient through its value input from the occupation (its pattern is the same
for "person"), L1H1 through its pattern (its value at the occupation is empty), L1H2 through its
value at another position (the last token's). Queries and keys use
the last rotary pair, which turns by 1e-10 rad per position at theta 1e12: content only.
"""

from __future__ import annotations

import torch
import transformers as T

import attnprobe
from attnprobe.intervene.items import Counterfactual, PatchItem

SHE, HE, CUE_SHE, CUE_HE, PERSON, THAT = 1, 2, 3, 4, 5, 6
FILLERS_A, FILLERS_B = (7, 8, 9, 10), (11, 12)
OCCUPATIONS = tuple(range(20, 32))
BIAS, SLOT, GENDER, KEY, LAST, IS_SHE, IS_HE, CUE, MOVED, MOVER_OUT, COMPUTER_OUT, READER_OUT = range(12)
Q, D = 7, 16  # the content dimension of each head (the last rotary pair's first) and head size


def blank_llama(vocab: int, layers: int, head_dim: int, intermediate: int = 4):
    """A Llama of width 32 with 4 heads a layer whose weights are all 0 (the norms 1): what a planted
    model writes its features and heads into. Rotary at theta 1e12 turns its last pair by at most
    1e-9 rad per position (content-only queries and keys there)."""
    config = T.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 1e12},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return model


def planted_model(two_movers: bool = False):
    """`two_movers`: L1H0 and a second mover, L1H3, alike, carry the whole gradient (L0H0, L1H1 and
    L1H2 write nothing): the circuit {L1H0, L1H3} is the model's whole route."""
    model = blank_llama(32, 2, D)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e[:, BIAS] = 4.0
        for n, token in enumerate(OCCUPATIONS):
            c = n / (len(OCCUPATIONS) - 1)
            e[token, SLOT], e[token, GENDER], e[token, KEY] = 1.0, 2 * c - 1, 2 * c - 1
        e[PERSON, SLOT] = 1.0
        e[THAT, LAST] = 1.0
        e[CUE_SHE, IS_SHE] = e[CUE_SHE, CUE] = 1.0
        e[CUE_HE, IS_HE] = e[CUE_HE, CUE] = 1.0
        l0, l1 = (layer.self_attn for layer in model.model.layers)
        # L0H0: at the last token attend to the slot, copy KEY into MOVED
        l0.q_proj.weight[Q, LAST], l0.k_proj.weight[Q, SLOT] = 20.0, 1.0
        l0.v_proj.weight[0, KEY], l0.o_proj.weight[MOVED, 0] = 1.0, 1.0
        # L1H0, the mover: at the last token attend to the slot, copy GENDER into MOVER_OUT
        l1.q_proj.weight[Q, LAST], l1.k_proj.weight[Q, SLOT] = 20.0, 1.0
        l1.v_proj.weight[0, GENDER], l1.o_proj.weight[MOVER_OUT, 0] = 1.0, 1.0
        # L1H1, the computer: attend to the cues, to CUE_SHE as MOVED grows, to CUE_HE as it falls
        l1.q_proj.weight[D + Q, LAST], l1.k_proj.weight[D + Q, CUE] = 20.0, 1.0
        l1.q_proj.weight[D + Q - 1, MOVED] = 12.0
        l1.k_proj.weight[D + Q - 1, IS_SHE], l1.k_proj.weight[D + Q - 1, IS_HE] = 1.0, -1.0
        l1.v_proj.weight[D, IS_SHE], l1.v_proj.weight[D, IS_HE] = 1.0, -1.0
        l1.o_proj.weight[COMPUTER_OUT, D] = 1.0
        # L1H2, reading elsewhere: at the last token attend to itself, copy MOVED into READER_OUT
        l1.q_proj.weight[2 * D + Q, LAST], l1.k_proj.weight[2 * D + Q, LAST] = 20.0, 1.0
        l1.v_proj.weight[2 * D, MOVED], l1.o_proj.weight[READER_OUT, 2 * D] = 1.0, 1.0
        model.lm_head.weight[SHE, READER_OUT], model.lm_head.weight[HE, READER_OUT] = 3.0, -3.0
        model.lm_head.weight[SHE, MOVER_OUT] = model.lm_head.weight[SHE, COMPUTER_OUT] = 3.0
        model.lm_head.weight[HE, MOVER_OUT] = model.lm_head.weight[HE, COMPUTER_OUT] = -3.0
        if two_movers:
            l0.o_proj.weight[:, :D] = 0.0
            l1.o_proj.weight[:, D : 3 * D] = 0.0
            l1.q_proj.weight[3 * D + Q, LAST], l1.k_proj.weight[3 * D + Q, SLOT] = 20.0, 1.0
            l1.v_proj.weight[3 * D, GENDER], l1.o_proj.weight[MOVER_OUT, 3 * D] = 1.0, 1.0
    attnprobe.attention.capture.enable(model)
    return model


def planted_items(covariates=None) -> list[PatchItem]:
    """Occupation x template items: [CUE_SHE, CUE_HE, a, OCC, b, THAT] -> she / he; x' has PERSON.
    `covariates`: per occupation the covariate recorded (default the planted c; a placebo replaces it)."""
    covariates = covariates if covariates is not None else [n / 11 for n in range(len(OCCUPATIONS))]
    out = []
    for n, occupation in enumerate(OCCUPATIONS):
        for a in FILLERS_A:
            for b in FILLERS_B:
                x = torch.tensor([CUE_SHE, CUE_HE, a, occupation, b, THAT])
                cf = Counterfactual("person", torch.where(x == occupation, PERSON, x), 3, 3)
                item = PatchItem(f"o{n}-{a}-{b}", f"t{a}-{b}", str(occupation), f"o{n}", float(covariates[n]),
                                 x, (cf,), (SHE,), (HE,))  # fmt: skip
                out.append(item)
    return out


RAW, UNREAD = 12, 20  # the occupation's raw feature; a dimension nothing reads


def planted_mlp_model():
    """A known circuit through an MLP (issue 68): each occupation token stores its covariate only as
    RAW; layer 0's MLP turns RAW into GENDER at the occupation (its gate reads the constant BIAS, so
    the output grows with RAW); the movers L1H0 and L1H3 copy GENDER to the last token, which the
    logits read. Distractors read the same positions and write where nothing reads: layer 1's MLP
    (RAW -> UNREAD) and L1H1 (attends to the occupation, copies RAW -> UNREAD). The circuit is
    {embeddings, MLP0, L1H0, L1H3}: without MLP0 nothing reaches the movers, without a mover half."""
    model = blank_llama(32, 2, D)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e[:, BIAS] = 4.0
        for n, token in enumerate(OCCUPATIONS):
            e[token, SLOT], e[token, RAW] = 1.0, 2 * n / (len(OCCUPATIONS) - 1) - 1
        e[PERSON, SLOT] = 1.0
        e[THAT, LAST] = 1.0
        for layer, target in ((0, GENDER), (1, UNREAD)):  # small writes: the norms stay about constant
            mlp = model.model.layers[layer].mlp
            mlp.gate_proj.weight[0, BIAS], mlp.up_proj.weight[0, RAW] = 1.0, 1.0
            mlp.down_proj.weight[target, 0] = 0.1
        l1 = model.model.layers[1].self_attn
        for head, read, write in ((0, GENDER, MOVER_OUT), (3, GENDER, MOVER_OUT), (1, RAW, UNREAD)):
            l1.q_proj.weight[head * D + Q, LAST], l1.k_proj.weight[head * D + Q, SLOT] = 20.0, 1.0
            l1.v_proj.weight[head * D, read], l1.o_proj.weight[write, head * D] = 1.0, 0.25
        model.lm_head.weight[SHE, MOVER_OUT], model.lm_head.weight[HE, MOVER_OUT] = 12.0, -12.0
    attnprobe.attention.capture.enable(model)
    return model


def planted_noisy_movers(seed: int = 0, noise: float = 1.0):
    """Eight movers (every head of both layers) each copy a feature of their own from the occupation
    to the last token, which the logits read: the covariate (scaled to [-1, 1]) plus noise of its
    own per occupation (normal, SD `noise`, seeded). Every mover carries the gradient alike in
    expectation; which ones carry most on a set of occupations is chance, so heads chosen on the
    judged occupations look better there than on others (the selection a held-out split removes)."""
    model = blank_llama(32, 2, D)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e[:, BIAS] = 4.0
        for n, token in enumerate(OCCUPATIONS):
            c = 2 * n / (len(OCCUPATIONS) - 1) - 1
            e[token, SLOT] = 1.0
            e[token, RAW : RAW + 8] = c + noise * torch.randn(8, generator=rng)
        e[PERSON, SLOT] = 1.0
        e[THAT, LAST] = 1.0
        for layer in (0, 1):
            attention = model.model.layers[layer].self_attn
            for head in range(4):
                attention.q_proj.weight[head * D + Q, LAST], attention.k_proj.weight[head * D + Q, SLOT] = (
                    20.0,
                    1.0,
                )
                attention.v_proj.weight[head * D, RAW + 4 * layer + head] = 1.0
                attention.o_proj.weight[MOVER_OUT, head * D] = 0.25
        model.lm_head.weight[SHE, MOVER_OUT], model.lm_head.weight[HE, MOVER_OUT] = 3.0, -3.0
    attnprobe.attention.capture.enable(model)
    return model
