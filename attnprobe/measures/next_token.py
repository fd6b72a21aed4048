"""The next-token measure: log-probabilities of candidate continuations where a span begins.

The prompt is cut right before the span `cut`; each candidate (an explicit string, or the values
of a slot in the form and case shown at the cut, with the space before it) is scored as
log p(candidate | prefix), summed over its tokens. Rows land in logprobs.csv:
(prompt_id, cut, candidate, candidate_label, logprob).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ..errors import SuiteError
from ..schema.yamllines import as_list, line_of, required_str
from ..store import write_table
from .base import BatchMeasure

LOGPROB_COLUMNS = ("prompt_id", "cut", "candidate", "candidate_label", "logprob")


@dataclass(frozen=True)
class NextTokenMeasure:
    cut: str  # the span before whose first token the prompt is cut
    candidates: tuple[str, ...] | str  # explicit strings, or the name of a slot to take them from
    origin: str = ""  # file:line, for error messages
    ambiguous: str = "sum"  # a form shared by two cases (" her": acc and poss): sum | exclude

    KEY = "next_token"

    @property
    def spans(self) -> tuple[str, ...]:
        return (self.cut,)

    def missing(self, span: str) -> str:
        return f"next_token at '{self.cut}': not measured where span '{span}' is absent"

    @staticmethod
    def parse(ctx, node, slots, span_names=()) -> tuple[NextTokenMeasure, ...]:
        measures = []
        for i, item in enumerate(node):
            if not isinstance(item, dict):
                ctx.fail(node, i, "each next_token measure is a mapping with `cut:` and `candidates:`")
            ctx.check_keys(item, NextToken.KEYS["next_token"], " in a next_token measure")
            cut = required_str(ctx, item, "cut")
            candidates = item.get("candidates")
            if isinstance(candidates, str):
                if candidates not in slots and candidates not in span_names:
                    ctx.fail(
                        item,
                        "candidates",
                        f"candidates '{candidates}' is not a slot or span; give a slot name, a span "
                        'name (the words of that span in the item\'s prompts) or a list like [" yes", " no"]',
                    )
            elif isinstance(candidates, list) and candidates:
                for j, candidate in enumerate(candidates):
                    if not isinstance(candidate, str) or candidate == "":
                        ctx.fail(
                            candidates,
                            j,
                            f'candidate {j + 1} is empty; give the word with its leading space, e.g. " yes"',
                        )
                candidates = tuple(candidates)
            else:
                ctx.fail(
                    item, "candidates", "`candidates` must be a slot name or a non-empty list of strings"
                )
            ambiguous = item.get("ambiguous", "sum")
            if ambiguous not in ("sum", "exclude"):
                ctx.fail(
                    item,
                    "ambiguous",
                    "`ambiguous` is sum (score a shared form against the sum of the other "
                    "labels' forms of those cases) or exclude (leave such prompts out)",
                )
            if any(m.cut == cut for m in measures):
                ctx.fail(
                    item,
                    "cut",
                    f"a second next_token measure at '{cut}'; give one measure per cut (its rows would "
                    "replace the first's)",
                )
            measures.append(
                NextTokenMeasure(
                    cut, candidates, origin=f"{ctx.path}:{line_of(item, 'candidates')}", ambiguous=ambiguous
                )
            )
        return tuple(measures)

    def compared_forms(self, prompt, slots) -> tuple[str, ...]:
        """The slot forms compared at this prompt's cut: the form shown there (e.g. acc), plus every
        form that any value spells the same way in it (" her" is acc and poss: (acc, poss))."""
        slot = slots[self.candidates]
        form = prompt.span_forms.get(self.cut)  # the form shown at the cut, e.g. nom for "she"
        form = form if form in slot.form_names else slot.form_names[0]
        shared = {
            other
            for value in slot.values
            for other in slot.form_names
            if value.forms[other] == value.forms[form]
        }
        return tuple(f for f in slot.form_names if f in shared)

    def candidates_from_item(self, prompt, siblings, label_of) -> tuple[tuple[str, str], ...]:
        """For a span that is not a slot (sentence files): the words each prompt of the item has in
        that span, with the space before it, labelled by that prompt's contrast label (e.g. the pro
        and anti pronouns of a pair, which share the prefix before the cut)."""
        out = []
        for sibling in siblings:
            if self.candidates not in sibling.spans:
                continue
            start, end = sibling.spans[self.candidates]
            space = sibling.text[start - 1] if start > 0 and sibling.text[start - 1].isspace() else ""
            out.append((space + sibling.text[start:end], str(label_of(sibling))))
        return tuple(dict.fromkeys(out))

    def candidates_for(self, prompt, slots) -> tuple[tuple[str, str], ...]:
        """(text, label) pairs. From a slot: each value in the form and case used at the cut, with the
        space that precedes the span in this prompt (so " she" after "said that", "She" at the start).
        Where a form is ambiguous (" her" is acc and poss), every label gets its words of all the
        cases involved (" him", " his"), whose probabilities the statistics sum; or, with
        `ambiguous: exclude`, the prompt gets no candidates."""
        if not isinstance(self.candidates, str):
            return tuple((c, c.strip()) for c in self.candidates)
        if self.candidates not in slots:
            raise ValueError("candidates from a span are given by candidates_from_item")
        start, end = prompt.spans[self.cut]
        shown = prompt.text[start:end]
        space = (
            prompt.text[max(0, start - 1) : start] if start > 0 and prompt.text[start - 1].isspace() else ""
        )
        forms = self.compared_forms(prompt, slots)
        if len(forms) > 1 and self.ambiguous == "exclude":
            return ()
        out = []
        for value in slots[self.candidates].values:
            label = str(value.meta.get("label", "/".join(value.forms.values())))
            for form in forms:
                word = value.forms[form]
                if shown[:1].isupper():
                    word = word[:1].upper() + word[1:]
                out.append((space + word, label))
        return tuple(dict.fromkeys(out))


def candidate_ids(measures, prompts, tokenizer) -> dict[str, tuple[int, ...]]:
    """Token ids of every candidate string, tokenised as a continuation (no special tokens)."""
    origins = {m.cut: m.origin for m in measures}
    table = {}
    for prompt in prompts:
        for cut, candidates in prompt.candidates.items():
            for text, _ in candidates:
                if text not in table:
                    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
                    if not ids:
                        raise SuiteError(
                            f"{origins.get(cut, prompt.origin)}: candidate {text!r} tokenises to nothing; "
                            'give a visible word such as " yes"'
                        )
                    table[text] = ids
    return table


class NextToken(BatchMeasure):
    NAME = "next_token"
    KEYS = {"next_token": ("ambiguous", "candidates", "cut")}
    CONTRACT = ("gender", 16)
    NONE = ()
    ARTEFACTS = ("logprobs.csv", "logprobs.parquet")
    CHUNKS = {"": ("logprobs.parquet",)}  # <k>.logprobs.parquet
    READS = {"logprobs": "logprobs"}
    TABLES = ("behavior", "behavior_by_unit")
    ON_DEVICE = True  # log-probabilities over the vocabulary where the logits are

    def parse(self, ctx, doc, scope) -> tuple[NextTokenMeasure, ...]:
        node = as_list(ctx, doc, "next_token", "measures {cut, candidates}")
        return NextTokenMeasure.parse(ctx, node, scope.slots, scope.span_names)

    def plan(self, declared, scope) -> dict[str, tuple[int, ...]]:
        """The candidates' token ids (every problem before weights load)."""
        return candidate_ids(declared, [e.prompt for e in scope.encoded], scope.tokenizer)

    def describe(self, declared, part) -> list[str]:
        shown = lambda m: m.candidates if isinstance(m.candidates, str) else list(m.candidates)
        return [f"next_token: at {m.cut}, candidates {shown(m)}" for m in declared]

    def manifest(self, declared, part) -> dict:
        return {}

    def ends(self, declared, prompt, spans) -> list[int]:
        """The token before each cut is the last it reads (a cut at the first token is refused)."""
        for cut in prompt.candidates:
            if spans[cut][0] == 0:
                raise SuiteError(
                    f"{prompt.origin}: next_token cut at '{cut}' leaves no tokens before it in "
                    f"{prompt.text!r}"
                )
        return [spans[cut][0] for cut in prompt.candidates]

    def request(self, declared, batch) -> tuple[dict, list[list[int]]]:
        """What this kind needs from the batch's forward pass: the logits before each prompt's cuts,
        (B, P) positions padded by repeating the first (the lm head runs only on those)."""
        import torch  # torch: not loaded by a suite's parse

        positions = logit_positions(batch)
        P = max(map(len, positions))
        if not P:
            return {"logit_positions": None}, positions
        return {
            "logit_positions": torch.tensor([p + [p[0] if p else 0] * (P - len(p)) for p in positions])
        }, positions

    def read(self, pm, declared, part, batch, captured, positions) -> pd.DataFrame:
        return pd.DataFrame(logprobs(pm, batch, captured.logits, positions, part))

    def chunk_table(self, parts: list[pd.DataFrame], pm) -> pd.DataFrame:
        return pd.concat(parts, ignore_index=True).sort_values(
            ["prompt_id", "cut"], kind="stable", ignore_index=True
        )

    def assemble(self, directory, n_chunks: int) -> None:
        chunk_dir = directory / "chunks"
        logprobs = [pd.read_parquet(chunk_dir / f"{k:05d}.logprobs.parquet") for k in range(n_chunks)]
        table = pd.concat(logprobs, ignore_index=True) if logprobs else pd.DataFrame()
        if len(table):
            table = table.sort_values(["prompt_id", "cut"], kind="stable", ignore_index=True)
        write_table(directory, "logprobs", table)

    def statistics(self, run, tables: dict) -> dict:
        from ..stats.kinds.next_token import behavior

        table, by_unit = behavior(run)
        return {"behavior": table, "behavior_by_unit": by_unit}

    def section(self, run, tables: dict, figures) -> dict | None:
        from .sections import behaviour_section  # matplotlib: not loaded by a suite's parse

        return behaviour_section(run, tables, figures) if "behavior" in tables else None

    def paired(self, a, b, scopes):
        from ..stats.compare import change_table
        from ..stats.kinds.next_token import item_log_ratios

        y = [item_log_ratios(run) for run in (a, b)]
        if y[0] is None or y[1] is None:
            return {}
        return {"compare_next_token": change_table(*y, a, scopes)}


