"""Planning a run, pure functions only: which prompts, their tokens and spans, how far each is
forwarded, the length-sorted batches, the chunks, and the hashes a resumed run or a shard must share.

The plan depends only on the suite, the tokenizer and the settings, so a resumed run recomputes the
same batches and ends with results identical to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..defaults import DEFAULT_BATCH_SIZE
from ..errors import RunError, SuiteError
from ..forward.estimates import prompt_seconds, report_seconds
from ..forward.packing import distinct_tokens, neighbour_packs
from ..forward.sharing import prefix_sharing_blocker
from ..measures import MEASURES, PlanScope, batch_kinds
from ..model import DEFAULT_MODEL, ProbeModel, head_shape, load_tokenizer
from ..model.footprint import Shape, card, prompt_batch
from ..model.shapes import directory_name, is_random
from ..schema.spans import sink_notes
from ..suite import Prompt, Suite, spread_key, token_spans
from ..version import __version__


@dataclass(frozen=True)
class Encoded:
    prompt: Prompt
    ids: tuple[int, ...]
    spans: dict[str, tuple[int, int]]  # token ranges [start, end) in the unpadded prompt
    n_forward: int  # leading tokens the run forwards (see forward_length)

    @property
    def forward_ids(self) -> tuple[int, ...]:
        return self.ids[: self.n_forward]


def select_prompts(prompts: tuple[Prompt, ...], limit: int | None) -> list[Prompt]:
    """About `limit` prompts taken as whole items (all contrast variants), one item per template in
    turn, so a small run still spans every template; within a template items come in a fixed
    pseudo-random order (by a hash of the item id), so they spread over slot values such as
    occupations. Original prompt ids are kept."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    items: dict[str, dict[str, list[Prompt]]] = {}
    for prompt in prompts:
        items.setdefault(prompt.template_id, {}).setdefault(prompt.item_id, []).append(prompt)
    queues = [[by_item[k] for k in sorted(by_item, key=spread_key)] for by_item in items.values()]
    chosen: list[Prompt] = []
    for round_ in range(max(len(q) for q in queues)):
        for queue in queues:
            if round_ < len(queue):
                if chosen and len(chosen) + len(queue[round_]) > limit:
                    return sorted(chosen, key=lambda p: p.prompt_id)
                chosen.extend(queue[round_])
    return sorted(chosen, key=lambda p: p.prompt_id)


def encode_prompts(
    suite: Suite, prompts: list[Prompt], tokenizer, max_positions: int | None
) -> list[Encoded]:
    """Tokenise once and map spans to tokens; every problem is a `file:line:` SuiteError. The first
    position, where most models park attention (a sink), is treated as the suite says: `bos`
    prepends the tokenizer's BOS token where it adds none, `exclude` takes token 0 out of every span
    (a span of that token alone is not measured), `keep` leaves it (see `sink_notes`)."""
    encodings = tokenizer([p.text for p in prompts], return_offsets_mapping=True, add_special_tokens=True)
    # bos: the BOS token, else the end-of-text token (lm-eval's prefix token for a scored sentence)
    bos = getattr(tokenizer, "bos_token_id", None)
    bos = getattr(tokenizer, "eos_token_id", None) if bos is None else bos
    if suite.first_token == "bos" and bos is None:
        raise SuiteError(
            f"{suite.path}: first_token: bos, but this tokenizer has neither a BOS nor an end-of-text "
            "token; use first_token: exclude"
        )
    encoded = []
    for prompt, ids, offsets in zip(prompts, encodings["input_ids"], encodings["offset_mapping"]):
        if suite.first_token == "bos" and (not ids or ids[0] != bos):
            ids, offsets = [bos, *ids], [(0, 0), *offsets]  # (0, 0): a special token, in no span
        if max_positions is not None and len(ids) > max_positions:
            raise SuiteError(
                f"{prompt.origin}: prompt {prompt.prompt_id} has {len(ids)} tokens, more than the model's "
                f"context of {max_positions}; shorten the template or its slot values"
            )
        spans = token_spans([tuple(o) for o in offsets], prompt.spans)
        for name, (start, _) in spans.items():
            if start < 0:
                raise SuiteError(
                    f"{prompt.origin}: span '{name}' covers no token in {prompt.text!r}; give the slot "
                    "visible text"
                )
        if suite.first_token == "exclude":
            spans = {
                name: (max(start, 1), end)
                for name, (start, end) in spans.items()
                if end > 1 or name in prompt.candidates
            }
        encoded.append(Encoded(prompt, tuple(ids), spans, forward_length(suite, prompt, spans)))
    return encoded


