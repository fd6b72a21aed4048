"""The direct-attribution measure: which heads (reading which positions) and MLPs write the logit
difference at the prediction, and how much of its covariate gradient each writes.

  direct_attribution: {cut: pronoun}

At the token before the cut (the next_token measure's cut), y = logit(positive label's words) -
logit(negative label's words) (their first tokens; the analysis's two labels) splits into what each
part wrote into the residual there, through the final norm with its scale frozen (compute.py). A
head's part splits further over the classes of its source positions: each named span of the prompt,
`prediction` (the position itself) and `other`. Rows land in direct_attribution.parquet
(prompt_id, layer, head, position, value; head -1: not a head; layer -1: embedding, final bias, y
and the error), one prompt per distinct text before the cut in each chunk;
stats.kinds.direct_attribution gives the `direct_attribution_shares` table. Direct effects only:
what a head writes that later layers read is not counted here (path patching is).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ...errors import RunError
from ...forward.estimates import forwarded_tokens
from ...schema.yamllines import line_of, required_str
from ..base import PromptsMeasure, Scored

COLUMNS = ("prompt_id", "layer", "head", "position", "value")
PREDICTION, OTHER = "prediction", "other"  # classes of source positions besides the spans
BATCH = 32  # prompts per forward: every layer's values of every source position are kept


@dataclass(frozen=True)
class DirectAttributionMeasure:
    cut: str
    origin: str = ""


class DirectAttribution(PromptsMeasure):
    NAME = "direct_attribution"
    KEYS = {"direct_attribution": ("cut",)}
    CONTRACT = ("gender", 16)
    CSV = False  # a row per prompt, part and class of positions: Parquet only
    TABLES = ("direct_attribution_shares",)

    def parse(self, ctx, doc, scope) -> DirectAttributionMeasure | None:
        node = doc.get(self.NAME)
        if node is None:
            return None
        if not isinstance(node, dict) or set(node) - set(self.KEYS[self.NAME]):
            ctx.fail(doc, self.NAME, "direct_attribution is a mapping {cut: <a next_token cut>}")
        cut = required_str(ctx, node, "cut")
        cuts = [m.cut for m in scope.declared.get("next_token", ())]
        if cut not in cuts:
            ctx.fail(
                node, "cut", f"cut '{cut}' is not a next_token cut of the suite ({', '.join(cuts) or 'none'})"
            )
        if not scope.analysis.paired:
            ctx.fail(
                doc,
                self.NAME,
                "direct_attribution splits log p(positive) - log p(negative): declare the "
                "analysis's two labels (`analysis: {contrast, positive, negative}`)",
            )
        return DirectAttributionMeasure(cut, f"{ctx.path}:{line_of(node, 'cut')}")

    def plan(self, declared, scope) -> Scored:
        from ...model import routes_attention  # torch: not imported by a suite's parse

        if not routes_attention(scope.config):
            raise RunError(
                f"{declared.origin}: direct_attribution reads each head through attnprobe's attention "
                f"function, which {scope.spec} bypasses; remove direct_attribution or choose another model"
            )
        cut = declared.cut  # each prompt forwarded up to its cut (a prefix and one empty tail)
        prefix = lambda e: (e.ids[: e.spans[cut][0]], {0: ("", [])}) if cut in e.spans else None
        return Scored(forwarded_tokens(scope.encoded, prefix))

    def describe(self, declared, part) -> list[str]:
        return [
            f"direct_attribution: the logit difference before '{declared.cut}' split into what each head "
            "(by source position) and MLP wrote there, final norm frozen"
        ]

    def estimate(self, declared, part) -> list[tuple[str, float, int | None]]:
        from ...forward.estimates import DIRECT_TOKENS_PER_SECOND, scored_seconds

        return [(self.NAME, scored_seconds(part.tokens, DIRECT_TOKENS_PER_SECOND), part.tokens)]

    def manifest(self, declared, part) -> dict:
        return {self.NAME: {"cut": declared.cut} if declared else None}

    def count(self, declared, suite, encoded) -> int:
        return 1

    def score(self, pm, declared, suite, prompts, batch_size, advance) -> pd.DataFrame:
        from ...model.anatomy import parts_of
        from ...stats.kinds.direct_attribution import ERROR, TOTAL
        from .compute import attribute

        if parts_of(pm.model) is None:
            raise RunError(
                f"{declared.origin}: {pm.info.spec}'s layers are not laid out as direct_attribution reads "
                "them (an attention output projection and an MLP per layer, a final norm)"
            )
        analysis, tokenizer = suite.analysis, pm.tokenizer
        todo, seen = [], set()
        for e in prompts:
            wanted = _wanted(e, declared.cut, analysis, tokenizer)
            if wanted is None or wanted[0] in seen:
                continue
            seen.add(wanted[0])
            todo.append((e, *wanted))
        rows = []
        for i in range(0, len(todo), BATCH):
            batch = todo[i : i + BATCH]
            results = attribute(
                pm,
                [list(e.ids) for e, *_ in batch],
                [t for _, _, t, _, _ in batch],
                [labels for *_, labels, _ in batch],
                [classes for *_, classes in batch],
            )
            for (e, *_), result in zip(batch, results):
                rows += [(e.prompt.prompt_id, *key, value) for key, value in result["parts"].items()]
                rows += [
                    (e.prompt.prompt_id, -1, -1, TOTAL, result["y"]),
                    (e.prompt.prompt_id, -1, -1, ERROR, result["error"]),
                ]
            advance(len(batch))
        table = pd.DataFrame(rows, columns=list(COLUMNS))
        return table.astype({"layer": "int16", "head": "int16", "value": "float32", "position": "category"})

    def statistics(self, run, tables: dict) -> dict:
        from ...stats.kinds.direct_attribution import (
            direct_attribution,  # scipy: not loaded by a suite's parse
        )

        return {
            "direct_attribution_shares": direct_attribution(run) if run.has(self.NAME) else pd.DataFrame()
        }

    def section(self, run, tables: dict, figures) -> dict | None:
        table = tables.get("direct_attribution_shares")
        if table is None or table.empty:
            return None
        from ...stats.kinds.direct_attribution import report_section

        return report_section(table, run.manifest.entry(self.NAME)["cut"], run.manifest.analysis)


def _wanted(e, cut: str, analysis, tokenizer):
    """(the text before the cut, t, (positive ids, negative ids), the class of each source position),
    or None where the prompt has no cut or no candidate of a label."""
    if cut not in e.spans or cut not in e.prompt.candidates or e.spans[cut][0] < 1:
        return None
    words = {label: [] for label in (analysis.positive, analysis.negative)}
    for text, label in e.prompt.candidates[cut]:
        if label in words:
            words[label].append(tokenizer(text, add_special_tokens=False)["input_ids"][0])
    if not all(words.values()):
        return None
    t = e.spans[cut][0] - 1
    classes = []
    for s in range(t + 1):
        names = [name for name, (a, b) in e.spans.items() if name != cut and a <= s < b]
        classes.append(PREDICTION if s == t else names[0] if names else OTHER)
    before = (e.prompt.text[: e.prompt.spans[cut][0]], *map(tuple, words.values()))
    return before, t, (words[analysis.positive], words[analysis.negative]), classes
