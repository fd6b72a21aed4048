"""planted_edit_model in the bundled tokenizer's vocabulary, saved as a checkpoint, so the whole
procedure (`attnprobe run` on the edit suite, then `attnprobe edit` and its goal table) runs on a
model where the goal is reachable (issue 69).

L0H0 reads, at " that", the slot word before it: each occupation of the suite's table carries the
stereotype s = 2 c / 100 - 1 of its BLS percent female c, each gendered phrase of the control file
(and " woman", " man") its factual sign f, " person" neither, and the head writes both into the
residual, which the unembedding reads as " she" - " he". Every other token carries nothing, so text
without these words is unchanged by an edit that erases s: an edit of L0H0 that erases s and keeps
f can meet every condition of the goal.
"""

from __future__ import annotations

import csv
from pathlib import Path

from tests.planted import blank_llama
from tests.planted_edit import D, plant_head

LABELS = {"female": 1.0, "male": -1.0}


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
    """Saves the planted model and `tokenizer` to `folder`: the stereotype from `occupations` (a TSV
    with occupation and bls_pct_female), the factual signs from `control` (label and phrase columns)."""
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
    model = blank_llama(len(tokenizer), 1, D)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
    plant_head(model, stereo, fact, one(" that"), one(" she"), one(" he"), noise=noise, typed=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
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