def forward_length(suite: Suite, prompt: Prompt, spans: dict[str, tuple[int, int]]) -> int:
    """How many leading tokens of a prompt a run must forward. The models are causal: the attention
    row of a query and the logits at a position depend only on the tokens up to that position. So
    everything after the last token a per-batch measure reads (`ends`: an attention measure's
    spans, a next-token cut) is left out without changing any result (the gender suite: 63% of its
    tokens)."""
    ends = [end for kind in batch_kinds() for end in kind.ends(suite.measures[kind.NAME], prompt, spans)]
    return max(ends, default=1)


@dataclass(frozen=True)
class Batch:
    """Prompts forwarded together (indices into the encoded prompts), in packs: a pack of several
    prompts is forwarded as one row holding each shared prefix once (packing.run_with_shared_prefixes);
    a batch of packs of one is the plain forward, one prompt per row."""

    packs: tuple[tuple[int, ...], ...]

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(i for pack in self.packs for i in pack)

    @property
    def shared(self) -> bool:
        return any(len(pack) > 1 for pack in self.packs)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def plan_batches(
    encoded: list[Encoded], batch_size: int, max_batch_tokens: int | None = None, share_prefixes: bool = False
) -> list[Batch]:
    """Batches of at most `batch_size` prompts and, if given, at most `max_batch_tokens` padded
    tokens. Without `share_prefixes` every prompt is a row of its own, the rows sorted by forwarded
    length (then prompt id). With it, prompts sorted by their token ids are the leaves of a trie in
    order, and runs of neighbours form packs (packing.neighbour_packs), forwarded one pack per row;
    the packs are sorted by their token count."""
    if share_prefixes:
        order = sorted(
            range(len(encoded)), key=lambda i: (encoded[i].forward_ids, encoded[i].prompt.prompt_id)
        )
        packs, sizes = neighbour_packs([e.forward_ids for e in encoded], order, batch_size)
        size = {pack[0]: n for pack, n in zip(packs, sizes)}
    else:
        packs, size = [[i] for i in range(len(encoded))], {i: e.n_forward for i, e in enumerate(encoded)}
    packs.sort(key=lambda pack: (size[pack[0]], encoded[pack[0]].prompt.prompt_id))
    batches, current = [], []
    for pack in packs:
        longest = size[pack[0]]  # sorted: the newest row is the longest of its batch
        prompts = sum(map(len, current)) + len(pack)
        too_many_tokens = (
            max_batch_tokens is not None and current and (len(current) + 1) * longest > max_batch_tokens
        )
        if current and (prompts > batch_size or too_many_tokens):
            batches.append(Batch(tuple(current)))
            current = []
        current.append(tuple(pack))
    return batches + ([Batch(tuple(current))] if current else [])


def sharing_summary(chunks: list[list[Batch]], encoded: list[Encoded], blocker: str | None) -> dict:
    """For the manifest: whether prefixes were shared (or why not), and the tokens forwarded either
    way (unpadded: a shared prefix counts once per group)."""
    plain = sum(e.n_forward for e in encoded)
    forwarded = 0
    for pack in (pack for chunk in chunks for batch in chunk for pack in batch.packs):
        ids = sorted(encoded[i].forward_ids for i in pack)
        forwarded += distinct_tokens(ids)
    return {
        "enabled": blocker is None,
        "reason": blocker,
        "tokens_forwarded": forwarded,
        "tokens_without_sharing": plain,
    }


def plan_chunks(batches: list[Batch], chunk_size: int) -> list[list[Batch]]:
    """Consecutive batches grouped into chunks of at least `chunk_size` prompts (the last may be smaller)."""
    chunks, current = [], []
    for batch in batches:
        current.append(batch)
        if sum(len(b) for b in current) >= chunk_size:
            chunks.append(current)
            current = []
    return chunks + ([current] if current else [])


# ------------------------------------------------------------------------------ one batch


