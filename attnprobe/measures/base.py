"""The measure protocol: what each kind of measure gives the suite loader, the run and the statistics.

A kind is a `Measure` subclass registered by its YAML key in `attnprobe.measures.MEASURES`. The suite
loader, the run's plan, phases, directory, reader, manifest, `check`'s description, merge and the
statistics loop over that registry; none of them names a measure. A suite's declaration of a kind
(`suite.measures[NAME]`, `NONE` when the suite declares none) and the kind's plan part
(`plan.parts[NAME]`) are handed to every method:

  parse(ctx, doc, scope)        the declaration, validated with file and line (ParseScope: what the
                                suite knows before its measures, and the kinds parsed before this one)
  plan(declared, scope)         everything checked before weights load (tokens, context); the part
  describe(declared, part)      the lines `attnprobe check` prints
  estimate(declared, part)      [(phase, seconds on the reference model, tokens or None)]
  held(declared, part)          [(phase, tokens, sequences)] its phases hold at once, recorded at every
                                layer with a backward pass (memory estimates); [] for none
  manifest(declared, part)      the keys it adds to manifest.json
  resumed(declared, part, previous, directory)  what a resumed run keeps of the previous manifest
  compute(declared, part, engine)  its phases (the run's engine: markers, Ctrl-C, progress, resume);
                                called for every kind, declared or not, after the prompts phase
  merge(shards, out, merged)    its files of a sharded run joined into `out`
  statistics(run, tables)       its statistics tables ({name: DataFrame}), given those computed before
  section(run, tables, figures_dir)  its part of the report (title, text, a table, figures), or None
  paired(a, b, scopes)          `attnprobe compare`: its per-item values in runs A and B, the change
                                tested (stats.compare.change_table), {table: rows}; {} where none

and declares NAME, ARTEFACTS (its run-directory files: --fresh removes them), CHUNKS (chunk prefix ->
the files of one chunk), READS (RunFiles attribute -> table file) and TABLES (the statistics tables
it writes), CONTRACT (the shipped suite its contract test runs). `BatchMeasure`s are read from the
prompts' one forward pass (one phase for all of them);
`ScoredMeasure`s score continuations of each prompt in their own phase. tests/model/test_measures.py runs
every registered kind through the whole contract on a tiny model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd


@dataclass(frozen=True)
class Phase:
    """A resumable unit of a run's work: chunks computed one by one, each with its marker."""

    name: str  # in log lines: "<name> chunk 3 of 10" ("" for the prompts)
    prefix: str  # chunk files are chunks/<prefix><k>.* (the kinds' CHUNKS name them)
    plan: str | None  # recorded in each chunk's marker; a chunk of another plan is redone
    n_chunks: int
    mine: tuple[int, ...]  # the chunks this process computes, in order
    compute: Callable  # (k, advance(n)) -> {table name: table} of chunk k
    size: Callable[[int], int]  # progress units of chunk k
    unit: str = "prompt"
    desc: str = "attnprobe run"  # the progress bar's and progress lines' label
    rate: bool = False  # after the first chunk, log the seconds per unit and the time left
    files: tuple[str, ...] | None = None  # a chunk's files when no kind's CHUNKS names the prefix


@dataclass(frozen=True)
class ParseScope:
    """What a measure's `parse` may read: the suite as known before its measures."""

    slots: dict
    span_names: set
    template_ids: set
    analysis: object
    columns: set  # the prompts' columns (slots, metadata, template_id)
    declared: dict  # the kinds parsed before this one (registry order): name -> declaration
    notes: list  # a kind may add a line the suite's notes carry (measured, but worth saying)


@dataclass(frozen=True)
class PlanScope:
    """What a measure's `plan` may read: the suite, its encoded prompts and the model's tokenizer."""

    suite: object
    encoded: list  # plan.Encoded, in prompt order
    tokenizer: object
    max_positions: int | None
    config: object  # the model's config (no weights)
    spec: str
    options: object  # RunOptions


