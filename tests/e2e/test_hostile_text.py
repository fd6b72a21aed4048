"""Odd text in slots and templates keeps character and token spans right."""

import pytest

from attnprobe.run.plan import encode_prompts
from attnprobe.suite import load_suite

pytestmark = pytest.mark.slow

ODD = {
    "rtl": "\u05e8\u05d5\u05e4\u05d0\u05d4",  # Hebrew
    "arabic": "\u0637\u0628\u064a\u0628",
    "emoji": "\U0001f469\u200d\u2695\ufe0f doctor",  # woman health worker ZWJ sequence
    "combining": "nu\u0301rse",  # u + combining acute
    "newline": "night\nnurse",
    "braces": "{not a slot}",
    "cjk": "\u533b\u751f",
    "override": "\u202eesrun",  # right-to-left override character
}


def test_spans_survive_odd_text(tmp_path, smollm):
    values = ", ".join(f'"{v}"'.replace("\n", "\\n") for v in ODD.values())
    suite_path = tmp_path / "odd.yaml"
    suite_path.write_text(
        "name: odd\ncontrast: pronoun\nslots:\n"
        f"  occupation: [{values}]\n"
        "  pronoun:\n    forms: [nom]\n    values: [{label: f, nom: she}, {label: m, nom: he}]\n"
        "templates:\n"
        '  - {id: a, text: "The {{literal}} {occupation} \U0001f600 said that {pronoun.nom} '
        'left.\\n\u05e9\u05dc\u05d5\u05dd"}\n'
        '  - {id: b, text: "\u05d0 {Occupation}! {Pronoun.nom}?"}\n'
        "attention:\n  - {source: pronoun, targets: occupation}\n"
        "next_token:\n  - {cut: pronoun, candidates: pronoun}\n",
        encoding="utf-8",
    )
    suite = load_suite(suite_path)
    assert len(suite.prompts) == 2 * len(ODD) * 2
    encoded = encode_prompts(suite, list(suite.prompts), smollm.tokenizer, smollm.info.max_positions)
    tok = smollm.tokenizer
    for e in encoded:
        p = e.prompt
        occupation = p.text[slice(*p.spans["occupation"])]
        assert (
            occupation.lower() == p.slots["occupation"].lower()
            or occupation == p.slots["occupation"][:1].upper() + p.slots["occupation"][1:]
        )
        assert p.text[slice(*p.spans["pronoun"])].lower() in ("she", "he")
        if p.template_id == "a":
            assert "{literal}" in p.text and "{{" not in p.text
        for name, (start, end) in e.spans.items():
            decoded = tok.decode(list(e.ids[start:end]))
            # the span's tokens cover its text (they may add a leading space or a neighbouring byte)
            assert (
                p.text[slice(*p.spans[name])].strip() in decoded
                or decoded.strip() in p.text[slice(*p.spans[name])]
            )
            offsets = tok(p.text, return_offsets_mapping=True)["offset_mapping"]
            c0, c1 = p.spans[name]
            assert (
                offsets[start][0] <= c0 + 1 and offsets[end - 1][1] >= c1
            )  # first and last token touch the span