def plan_sha256(chunks: list[list[Batch]], encoded: list[Encoded]) -> str:
    """What every chunk forwards (prompt ids and forwarded token ids, pack by pack and batch by
    batch): a resumed run or a shard continues only a run that planned the very same batches, which
    another tokenizer or another attnprobe version may not."""
    plan = [
        [
            [[(encoded[i].prompt.prompt_id, encoded[i].forward_ids) for i in pack] for pack in batch.packs]
            for batch in chunk
        ]
        for chunk in chunks
    ]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()


def fingerprint(settings: dict, shard) -> str:
    """What a resumed run must share with the run it continues."""
    keyed = dict(settings, shard=list(shard)) if shard else settings
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------ the whole run


@dataclass(frozen=True)
class RunPlan:
    """Everything a run (or `check`) knows before any weights load: the prompts and their batches,
    each measure's part (its own plan: head-effect items and chunks, scored tokens, candidate ids),
    where results go and the hashes a resumed run or a shard must share."""

    suite: Suite
    spec: str  # the model spec
    name: str  # the model's directory name
    directory: Path
    dtype: str
    encoded: list[Encoded]
    blocker: str | None  # why prefixes are not shared (None: they are)
    chunks: list[list[Batch]]
    parts: dict  # measure name -> its plan part (None where it plans nothing), registry order
    settings: dict  # what the fingerprint and the manifest record
    fingerprint: str
    config: object = None  # the model's transformers config (memory estimates read its shape)

    def kinds(self):
        """(kind, declaration, part) of every registered measure, in registry order."""
        return [(kind, self.suite.measures[name], self.parts[name]) for name, kind in MEASURES.items()]

    @property
    def notes(self) -> list[str]:
        random = [
            f"the weights are random ({self.spec}): every table describes noise; this run measures speed "
            "and memory"
        ]
        random = random if is_random(self.spec) else []
        return random + list(self.suite.notes) + sink_notes(self.suite, self.encoded)

    @property
    def sharing(self) -> dict:
        return sharing_summary(self.chunks, self.encoded, self.blocker)

    def report_seconds(self) -> float:
        """Statistics and report on 2 CPU cores (on the host, whatever the device)."""
        n_layers, n_heads, _ = head_shape(self.config)
        per_head = any(kind.PER_HEAD_STATISTICS and kind.declared(self.suite) for kind, *_ in self.kinds())
        return report_seconds(n_layers * n_heads, len(self.encoded), per_head)

    def estimate_seconds(self) -> list[tuple[str, float, int | None]]:
        """[(phase, seconds, tokens or None)] for the reference model on 2 CPU cores: the prompts,
        then each declared measure's own phases."""
        phases = [("prompts", prompt_seconds(len(self.encoded)), None)]
        for kind, declared, part in self.kinds():
            if kind.declared(self.suite):
                phases += kind.estimate(declared, part)
        return phases


def refuse_data_directory(directory: Path, suite: Suite) -> None:
    """A run writes prompts.csv, attention.parquet, chunks/ and figures/ into its directory and --fresh
    deletes them: it must not be the directory of the suite or of a data file it reads (a sentence
    file named prompts.csv would be overwritten). Checked before anything is written."""
    out = directory.expanduser().resolve()
    for source in (suite.path, *suite.data_files):
        if Path(source).resolve().parent == out:
            raise RunError(
                f"--out {directory} is the directory of the suite's {Path(source).name}; a run writes its "
                "tables there and --fresh deletes them: choose another --out"
            )


def model_name(spec: str) -> str:
    """The directory name of a model spec: a path's last part (without .gguf), a hub id with '_' for '/'."""
    path = Path(spec)
    if is_random(spec):
        return directory_name(spec)
    if spec.endswith(".gguf"):
        return path.stem
    if path.exists():
        return path.resolve().name or "model"
    return spec.replace("/", "_")


def _prompt_batch(options, config, dtype: str, longest: int) -> int:
    """Prompts per forward pass where the user set none: DEFAULT_BATCH_SIZE on a CPU; on a GPU a whole
    chunk where it fits (model.footprint.prompt_batch) in the card's memory less the weights. The
    card's total, not what is free at this moment: every shard of a run on like cards, and a resumed
    run, plans the same batches (a plan's chunks are only continued by the same plan)."""
    shape = Shape.of(config) if str(options.device).startswith("cuda") else None
    try:
        total = card(options.device)[2] if shape is not None else None
    except RuntimeError:  # not a device torch knows: the run refuses it later, in its own words
        total = None
    if total is None:
        return DEFAULT_BATCH_SIZE
    return prompt_batch(shape, dtype, total - shape.weights(dtype), longest, options.chunk_size)