class Measure(ABC):
    NAME: ClassVar[str] = ""  # the suite's YAML key
    KEYS: ClassVar[dict[str, tuple[str, ...]]] = {}  # block -> the keys it may hold (schema.keys' table)
    NONE: ClassVar[object] = None  # the declaration of a suite without it
    ARTEFACTS: ClassVar[tuple[str, ...]] = ()
    CHUNKS: ClassVar[dict[str, tuple[str, ...]]] = {}
    READS: ClassVar[dict[str, str]] = {}  # RunFiles attribute -> file (a missing file reads as None)
    TABLES: ClassVar[tuple[str, ...]] = ()
    FIRST_TOKEN: ClassVar[str | None] = None  # the suite's first_token default when it declares this
    OPTIONAL: ClassVar[bool] = False  # a run of a suite without it has none of its files (READS are None)
    CONTRACT: ClassVar[tuple[str, int] | None] = None  # a shipped suite declaring it (probes/<name>.yaml)
    # and a --limit: tests/model/test_measures.py runs the kind through the whole contract on it
    PER_HEAD_STATISTICS: ClassVar[bool] = False  # statistics per head and prompt (check's report time)

    def declared(self, suite) -> bool:
        found = suite.measures.get(self.NAME, self.NONE)
        return found is not None and found != ()

    def present(self, directory, manifest) -> bool:
        """A run directory holds its results (every file it reads is there)."""
        return all(any(directory.glob(f"{file.removesuffix('.parquet')}.*")) for file in self.READS.values())

    @abstractmethod
    def parse(self, ctx, doc, scope: ParseScope): ...

    def plan(self, declared, scope: PlanScope):
        return None

    @abstractmethod
    def describe(self, declared, part) -> list[str]: ...

    def estimate(self, declared, part) -> list[tuple[str, float, int | None]]:
        return []

    def held(self, declared, part) -> list[tuple[str, int, int]]:
        return []

    @abstractmethod
    def manifest(self, declared, part) -> dict:
        """The entries it records in the run's manifest (read back with `manifest.entry(key)`)."""

    def resumed(self, declared, part, previous, directory) -> dict:
        """The entries a resumed run keeps from `previous` (its run.files.manifest.Manifest; None for a
        new run)."""
        return {}

    @abstractmethod
    def compute(self, declared, part, engine) -> None: ...

    @abstractmethod
    def merge(self, shards: list, out, merged) -> None:
        """Join its files of `shards` ((directory, Manifest) in shard order) into `out`; it may set
        its entries of the `merged` Manifest."""

    @abstractmethod
    def statistics(self, run, tables: dict) -> dict[str, pd.DataFrame]: ...

    def tables(self, run) -> tuple[str, ...]:
        """The statistics tables it writes for this run (TABLES, or none when it has nothing)."""
        return self.TABLES

    def paired(self, a, b, scopes: dict) -> dict[str, pd.DataFrame]:
        """Paired statistics of two runs of the same prompts (`attnprobe compare`): {table name: rows}
        (stats.compare.change_table over `scopes`: name -> item ids); {} for a kind that compares nothing."""
        return {}

    def section(self, run, tables: dict, figures) -> dict | None:
        """Its part of the report, or None where it shows nothing: a dict the report lays out.
        With "template" (a path or importlib Traversable of a Jinja file) that file lays it out,
        seeing it as `sec`, the run's context as `run` (labels pos/neg, covariate, unit, n_heads,
        n_layers) and `alpha`; without, the generic layout: "title", "text" (its sentences, with
        units and numbers), "columns" ([(key, header, format)]), "rows" (records), "figures". A
        "lead_figure" goes beside the run's key findings. `figures` (attnprobe.plotting.Figures)
        saves a figure under the run's figures/ and holds the colour ranges the runs of one report
        share; figures are drawn with attnprobe.plotting.plots."""
        return None


