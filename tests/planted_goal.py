"""A model where the debiasing goal is reachable, in the bundled tokenizer's vocabulary and saved as
a checkpoint, so the whole procedure (`attnprobe run` on a suite, `attnprobe edit`, its goal table)
runs on it as a user types it (issue 69). Three layers, built from tests/planted_edit.py's parts:

- each occupation of the suite's table carries the stereotype s = 2 c / 100 - 1 of its BLS percent
  female c, random features OWN of its own and the planted NOISE; each gendered word of the control
  file (and " woman", " man") its factual sign f and NOISE; " person" neither s nor f;
- at the occupation, MLP 0 writes SMALL s / 2 into A and MLP 1 writes SMALL s - A into B (a backup:
  with A erased it writes all of it), and each MLP writes copies of OWN where nothing reads them (so
  its output varies in directions besides the stereotype's, as a real MLP's does, and a covariate
  permuted by the placebo finds another direction; the gendered words have no OWN, so an edit
  without an affine term leaves them where they were);
- at " that", head L2H0 reads the slot word before it: (A + B) / SMALL = s, f and NOISE, which the
  unembedding reads as " she" - " he", and a TYPE feature nothing reads.

Every other token carries nothing, so text without these words is unchanged by an edit of them. So
DAMA's projection of the window of one layer (2) removes nothing, of two (1, 2) about half, of three
all of the stereotype; an eraser of L2H0 that keeps f and the gendered words' midpoint removes it
too; the factual sign passes every one untouched.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from tests.planted import blank_llama
from tests.planted_edit import BIAS, SMALL, STEREO, TYPE, A, B, D, _inverse_gain, plant_head

LABELS = {"female": 1.0, "male": -1.0}
OWN = (25, 26, 27, 28, 29, 30, 31)  # random features of the occupations' tokens alone, read by the MLPs
UNREAD = 16  # from here on, planted_layers_checkpoint's MLPs write their copies of OWN (nothing reads them)


def _tokens(tokenizer, word: str) -> set[int]:
    """The word's tokens where it follows a space, and at a sentence's start (names)."""
    forms = (" " + word, word) if word[:1].isupper() else (" " + word,)
    return {t for form in forms for t in tokenizer(form, add_special_tokens=False).input_ids}


def _features(tokenizer, values: dict[str, float]) -> dict[int, float]:
    """token -> value for the tokens whose words all carry one value; every word keeps at least one."""
    seen: dict[int, set[float]] = {}
    for word, value in values.items():
        for token in _tokens(tokenizer, word):
            seen.setdefault(token, set()).add(value)
    out = {token: next(iter(v)) for token, v in seen.items() if len(v) == 1}
    lost = [word for word in values if not _tokens(tokenizer, word) & out.keys()]
    assert not lost, f"no token of its own: {lost}"
    return out


def planted_goal_checkpoint(tokenizer, occupations: Path, control: Path, folder: Path, noise=(0.2, 0.5)):
    """Saves the planted model (above) and `tokenizer` to `folder`: the stereotype from `occupations`
    (a TSV with occupation and bls_pct_female), the factual signs from `control` (its label and phrase
    columns)."""
    model = _planted(tokenizer, occupations, control, 3, noise, intermediate=1 + len(OWN))
    with torch.no_grad():
        first, third = model.model.layers[0].self_attn, model.model.layers[2].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(third, name).weight.copy_(getattr(first, name).weight)
            getattr(first, name).weight.zero_()
        third.v_proj.weight[0, STEREO] = 0.0
        third.v_proj.weight[0, A] = third.v_proj.weight[0, B] = 1.0 / SMALL
        e = model.model.embed_tokens.weight
        items = torch.nonzero(e[:, TYPE]).flatten()  # the occupations' tokens (and " person")
        own = torch.randn(len(items), len(OWN), generator=torch.manual_seed(1)) * 0.2
        e[items[:, None], torch.tensor(OWN)] = own
        stereotype = ((A, {STEREO: SMALL / 2}), (B, {STEREO: SMALL, A: -1.0}))
        for n, layer in enumerate(model.model.layers):
            copies = [(UNREAD + j, {dim: SMALL}) for j, dim in enumerate(OWN)]
            for unit, (target, reads) in enumerate([*stereotype[n : n + 1], *copies]):
                layer.mlp.gate_proj.weight[unit, BIAS] = 5.0  # SiLU(5 BIAS / rms) ~ 5 BIAS / rms: linear
                for dim, weight in reads.items():
                    layer.mlp.up_proj.weight[unit, dim] = weight
                layer.mlp.down_proj.weight[target, unit] = _inverse_gain(model, n)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _planted(tokenizer, occupations: Path, control: Path, n_layers: int, noise, intermediate: int = 4):
    """A blank_llama of `n_layers` in the tokenizer's vocabulary with L0H0 planted (plant_head), the
    words' features in its embeddings."""
    with open(occupations, newline="") as handle:
        jobs = {
            r["occupation"]: 2 * float(r["bls_pct_female"]) / 100 - 1
            for r in csv.DictReader(handle, delimiter="\t")
        }
    with open(control, newline="") as handle:
        words = {r["phrase"].split()[-1]: LABELS[r["label"]] for r in csv.DictReader(handle, delimiter="\t")}
    stereo = _features(tokenizer, {**jobs, "person": 0.0})
    fact = _features(tokenizer, {**words, "woman": 1.0, "man": -1.0})
    assert not stereo.keys() & fact.keys()
    one = lambda word: tokenizer(word, add_special_tokens=False).input_ids
    model = blank_llama(len(tokenizer), n_layers, D, intermediate)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
    plant_head(model, stereo, fact, one(" that"), one(" she"), one(" he"), noise=noise, typed=True)
    return model