def _sharing_blocker(config, longest: int, options) -> str | None:
    """Why the run forwards no shared prefixes (None: it does): switched off, an edit acting at the
    prediction alone (one prompt's prediction may be a position another runs through), the family or
    the prompts (sharing.prefix_sharing_blocker)."""
    at_prediction = [e.name for e in options.edits if getattr(e.edit, "AT_PREDICTION", False)]
    if at_prediction:
        return f"the edit {at_prediction[0]} acts at the prediction alone"
    return prefix_sharing_blocker(config, longest) if options.share_prefixes else "switched off"


def plan_run(suite: Suite, model, options) -> RunPlan:
    """The plan of `suite` on `model` (a spec, a loaded ProbeModel, or None: the suite's model) with
    `options` (RunOptions). Reads the tokenizer only; every suite, token and head-effects problem
    surfaces here, before any weights load."""
    loaded = isinstance(model, ProbeModel)
    spec = model.info.spec if loaded else (model or suite.model or DEFAULT_MODEL)
    if loaded:
        tokenizer, max_positions, config = model.tokenizer, model.info.max_positions, model.model.config
    else:
        tokenizer, max_positions, config = load_tokenizer(spec, trust_remote_code=options.trust_remote_code)
    dtype = str(model.dtype).removeprefix("torch.") if loaded else options.dtype  # a loaded model's own
    prompts = select_prompts(suite.prompts, options.limit)
    encoded = encode_prompts(suite, prompts, tokenizer, max_positions)
    longest = max((e.n_forward for e in encoded), default=0)
    blocker = _sharing_blocker(config, longest, options)
    batch_size = options.batch_size or _prompt_batch(options, config, dtype, longest)
    batches = plan_batches(encoded, batch_size, options.max_batch_tokens, share_prefixes=blocker is None)
    chunks = plan_chunks(batches, options.chunk_size)
    sha = plan_sha256(chunks, encoded)
    for edit in options.edits:  # a saved edit must fit the model's heads, before any weights load
        edit.check_shape(config, spec)
    scope = PlanScope(suite, encoded, tokenizer, max_positions, config, spec, options)
    _check_skip(options.skip)
    parts = {  # every measure's own checks, before any weights load
        name: kind.plan(suite.measures[name], scope)
        if kind.declared(suite) and name not in options.skip
        else None
        for name, kind in MEASURES.items()
    }
    name = model.info.name if loaded else model_name(spec)
    directory = _directory(suite, name, options)
    settings = {
        "suite_sha256": suite.sha256,
        "model": spec,
        "dtype": dtype,
        "batch_size": batch_size,
        "chunk_size": options.chunk_size,
        "limit": options.limit,
        "max_batch_tokens": options.max_batch_tokens,
        "attnprobe": __version__,
        "share_prefixes": blocker is None,
        "plan_sha256": sha,
    }
    if options.edits:  # an edited run continues only a run with the same edits: kind, sites, values
        settings["edits"] = [edit.key for edit in options.edits]
    return RunPlan(
        suite,
        spec,
        name,
        directory,
        dtype,
        encoded,
        blocker,
        chunks,
        parts,
        settings,
        fingerprint(settings, options.shard),
        config,
    )


def _directory(suite: Suite, name: str, options) -> Path:
    """--out, else reports/SUITE/MODEL (-edited-EDITS); a shard's own directory below it."""
    edited = "+".join(edit.name for edit in options.edits)
    default = Path("reports") / suite.name / (f"{name}-edited-{edited}" if edited else name)
    directory = Path(options.out) if options.out else default
    if options.shard is not None:  # every rank may be given the same --out
        directory = directory / f"shard-{options.shard[0]}-of-{options.shard[1]}"
    refuse_data_directory(directory, suite)
    return directory


def _check_skip(skip) -> None:
    """Only a registered measure with phases of its own can be left out."""
    for name in skip:
        if name not in MEASURES or MEASURES[name] in batch_kinds():
            can = ", ".join(n for n, kind in MEASURES.items() if kind not in batch_kinds())
            raise RunError(f"cannot skip '{name}': the measures a run can leave out are {can}")
