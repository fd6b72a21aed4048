"""The keys each block of a suite may hold, in one table: the checks (`Context.check_keys`), their
did-you-mean messages and the suite fuzzer all read it. A measure declares the keys of its own blocks
(`Measure.KEYS`); `suite.key_table()` joins them to these.
"""

from __future__ import annotations

BLOCKS: dict[str, tuple[str, ...]] = {
    # the top level, beside every registered measure's name
    "suite": (
        "analysis",
        "name",
        "description",
        "model",
        "contrast",
        "slots",
        "templates",
        "sentences",
        "max_prompts",
        "first_token",
        "control",
    ),
    "slot": ("values", "table", "column", "forms", "delimiter"),
    "template": ("id", "meta", "text", "values", "where"),
    "sentences": (
        "column",
        "choices",
        "columns",
        "file",
        "files",
        "id",
        "lookup",
        "mark",
        "numbered",
        "optional_spans",
        "pair",
        "pattern",
        "spans",
    ),
    "analysis": (
        "contrast",
        "positive",
        "negative",
        "clusters",
        "covariate",
        "groups",
        "group_by",
        "referents",
        "answer",
    ),
    # a sentences entry's `choices:` roles -> columns
    "choices": ("context", "question", "options", "answer", "target", "unknown", "polarity", "condition"),
    "control": ("file", "words", "prompt", "label", "pair", "set", "fit", "phrase"),
}
