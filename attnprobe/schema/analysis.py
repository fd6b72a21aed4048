"""What a suite's statistics compare: the declared analysis, as plain data.

A suite says which prompts form a pair and which two labels it compares (the contrast), which
units make observations dependent (the clusters, e.g. occupation and template), the covariate a
bias interaction is measured against (e.g. the occupation's share of women, owned by the unit
`occupation`) and named groups of templates (e.g. single-entity and two-entity). The suite loader
parses and checks it (attnprobe.suite.parse_analysis), the run records it in the manifest, and the
statistics and the report read it back with `Analysis.from_manifest`. Every name here is a column
of prompts.csv, so nothing after the run knows which suite, language or bias it is looking at.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# prompts.csv columns that the declaration's words `template` and `item` stand for
TEMPLATE, ITEM = "template_id", "item_id"
BEFORE = "before_"  # an attention source read at the token before its span is labelled BEFORE + span


@dataclass(frozen=True)
class Analysis:
    contrast: str | None = None  # column with each prompt's contrast label, e.g. pronoun_label
    positive: str | None = None  # d = a(positive prompt) - a(negative prompt) of one item
    negative: str | None = None
    labels: tuple[str, ...] = ()  # every contrast label the suite has, in order
    clusters: tuple[str, ...] = (ITEM,)  # one or two columns; observations dependent within each
    covariate: str | None = None  # numeric column, constant within `unit`
    unit: str | None = None  # column the covariate belongs to; permuted across in the interaction test
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group name -> template ids
    names: dict[str, str] = field(default_factory=dict)  # column -> the name the suite used (for text)
    referents: tuple[str, ...] = ()  # two target spans a pronoun may refer to, e.g. (referent, other)
    answer: str | None = None  # the correct one: one of `referents`, or a column naming it per prompt

    @property
    def paired(self) -> bool:
        """True when two labels are compared (otherwise only descriptive tables are made)."""
        return bool(self.contrast and self.positive and self.negative)

    def name(self, column: str | None) -> str:
        """The suite's word for a column: occupation for occupation, template for template_id."""
        return self.names.get(column, {TEMPLATE: "template", ITEM: "item"}.get(column, str(column)))

    @property
    def cluster_text(self) -> str:
        """How the tables state the unit of inference, e.g. "occupation x template"."""
        return " x ".join(self.name(c) for c in self.clusters)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> Analysis:
        raw = dict(raw)
        raw["labels"] = tuple(raw.get("labels", ()))
        raw["clusters"] = tuple(raw.get("clusters", (ITEM,)))
        raw["groups"] = {k: tuple(v) for k, v in raw.get("groups", {}).items()}
        raw["referents"] = tuple(raw.get("referents", ()))
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    @classmethod
    def from_manifest(cls, manifest, prompt_columns) -> Analysis:
        """The run's recorded analysis (of its run.files.manifest.Manifest); for a run made before analyses
        were recorded, the contrast column alone, compared only when it holds exactly two labels
        (decided by the caller)."""
        if manifest.analysis is not None:
            return cls.from_dict(manifest.analysis)
        contrast = manifest.suite.contrast
        column = next((c for c in (f"{contrast}_label", contrast) if c and c in prompt_columns), None)
        return cls(contrast=column)


def value_of(prompt, column: str):
    """A prompt's value in a prompts.csv column (None where the prompt has no such column)."""
    if column == TEMPLATE:
        return prompt.template_id
    if column == ITEM:
        return prompt.item_id
    return prompt.meta.get(column, prompt.slots.get(column))


FEW_LEVELS = 5  # a cluster dimension with fewer levels cannot carry a cluster-robust interval


def few_levels_notes(analysis: Analysis, levels: dict[str, int]) -> list[str]:
    """A note per declared cluster dimension with fewer than FEW_LEVELS distinct values (`levels`:
    column -> count): its cluster-robust intervals come from t with (levels - 1) df and say little
    (two files declared as "templates" give an accuracy CI of about [0, 1])."""
    return [
        f"cluster dimension {analysis.name(column)} has {n} levels: intervals clustered by it use t with "
        f"{n - 1} df and are too wide to conclude much; add levels, or drop it from analysis.clusters if "
        "its levels are fixed conditions rather than a sample"
        for column in analysis.clusters
        if 1 < (n := levels.get(column, 0)) < FEW_LEVELS
    ]


def covariate_notes(analysis: Analysis, prompts) -> list[str]:
    """Notes when the declared covariate cannot carry a slope (fewer than two distinct values over
    the prompts) or is missing for some prompts (e.g. a template's own `values:` that the slot's
    table does not list): those prompts drop out of every statistic that needs it."""
    if not analysis.covariate:
        return []
    name = analysis.name(analysis.covariate)
    values = [value_of(p, analysis.covariate) for p in prompts]
    distinct = {v for v in values if v is not None}
    notes = []
    if len(distinct) < 2:
        shown = ", ".join(map(str, sorted(distinct, key=str))) or "none"
        notes.append(
            f"covariate {name} takes {len(distinct)} distinct value(s) ({shown}) over the prompts: no "
            "slope across it can be estimated, so the interaction and gradient statistics stay empty; "
            "declare a covariate that varies, or remove it"
        )
    missing = sorted({p.template_id for p, v in zip(prompts, values) if v is None})
    if missing and distinct:
        count = sum(v is None for v in values)
        notes.append(
            f"{count} prompts have no value of covariate {name} (templates {_first_five(missing)}), "
            "e.g. a template's own values that the slot's "
            "table does not list: they are left out of the covariate statistics; add them to the table"
        )
    return notes


def candidate_notes(analysis: Analysis, prompts) -> list[str]:
    """A note per next_token cut whose candidates carry neither or only one of the compared labels:
    the behaviour table (log p(positive) - log p(negative)) has no row for it."""
    if not analysis.paired:
        return []
    labels: dict[str, set] = {}
    for p in prompts:
        for cut, candidates in p.candidates.items():
            labels.setdefault(cut, set()).update(str(label) for _, label in candidates)
    return [
        f"next_token at '{cut}': the candidates' labels ({', '.join(sorted(seen)[:5])}) do not include both "
        f"compared labels '{analysis.positive}' and '{analysis.negative}': the behaviour table has no row "
        "for it; label the candidates like the contrast"
        for cut, seen in labels.items()
        if not {analysis.positive, analysis.negative} <= seen
    ]


def contrast_notes(analysis: Analysis, prompts) -> list[str]:
    """A note for templates with no prompt of one compared label (e.g. `values:` that keep one
    pronoun): their items have no pair and drop out of every paired statistic."""
    if not analysis.contrast:
        return []
    labels: dict[str, set] = {}
    for p in prompts:
        labels.setdefault(p.template_id, set()).add(str(value_of(p, analysis.contrast)))
    seen = set().union(*labels.values()) if labels else set()
    if not analysis.paired:
        return (
            [
                f"the contrast {analysis.name(analysis.contrast)} has one label over the prompts "
                f"({', '.join(sorted(seen))}): no item has a pair, so no paired statistics are made; give "
                "the contrast slot two values (check `values:` of the templates)"
            ]
            if len(seen) < 2
            else []
        )
    notes = []
    for label in (analysis.positive, analysis.negative):
        lacking = [t for t, seen in labels.items() if label not in seen]
        if lacking:
            notes.append(
                f"template(s) {_first_five(lacking)} have no "
                f"prompt labelled '{label}' in {analysis.name(analysis.contrast)}: their items have no pair "
                "and drop out of the paired statistics; give the template both values"
            )
    return notes


def _first_five(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" and more" if len(names) > 5 else "")
