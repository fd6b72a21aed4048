"""The referent-choice measure: which referent does the model name when asked, in a scored continuation?

For a suite whose analysis declares two `referents` (spans, e.g. the two occupations) and the
`answer`, each prompt is extended by the suite's question (`prompt:`, with `{span}` filled by that
span's words in this prompt, e.g. " Here, '{pronoun}' refers to the") and each referent's words
(its span without a leading article: "The developer" -> " developer") are scored as
log p(words | sentence + question), summed over their tokens. The statistics (stats/kinds/referents.py)
count the item as correct when the answer scores higher. Rows land in referent_choice.parquet:
(prompt_id, referent, candidate, logprob, n_tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from ..schema.spans import candidate_words
from ..schema.yamllines import line_of, required_str
from .base import ScoredMeasure

COLUMNS = ("prompt_id", "referent", "candidate", "logprob", "n_tokens")
PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class ReferentChoiceMeasure:
    prompt: str  # appended to each sentence; {span} is that span's words in the prompt
    origin: str = ""

    KEY = "referent_choice"

    @staticmethod
    def parse(ctx, doc, analysis, span_names) -> ReferentChoiceMeasure | None:
        node = doc.get("referent_choice")
        if node is None:
            return None
        if not isinstance(node, dict):
            ctx.fail(
                doc,
                "referent_choice",
                "`referent_choice` is a mapping with `prompt:`, e.g. {prompt: \" Here, '{pronoun}' refers to "
                'the"}',
            )
        ctx.check_keys(node, ReferentChoice.KEYS["referent_choice"], " in referent_choice")
        if not analysis.referents:
            ctx.fail(
                doc,
                "referent_choice",
                "referent_choice scores the two `referents` of the analysis; declare "
                "`analysis: {referents: [a, b], answer: ...}`",
            )
        prompt = required_str(ctx, node, "prompt")
        for name in PLACEHOLDER.findall(prompt):
            if name not in span_names:
                ctx.fail(
                    node, "prompt", f"'{{{name}}}' is not a span (spans: {', '.join(sorted(span_names))})"
                )
        return ReferentChoiceMeasure(prompt, f"{ctx.path}:{line_of(node, 'prompt')}")

    def question(self, prompt) -> str | None:
        """The question for one prompt, or None when a span it names is absent there."""
        words = {name: prompt.text[slice(*span)] for name, span in prompt.spans.items()}
        if any(name not in words for name in PLACEHOLDER.findall(self.prompt)):
            return None
        return PLACEHOLDER.sub(lambda m: words[m.group(1)], self.prompt)


def sequences(measure: ReferentChoiceMeasure, e, tokenizer, referents) -> tuple[list, dict] | None:
    """What one prompt scores: sentence + question as token ids, and per referent its words and their
    ids; None for a prompt without the question's spans or a referent."""
    question = measure.question(e.prompt)
    words = {r: candidate_words(e.prompt, r) for r in referents}
    if question is None or None in words.values():
        return None
    prefix = list(e.ids) + tokenizer.encode(question, add_special_tokens=False)
    return prefix, {r: (text, tokenizer.encode(text, add_special_tokens=False)) for r, text in words.items()}


def score(
    pm, measure: ReferentChoiceMeasure, encoded, referents, batch_size: int = 256, progress=None
) -> pd.DataFrame:
    """One row per (prompt, referent): the summed log-probability of the referent's words after
    the sentence and the question. Sentence + question are forwarded once for both referents and
    shared prefixes once across prompts; logits only where a referent's token is read
    (scoring.continuation_logprobs). `progress(n)` is told the sequences scored."""
    pairs, rows = [], []
    for e in encoded:
        scored = sequences(measure, e, pm.tokenizer, referents)
        if scored is None:
            continue
        prefix, tails = scored
        for referent, (text, tail) in tails.items():
            pairs.append((prefix, tail))
            rows.append(
                {
                    "prompt_id": e.prompt.prompt_id,
                    "referent": referent,
                    "candidate": text,
                    "n_tokens": len(tail),
                }
            )
    from ..forward.scoring import continuation_logprobs  # torch: not loaded by a suite's parse

    logprobs = continuation_logprobs(pm, pairs, batch_size, progress)
    table = pd.DataFrame(rows, columns=[c for c in COLUMNS if c != "logprob"])
    table.insert(3, "logprob", logprobs)
    return table[list(COLUMNS)]


class ReferentChoice(ScoredMeasure):
    NAME = "referent_choice"
    KEYS = {"referent_choice": ("prompt",)}
    CONTRACT = ("coref", 16)
    CONTEXT = "the referent_choice question ({origin})"
    TABLES = ("referent_choice_accuracy",)

    def parse(self, ctx, doc, scope) -> ReferentChoiceMeasure | None:
        return ReferentChoiceMeasure.parse(ctx, doc, scope.analysis, scope.span_names)

    def sequences(self, declared, encoded, tokenizer, suite):
        return sequences(declared, encoded, tokenizer, suite.analysis.referents)

    def score(self, pm, declared, suite, prompts, batch_size, advance) -> pd.DataFrame:
        return score(pm, declared, prompts, suite.analysis.referents, batch_size, advance)

    def count(self, declared, suite, encoded) -> int:
        return len(suite.analysis.referents)

    def describe(self, declared, part) -> list[str]:
        return [f"referent_choice: {declared.prompt!r} after each sentence"]

    def manifest(self, declared, part) -> dict:
        return {"referent_choice": declared.prompt if declared else None}

    def paired(self, a, b, scopes):
        from ..stats.compare import change_table
        from ..stats.kinds.referents import item_choices

        values = [item_choices(run) for run in (a, b)]
        if values[0] is None or values[1] is None:
            return {}
        return {"compare_referent_choice": change_table(*values, a, scopes)}

    def statistics(self, run, tables: dict) -> dict:
        from ..stats.kinds.referents import referent_choice

        return {"referent_choice_accuracy": referent_choice(run)}

    def section(self, run, tables: dict, figures) -> dict | None:
        from .sections import choice_section

        return choice_section(run, tables, figures)


def question_of(manifest) -> str | None:
    """The question a run scored the referents with (its manifest entry), or None."""
    return manifest.entry(ReferentChoice.NAME)
