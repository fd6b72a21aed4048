"""A suite's definitional control: prompts whose next word is fixed by definition, not by a
stereotype ("The king said that" -> he), which an edit that removes the stereotype should leave
right. Declared in the suite, so nothing about a particular contrast lives in code:

    control:
      file: edits/definitional.tsv        # a TSV/CSV with a prompt column and a label column
      words: {female: " she", male: " he"}  # the next word each label of the contrast expects
      prompt: prompt                       # column names (these are the defaults)
      label: label
      pair: pair                           # optional: the word pair of each row (king/queen)
      set: set                             # optional: which set each row belongs to
      fit: nouns                           # the set edits may fit a keep constraint on (default: all)
      phrase: phrase                       # optional: the gendered phrase of each row ("the king",
                                           # "Mary"), also put in place of "the {slot}" in the
                                           # suite's own head-effects templates
                                           # (edits.inputs.template_prompts)

Every label must be one of `words`, and `words` names exactly the contrast's two labels (the
analysis's positive and negative). An edit that keeps the control's direction fits it on half of
the `fit` set's pairs and is judged on the other half (cross-fitted: held out by word, not by
frame); the other sets (names, a frame no fit used) are never fitted and are reported each on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SuiteError
from ..schema.keys import BLOCKS
from .files.rows import delimited_rows

KEYS = BLOCKS["control"]


@dataclass(frozen=True)
class Control:
    prompts: tuple[str, ...]
    labels: tuple[str, ...]
    words: tuple[tuple[str, str], ...]  # (label, word) pairs
    origin: str
    pairs: tuple[str, ...] = ()  # per prompt, its word pair ("" without a pair column)
    sets: tuple[str, ...] = ()  # per prompt, its set ("" without a set column)
    fit: str | None = None  # the set a keep constraint may be fitted on (None: every prompt)
    phrases: tuple[str, ...] = ()  # per prompt, its gendered phrase ("" without a phrase column)

    def fitted(self) -> tuple[bool, ...]:
        """Per prompt: whether it is of the set a keep constraint may be fitted on."""
        return tuple(self.fit is None or s == self.fit for s in self.sets or [""] * len(self.prompts))

    def word(self, label: str) -> str:
        return dict(self.words)[label]


def parse_control(ctx, doc, analysis) -> Control | None:
    node = doc.get("control")
    if node is None:
        return None
    labels = [analysis.positive or "<label>", analysis.negative or "<label>"]
    hint = (
        f'control is a mapping {{file: definitional.tsv, words: {{{labels[0]}: " <word>", {labels[1]}: '
        '" <word>"} (the word each label predicts)'
    )
    if not isinstance(node, dict) or not {"file", "words"} <= set(node) or set(node) - set(KEYS):
        ctx.fail(doc, "control", hint)
    words = _words(ctx, node, analysis, hint)
    columns = (str(node.get("prompt", "prompt")), str(node.get("label", "label")))
    extra = {key: str(node[key]) for key in ("pair", "set", "phrase") if key in node}  # optional columns
    path, text = ctx.read_data(node, "file", str(node["file"]))
    if path.suffix not in (".tsv", ".tab", ".csv"):
        ctx.fail(node, "file", "the control file is a TSV or CSV with a prompt and a label column")
    rows = delimited_rows(path, text, needed=(*columns, *extra.values()))
    if not rows:
        ctx.fail(node, "file", f"{path.name} holds no control prompts")
    for number, record in rows:
        if record[columns[1]] not in words:
            raise SuiteError(
                f"{path}:{number}: label {record[columns[1]]!r} is none of the control's words "
                f"({', '.join(words)}); fix the row or the `words`"
            )
        if not record[columns[0]].strip():
            raise SuiteError(f"{path}:{number}: the prompt is empty; fill it or drop the row")
    column = lambda key: tuple(str(r[extra[key]]) for _, r in rows) if key in extra else ()
    _both_labels(path, rows, columns, column("set"), words)
    sets, fit = column("set"), node.get("fit")
    if fit is not None and str(fit) not in sets:
        ctx.fail(
            node,
            "fit",
            f"`fit` names a value of the `set` column ({', '.join(dict.fromkeys(sets)) or 'none'})",
        )
    return Control(
        prompts=tuple(r[columns[0]] for _, r in rows),
        labels=tuple(r[columns[1]] for _, r in rows),
        words=tuple(words.items()),
        origin=str(path),
        pairs=column("pair"),
        sets=sets,
        fit=None if fit is None else str(fit),
        phrases=column("phrase"),
    )


def _both_labels(path, rows, columns, sets, words) -> None:
    """Each set of control prompts (the file, without a set column) holds both labels, and no prompt
    carries both: the factual term is the difference the two labels' words make, so a set of one
    label, or a prompt that predicts either word, leaves it unidentified."""
    prompt, label = columns
    first = {}
    for number, record in rows:
        seen = first.setdefault(record[prompt], (number, record[label]))
        if seen[1] != record[label]:
            raise SuiteError(
                f"{path}:{number}: this prompt is also row {seen[0]}'s, with the label {seen[1]!r}; a "
                "control prompt predicts one label's word: drop or reword one of them"
            )
    for name in dict.fromkeys(sets or ("",)):
        held = {r[label] for (_, r), s in zip(rows, sets or ("",) * len(rows)) if s == name}
        if len(held) < 2:
            where = f"the set {name!r}" if name else "every prompt"
            raise SuiteError(
                f"{path}: {where} carries the label {next(iter(held))!r} only; the factual term compares "
                f"the words of both labels ({', '.join(words)}): give that set prompts of each"
            )


def _words(ctx, node, analysis, hint: str) -> dict[str, str]:
    """`words`: the contrast's two labels, each with the next word it expects."""
    words = node["words"]
    if (
        not isinstance(words, dict)
        or len(words) != 2
        or not all(isinstance(w, str) and w.strip() for w in words.values())
    ):
        ctx.fail(
            node, "words", "`words` maps each of the contrast's two labels to its next word, e.g. " + hint
        )
    words = {str(label): word for label, word in words.items()}
    if analysis.paired and set(words) != {analysis.positive, analysis.negative}:
        ctx.fail(
            node,
            "words",
            f"`words` must name the contrast's labels {analysis.positive} and {analysis.negative} "
            f"(found {', '.join(words)})",
        )
    return words