JOBS = [
    ("nurse", 89.58),
    ("secretary", 94.6),
    ("librarian", 83.0),
    ("therapist", 76.7),
    ("planner", 77.6),
    ("teacher", 71.0),
    ("clerk", 69.53),
    ("counselor", 66.48),
    ("instructor", 62.3),
    ("baker", 60.8),
    ("pharmacist", 57.0),
    ("administrator", 54.86),
    ("broker", 55.5),
    ("investigator", 45.15),
    ("technician", 40.34),
    ("manager", 38.51),
    ("surgeon", 37.9),
    ("lawyer", 34.5),
    ("officer", 30.42),
    ("architect", 20.81),
    ("chef", 19.6),
    ("programmer", 18.35),
    ("engineer", 10.72),
    ("painter", 5.7),
    ("inspector", 6.4),
    ("carpenter", 2.07),
    ("mechanic", 1.8),
]  # fmt: skip  (probes/occupations-bls.tsv: one token each after a space in the bundled tokenizer)
VERBS = ("said", "wrote", "replied", "thought", "hoped", "added")


def planted_goal_suite(folder: Path, control: Path) -> Path:
    """The edit suite of tests/conftest.py at the planted model's scale: JOBS in six templates, the
    control file `control` (copied), head effects against "person"."""
    (folder / "jobs.tsv").write_text("occupation\tbls_pct_female\n" + "".join(f"{o}\t{p}\n" for o, p in JOBS))
    (folder / "definitional.tsv").write_text(control.read_text())
    templates = "".join(
        f'  - {{id: {verb}, text: "The {{occupation}} {verb} that {{pronoun}} left."}}\n' for verb in VERBS
    )
    (folder / "goal.yaml").write_text(
        "name: goal\ncontrast: pronoun\nslots:\n"
        "  occupation: {table: jobs.tsv, column: occupation}\n"
        "  pronoun: {values: [{label: female, value: she}, {label: male, value: he}]}\n"
        f"templates:\n{templates}"
        "next_token: [{cut: pronoun, candidates: pronoun}]\n"
        "analysis: {contrast: pronoun, positive: female, negative: male, clusters: [occupation, template],"
        " covariate: occupation.bls_pct_female}\n"
        'control: {file: definitional.tsv, words: {female: " she", male: " he"}, pair: pair, set: set,'
        " fit: nouns, phrase: phrase}\n"
        "head_effects: {cut: pronoun, positive: female, negative: male,"
        " counterfactual: {occupation: [person]}}\n"
    )
    return folder / "goal.yaml"