class BatchMeasure(Measure):
    """Read from the prompts' one forward pass: `request(declared, batch)` -> (capture keywords,
    state); `read(pm, declared, part, batch, captured, state)` -> this batch's part;
    `chunk_table(parts, pm)` -> the chunk's table (chunk file `<k>.<CHUNKS[""][0]>`); `assemble`
    joins the chunks into the run's table; `ends` bounds what the prompts' forward must include. The
    run's prompts phase computes, stores and merges them.

    `read` sees the captured tensors on the CPU; a kind with ON_DEVICE = True sees them where the
    model runs (a GPU, say) and reduces them there, copying only its results (the built-in kinds:
    a batch's captured rows and logits are far larger than what the tables keep)."""

    ON_DEVICE = False

    @abstractmethod
    def ends(self, declared, prompt, spans) -> list[int]:
        """The token positions after which it reads nothing in this prompt (its tokens' spans):
        the run forwards each prompt only up to the last of every kind's ends."""

    @abstractmethod
    def request(self, declared, batch) -> tuple[dict, object]: ...

    @abstractmethod
    def read(self, pm, declared, part, batch, captured, state): ...

    @abstractmethod
    def chunk_table(self, parts: list, pm): ...

    @abstractmethod
    def assemble(self, directory, n_chunks: int) -> None: ...

    def compute(self, declared, part, engine) -> None:
        return None  # in the prompts phase

    def merge(self, shards: list, out, merged) -> None:
        return None  # the prompts' chunks are joined by the run's merge


@dataclass(frozen=True)
class Scored:
    """A scored phase's plan part: the tokens it forwards (prefixes shared) and its plan key."""

    tokens: int


class PromptsMeasure(Measure):
    """Its own phase over chunks of the prompts (chunk files `<prefix><k>.<NAME>.parquet`, computed
    by the first shard, joined into `<NAME>.parquet`): `score(pm, declared, suite, prompts,
    batch_size, advance)` -> the chunk's table; `count(declared, suite, encoded)` -> the progress
    units of a prompt."""

    CSV: ClassVar[bool] = True  # its table also as CSV (a table of millions of rows is Parquet only)

    @classmethod
    def prefix(cls) -> str:
        return cls.NAME.replace("_", "-") + "-"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.NAME:
            cls.ARTEFACTS = (f"{cls.NAME}.csv",) * cls.CSV + (f"{cls.NAME}.parquet",)
            cls.CHUNKS = {cls.prefix(): (f"{cls.NAME}.parquet",)}
            cls.READS = {cls.NAME: cls.NAME}
            cls.OPTIONAL = True

    @abstractmethod
    def score(self, pm, declared, suite, prompts, batch_size: int, advance) -> pd.DataFrame: ...

    @abstractmethod
    def count(self, declared, suite, encoded) -> int: ...

    def plan_key(self, declared) -> str:
        """What joins the prompts' plan in the phase's plan hash (a changed question redoes it)."""
        return getattr(declared, "prompt", self.NAME)

    def estimate(self, declared, part) -> list[tuple[str, float, int | None]]:
        from ..forward.estimates import scored_seconds

        return [(self.NAME, scored_seconds(part.tokens), part.tokens)]

    def compute(self, declared, part, engine) -> None:
        if part is not None:  # declared and not skipped
            engine.scored(self, declared)

    def merge(self, shards: list, out, merged) -> None:
        import shutil

        first = shards[0][0]  # shard 1 computes every such phase
        for name in self.ARTEFACTS:
            if (first / name).is_file():
                shutil.copyfile(first / name, out / name)
        for path in (first / "chunks").glob(f"{self.prefix()}*"):
            shutil.copyfile(path, out / "chunks" / path.name)


class ScoredMeasure(PromptsMeasure):
    """Scored continuations of each prompt, in its own phase: `sequences(declared, encoded,
    tokenizer, suite)` -> a prompt's scored prefix and tails (the context check and the estimate read
    it), CONTEXT: what the context check names."""

    CONTEXT: ClassVar[str] = ""

    @abstractmethod
    def sequences(self, declared, encoded, tokenizer, suite): ...

    def plan(self, declared, scope: PlanScope) -> Scored:
        from ..forward.estimates import forwarded_tokens
        from ..forward.scoring import check_context

        computed = {id(e): self.sequences(declared, e, scope.tokenizer, scope.suite) for e in scope.encoded}
        sequences = lambda e: computed[id(e)]  # tokenised once: the check and the count read it
        if self.CONTEXT:
            where = self.CONTEXT.format(origin=getattr(declared, "origin", ""))
            check_context(scope.encoded, sequences, scope.max_positions, where)
        return Scored(forwarded_tokens(scope.encoded, sequences))
