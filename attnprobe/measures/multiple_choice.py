"""The multiple-choice measure: which option does the model pick after a context and a question?

Each prompt (a context and a question, suite/files/choices.py) is followed by the measure's `prompt`
(default " Answer:") and each option's words (with a space before them) are scored as
log p(option | context + question + prompt), summed over their tokens; context, question and prompt
are forwarded once for all options and shared prefixes once across prompts
(scoring.continuation_logprobs). The statistics (stats/kinds/multiple_choice.py) take the
highest-scoring option as the model's choice, for all questions and per value of each `by` column
(default: the sentence entry, template_id, where there are several, and BBQ's category). Rows land in
multiple_choice.parquet: (prompt_id, option, candidate, logprob, n_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..schema.yamllines import line_of
from .base import ScoredMeasure

COLUMNS = ("prompt_id", "option", "candidate", "logprob", "n_tokens")


@dataclass(frozen=True)
class MultipleChoiceMeasure:
    prompt: str = " Answer:"  # between the question and each option
    origin: str = ""
    by: tuple[str, ...] | None = None  # prompt columns reported per value; None: template_id and category

    KEY = "multiple_choice"

    @staticmethod
    def parse(ctx, doc, columns) -> MultipleChoiceMeasure | None:
        node = doc.get("multiple_choice")
        if node is None:
            return None
        node = {} if node is True else node
        if not isinstance(node, dict) or set(node) - set(MultipleChoice.KEYS["multiple_choice"]):
            ctx.fail(
                doc,
                "multiple_choice",
                "multiple_choice is a mapping with an optional `prompt:` and `by:`, e.g. "
                '{prompt: " Answer:", by: [category]}',
            )
        prompt = node.get("prompt", " Answer:")
        if not isinstance(prompt, str):
            ctx.fail(node, "prompt", "`prompt` is the text between the question and each option")
        by = node.get("by")
        by = [by] if isinstance(by, str) else by
        if by is not None and (
            not isinstance(by, list) or not all(isinstance(c, str) and c in columns for c in by)
        ):
            ctx.fail(
                node,
                "by",
                "`by` names prompt columns reported per value, e.g. [template_id, category] (columns: "
                f"{', '.join(sorted(columns))})",
            )
        if "option_0" not in columns or "answer" not in columns:
            ctx.fail(
                doc,
                "multiple_choice",
                "multiple_choice needs rows with options: a sentences entry with `choices:`",
            )
        where = f"{ctx.path}:{line_of(doc, 'multiple_choice')}"
        return MultipleChoiceMeasure(prompt, where, None if by is None else tuple(by))


def options_of(prompt) -> list[str]:
    """A prompt's options, in order (metadata option_0, option_1, ...)."""
    options, i = [], 0
    while isinstance(prompt.meta.get(f"option_{i}"), str):
        options.append(prompt.meta[f"option_{i}"])
        i += 1
    return options


def sequences(measure: MultipleChoiceMeasure, e, tokenizer) -> tuple[list, dict]:
    """What one prompt scores: context + question + the measure's prompt as token ids, and per option
    its text and ids."""
    prefix = list(e.ids) + tokenizer.encode(measure.prompt, add_special_tokens=False)
    options = options_of(e.prompt)
    return prefix, {
        i: (o, tokenizer.encode(" " + o, add_special_tokens=False)) for i, o in enumerate(options)
    }


def score(pm, measure: MultipleChoiceMeasure, encoded, batch_size: int = 256, progress=None) -> pd.DataFrame:
    """One row per (prompt, option): the option's summed log-probability after the prompt."""
    pairs, rows = [], []
    for e in encoded:
        prefix, tails = sequences(measure, e, pm.tokenizer)
        for i, (option, tail) in tails.items():
            pairs.append((prefix, tail))
            rows.append((e.prompt.prompt_id, i, option, len(tail)))
    from ..forward.scoring import continuation_logprobs  # torch: not loaded by a suite's parse

    logprobs = continuation_logprobs(pm, pairs, batch_size, progress)
    table = pd.DataFrame(rows, columns=["prompt_id", "option", "candidate", "n_tokens"])
    table.insert(3, "logprob", logprobs)
    return table[list(COLUMNS)]


class MultipleChoice(ScoredMeasure):
    NAME = "multiple_choice"
    KEYS = {"multiple_choice": ("prompt", "by")}
    CONTRACT = ("choices", 8)
    CONTEXT = "the question and its options"
    TABLES = ("choice_accuracy",)

    def parse(self, ctx, doc, scope) -> MultipleChoiceMeasure | None:
        return MultipleChoiceMeasure.parse(ctx, doc, scope.columns)

    def sequences(self, declared, encoded, tokenizer, suite):
        return sequences(declared, encoded, tokenizer)

    def score(self, pm, declared, suite, prompts, batch_size, advance) -> pd.DataFrame:
        return score(pm, declared, prompts, batch_size, advance)

    def count(self, declared, suite, encoded) -> int:
        return len(options_of(encoded.prompt))

    def describe(self, declared, part) -> list[str]:
        return [f"multiple_choice: each option scored after context + question + {declared.prompt!r}"]

    def manifest(self, declared, part) -> dict:
        entry = {"prompt": declared.prompt, "by": declared.by} if declared else None
        return {"multiple_choice": entry}

    def paired(self, a, b, scopes):
        from ..stats.compare import change_table
        from ..stats.kinds.multiple_choice import item_outcomes

        values = [item_outcomes(run) for run in (a, b)]
        if values[0] is None or values[1] is None:
            return {}
        return {"compare_multiple_choice": change_table(*values, a, scopes)}

    def statistics(self, run, tables: dict) -> dict:
        from ..stats.kinds.multiple_choice import choice_accuracy

        return {"choice_accuracy": choice_accuracy(run)}

    def section(self, run, tables: dict, figures) -> dict | None:
        from ..stats.kinds.multiple_choice import choice_setting
        from .sections import records_section

        prompt = choice_setting(run.manifest, "prompt")
        return records_section(self.NAME, tables, "choice_accuracy", prompt=prompt)