def logit_positions(batch) -> list[list[int]]:
    """The positions whose next-token logits each prompt of a batch needs: the token before each cut."""
    return [sorted({e.spans[cut][0] - 1 for cut in e.prompt.candidates}) for e in batch]


def logprobs(pm, batch, logits, positions, cand_ids) -> dict:
    """Rows of logprobs.csv for one batch, as column lists. logits: (B, P, V), prompt b's at
    `positions[b]`, on the model's device: normalised there, and only the candidates' first tokens
    copied to the CPU."""
    import torch

    out = {name: [] for name in LOGPROB_COLUMNS}
    if logits is None:
        return out
    picks, continuations = [], []  # (b, p, first token) per row; candidates of several tokens
    for b, e in enumerate(batch):
        for cut, candidates in e.prompt.candidates.items():
            p = positions[b].index(e.spans[cut][0] - 1)
            for text, label in candidates:
                tokens = cand_ids[text]
                picks.append((b, p, tokens[0]))
                if len(tokens) > 1:  # need their own forward pass
                    continuations.append((len(out["logprob"]), e.ids[: e.spans[cut][0]], tokens))
                for key, item in zip(out, (e.prompt.prompt_id, cut, text, label, None)):
                    out[key].append(item)
    if not picks:
        return out
    b, p, token = torch.tensor(picks, device=logits.device).T
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, P, V)
    out["logprob"] = logp[b, p, token].cpu().tolist()
    if continuations:
        _add_continuations(pm, out["logprob"], continuations)
    return out


def _add_continuations(pm, logprobs: list, continuations: list) -> None:
    """log p(c1..cn | prefix) = sum_i log p(c_i | prefix, c_<i); the first term is already in place."""
    import torch

    from ..attention.logits import read_at
    from ..forward.packing import pad_right

    ids, mask = pad_right([prefix + tokens for _, prefix, tokens in continuations], pm.tokenizer.pad_token_id)
    # the positions predicting each continuation's tokens (its first's too: an edit there acts there)
    rows = torch.tensor([b for b, (_, _, c) in enumerate(continuations) for _ in c], dtype=torch.long)
    at = torch.tensor([len(prefix) - 1 + j for _, prefix, c in continuations for j in range(len(c))])
    with torch.inference_mode(), read_at((rows, at)):
        logits = pm.model(input_ids=ids.to(pm.device), attention_mask=mask.to(pm.device)).logits
        logp = torch.log_softmax(logits.float(), -1)
    for b, (slot, prefix, tokens) in enumerate(continuations):
        logprobs[slot] += sum(logp[b, len(prefix) + i - 1, tokens[i]].item() for i in range(1, len(tokens)))
