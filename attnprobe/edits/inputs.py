"""What every edit kind is measured on, recorded once: the head-effects items and their reference
counterfactuals, the suite's definitional control prompts (its `control:` block), text the original
model writes from neutral openings (data/openings.txt, shipped with the package; seeded) and pieces
of the user's --text.

The control's gendered phrases also go into the suite's own sentences (`template_prompts`): each
distinct phrase of the control ("the king", "Mary": its `phrase` column) takes the place of "the
<occupation>" in one item of every head-effects template, cut where that item is cut. So the
stereotype (the occupations' covariate) and the factual gender (the phrases' labels) are read in the
same templates, at the same position, with the same label words (" she" / "She" / " her"), and
stats/keeping/joint.py fits both terms in one regression. These prompts are never fitted on: a keep
constraint is fitted on the control file's own prompts, so the templates are a family no keep fit
saw, and a noun is judged with the edit fitted on the other half of the word pairs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..errors import AttnprobeError, RunError
from ..intervene.engine import Bank, record
from ..intervene.items import PatchItem
from ..intervene.selection import folds, opposite
from ..intervene.sites import label_ids
from .estimate import control_halves

OPENINGS = files("attnprobe.edits") / "data" / "openings.txt"
GENERATED_TOKENS = 24  # per neutral opening
TEXT_BATCH = 8  # openings sampled together
TEXT_TOKENS = 1024  # at most this many tokens of --text, in pieces of TEXT_PIECE
TEXT_PIECE = 128
TEXT_BYTES = 256 * 1024  # read of --text: 256 bytes per token allowed


@dataclass
class Inputs:
    """What every edit kind is measured on (recorded once)."""

    items: list[PatchItem]
    fold: np.ndarray  # (N,) fold of each item
    n_templates: int
    covariate: np.ndarray  # (N,)
    bank: Bank  # the items' x
    reference: Bank  # the items' reference counterfactuals x'
    reference_fold: np.ndarray  # fold of each reference sequence
    control: Bank
    control_sign: np.ndarray  # +1 where the positive label is right, -1 where the negative is
    control_half: np.ndarray  # 0: fits definitional directions, 1: the other half, 2: never fitted
    control_set: np.ndarray  # per control prompt, its set ("" without a set column)
    control_pair: np.ndarray  # per control prompt, its word pair ("" without a pair column)
    control_template: np.ndarray  # per control prompt, the template it fills ("" for the file's own)
    control_fit: np.ndarray  # per control prompt, whether a keep constraint may be fitted on it
    texts: Bank
    text_is_user: np.ndarray  # (n texts,) True for pieces of --text
    clean_logp: list[torch.Tensor]
    labels: torch.Tensor  # (N, 2, K) each item's positive and negative label ids (-1 padded)
    control_labels: torch.Tensor  # (M, 2, K) the positive and negative label's word for every control prompt
    slot_at: np.ndarray  # (N,) each item's slot (occupation): the position of its last token
    control_at: np.ndarray  # (M,) each control prompt's phrase: its last token's position (-1: no phrase)

    def other_half(self) -> Inputs:
        """These inputs with the control's halves 0 and 1 exchanged (2 kept): an edit fitted on them
        keeps the direction of the other half's words."""
        return replace(self, control_half=np.where(self.control_half == 2, 2, 1 - self.control_half))

    def words_half(self) -> np.ndarray:
        """Per control prompt, the cross-fitting half of its words: its word pair's half where a fit
        used that pair, whatever frame the prompt is in (its own, a new one, the items' templates); 2
        for words no fit used; a prompt without a pair, its own half."""
        pairs = np.asarray(self.control_pair, dtype=object)
        fitted = self.control_fit & (self.control_half != 2) & (pairs != "")
        of_pair = dict(zip(pairs[fitted], self.control_half[fitted]))
        return np.array([of_pair.get(p, 2) if p != "" else h for p, h in zip(pairs, self.control_half)])

    def judged_by_other_half(self) -> np.ndarray:
        """Per control prompt, 1 where the edit judging it keeps the direction fitted on half 1's words
        (`other_half`), 0 where on half 0's: a prompt of half 0's words (words_half) is judged by the
        fit on the other half, so no prompt is judged by a constraint fitted on its own words."""
        return (self.words_half() == 0).astype(int)

    def keep_rows(self) -> np.ndarray:
        """The control prompts a keep direction is fitted on: half 0 of the fitted set's words."""
        return (self.control_half == 0) & self.control_fit

    def training(self, fold: int) -> np.ndarray:
        """The folds the heads and parameters tested on `fold` come from: the opposite one, or
        (when it has no items) every fold of the other unit half."""
        on = opposite(fold, self.n_templates)
        if (self.fold == on).any():
            return np.array([on])
        return np.array([g for g in range(4) if g // 2 != fold // 2])

    def describe(self, raw: pd.DataFrame) -> pd.DataFrame:
        """The columns the statistics need beside the raw values, so edits_items stands alone: per bias
        row its item, unit, template and covariate; per control row the label's sign, its cross-fitting
        half (2: no fit used it), the half of its words (words_half), set, word pair and (a phrase put
        in a template) template; per text row whether it is the user's text."""
        items = self.items
        bias = raw["target"] == "bias"
        index = raw["index"].to_numpy()
        pick = lambda values, rows: np.asarray(values, dtype=object)[index[rows]]
        raw["item_id"] = None
        raw.loc[bias, "item_id"] = pick([i.item_id for i in items], bias)
        raw.loc[bias, "unit"] = pick([i.unit for i in items], bias)
        raw.loc[bias, "template_id"] = pick([i.template_id for i in items], bias)
        raw["covariate"] = np.where(bias, self.covariate[np.where(bias, index, 0)], np.nan)
        raw["quarter"] = np.where(bias, self.fold[np.where(bias, index, 0)], -1)  # whose edit it had
        control = (raw["target"] == "control").to_numpy()
        raw["sign"] = np.where(control, self.control_sign[np.where(control, index, 0)], np.nan)
        raw["half"] = np.where(control, self.control_half[np.where(control, index, 0)], -1)
        raw["words_half"] = np.where(control, self.words_half()[np.where(control, index, 0)], -1)
        raw["set"] = np.where(control, self.control_set[np.where(control, index, 0)], "")
        raw["pair"] = np.where(control, self.control_pair[np.where(control, index, 0)], "")
        in_template = control & (self.control_template[np.where(control, index, 0)] != "")
        raw.loc[in_template, "template_id"] = pick(self.control_template, in_template)
        text = (raw["target"] == "text").to_numpy()
        raw["user_text"] = np.where(text, self.text_is_user[np.where(text, index, 0)], False)
        return raw


@dataclass(frozen=True)
class Texts:
    """The texts an edit's cost is measured on: `count` neutral texts generated from `seed`, then the
    pieces of a user's `text` (--text), if any."""

    seed: int = 0
    count: int = 64
    text: str | None = None


def record_inputs(
    model, items: list[PatchItem], reference_word: str, control, labels: tuple, texts: Texts
) -> Inputs:
    """Record the clean runs the edits read: the items, their reference counterfactuals, the
    suite's control prompts (`control`: suite.control.Control; `labels`: the positive and negative
    label) and the `texts`."""
    fold_of = folds(items)
    fold = np.array([fold_of[i.item_id] for i in items])
    with_reference = [(i, cf) for i in items for cf in i.counterfactuals if cf.word == reference_word]
    if not with_reference:
        raise RunError(
            f"no item has the reference word {reference_word!r}; choose --reference among the suite's "
            "counterfactual words"
        )
    generated, pieces = generated_texts(model, texts.seed, texts.count), user_text(model, texts.text)
    text_bank = record(model, generated + pieces)
    labelled = [(i.positive, i.negative) for i in items]
    return Inputs(
        items=items,
        fold=fold,
        n_templates=len({i.template_id for i in items}),
        covariate=np.array([i.covariate for i in items], dtype=float),
        bank=record(model, [i.x for i in items]),
        reference=record(model, [cf.x_cf for _, cf in with_reference]),
        reference_fold=np.array([fold_of[i.item_id] for i, _ in with_reference]),
        texts=text_bank,
        text_is_user=np.arange(len(generated) + len(pieces)) >= len(generated),
        clean_logp=clean_logp(model, text_bank),
        labels=_pairs(labelled),
        slot_at=np.array([i.counterfactuals[0].at for i in items]),  # the slot's last token (designs)
        **_control_inputs(model, items, control, labels, labelled),
    )


def _control_inputs(model, items, control, labels: tuple, labelled: list[tuple]) -> dict:
    """The control's fields of Inputs: the file's prompts, then its phrases in the items' templates
    (template_prompts), which take their item's label words and their phrase's first row's label,
    pair, half and set (SUFFIX appended)."""
    tokenizer = model.tokenizer
    n = len(control.prompts)
    words = [
        tuple(tokenizer(control.word(label), add_special_tokens=False)["input_ids"][:1]) for label in labels
    ]
    sign = np.where(np.array(control.labels) == labels[0], 1.0, -1.0)
    half = control_halves(sign, control.pairs, control.fitted())
    sets = np.array(control.sets or [""] * n, dtype=object)
    pairs = np.array(control.pairs or [""] * n, dtype=object)
    made = template_prompts(tokenizer, items, control)
    row = made.row
    return dict(
        control=record(model, [torch.tensor(tokenizer(p)["input_ids"]) for p in control.prompts] + made.ids),
        control_sign=np.r_[sign, sign[row]],
        control_half=np.r_[half, half[row]],
        control_set=np.r_[sets, np.array([f"{s or 'phrases'}{SUFFIX}" for s in sets[row]], dtype=object)],
        control_pair=np.r_[pairs, pairs[row]],
        control_template=np.r_[np.full(n, "", dtype=object), [items[i].template_id for i in made.item]],
        control_fit=np.arange(n + len(row)) < n,
        control_labels=_pairs([tuple(words)] * n + [labelled[i] for i in made.item]),
        control_at=np.array(
            [phrase_end(tokenizer, p, w) for p, w in zip(control.prompts, control.phrases or [""] * n)]
            + made.at,
            dtype=int,
        ),
    )


def _pairs(pairs: list[tuple]) -> torch.Tensor:
    """[(positive ids, negative ids)] -> (n, 2, K), -1 padded."""
    ids = label_ids([list(side) for pair in pairs for side in pair])
    return ids.view(len(pairs), 2, -1)


@torch.inference_mode()
def clean_logp(model, bank: Bank) -> list[torch.Tensor]:
    """Per text (T_n - 1, vocab): the original model's next-token log-probabilities."""
    out = []
    for n, length in enumerate(bank.lengths.tolist()):
        logits = model.model(input_ids=bank.ids[n : n + 1, :length], use_cache=False).logits[0, :-1]
        out.append(torch.log_softmax(logits.float(), -1))
    return out


@torch.inference_mode()
def generated_texts(model, seed: int, n: int = 64) -> list[torch.Tensor]:
    """The original model's continuations of the first `n` neutral openings: seeded sampling (top 40
    tokens, temperature 1), GENERATED_TOKENS new tokens each; the opening's tokens included. Sampled
    in batches of TEXT_BATCH openings (left padding, masked), so the first 8 texts are the same
    whatever `n`."""
    openings = [line for line in OPENINGS.read_text().splitlines() if line.strip()][:n]
    out = []
    pad = model.tokenizer.pad_token_id
    with torch.random.fork_rng():  # the user's random state is left as it was
        torch.manual_seed(seed)
        for start in range(0, len(openings), TEXT_BATCH):
            ids = [model.tokenizer(o)["input_ids"] for o in openings[start : start + TEXT_BATCH]]
            width = max(map(len, ids))
            padded = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
            mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
            generated = model.model.generate(
                input_ids=padded,
                attention_mask=mask,
                do_sample=True,
                top_k=40,
                temperature=1.0,
                max_new_tokens=GENERATED_TOKENS,
                min_new_tokens=GENERATED_TOKENS,
                pad_token_id=pad,
            )
            out.extend(row[width - len(i) :] for row, i in zip(generated, ids))
    return out


def text_head(path: str) -> bytes:
    """The first TEXT_BYTES of --text: all that TEXT_TOKENS tokens can come from (a token holds far
    fewer than TEXT_BYTES / TEXT_TOKENS bytes), so a large file is never read or tokenised whole."""
    with open(path, "rb") as handle:
        return handle.read(TEXT_BYTES)


def check_text(path: str | None) -> None:
    """--text must name a file with text in it."""
    if path is None:
        return
    file = Path(path)
    if not file.is_file():
        raise AttnprobeError(f"--text {path}: no such file")
    if not text_head(path).decode("utf-8", errors="replace").strip():
        raise AttnprobeError(f"--text {path}: the file has no text to score; give a file of running text")


def user_text(model, path: str | None) -> list[torch.Tensor]:
    """Up to TEXT_TOKENS tokens of the file, in pieces of TEXT_PIECE tokens."""
    if path is None:
        return []
    check_text(path)
    text = text_head(path).decode("utf-8", errors="ignore")  # a character cut at the end is dropped
    ids = model.tokenizer(text)["input_ids"][:TEXT_TOKENS]
    if len(ids) < 2:
        raise AttnprobeError(f"--text {path}: the file has no text to score (it needs at least two tokens)")
    pieces = [ids[i : i + TEXT_PIECE] for i in range(0, len(ids), TEXT_PIECE)]
    return [torch.tensor(piece) for piece in pieces if len(piece) > 1]


SUFFIX = "_templates"  # a control set's phrases in the templates: set "nouns" -> "nouns_templates"


@dataclass(frozen=True)
class TemplatePrompts:
    ids: list[torch.Tensor]  # per prompt, its tokens (cut like its item)
    item: np.ndarray  # per prompt, the item whose template, cut and label words it takes
    row: np.ndarray  # per prompt, the first control row with its phrase (its label, pair, set, half)
    at: list[int]  # per prompt, its phrase's last token (phrase_end)


def template_prompts(tokenizer, items, control) -> TemplatePrompts:
    """Every distinct phrase of `control` in one item of each template `items` use (in the order of
    the items); a template whose item has no "the <slot>" or bare slot word to replace is skipped,
    and so is a prompt word for word one of the control's own (a template cut where the control's
    frame ends: "The king said that"), so no template prompt is one a keep constraint was fitted on."""
    own = {prompt.strip() for prompt in control.prompts}
    first: dict[str, int] = {}
    for row, phrase in enumerate(control.phrases):
        first.setdefault(phrase, row)
    per_template: dict[str, int] = {}
    for i, item in enumerate(items):
        per_template.setdefault(item.template_id, i)
    ids, item_of, row_of, at = [], [], [], []
    for i in per_template.values():
        text = tokenizer.decode(items[i].x, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for phrase, row in first.items():
            made = put_phrase(text, items[i].original, phrase)
            if made is not None and made.strip() not in own:
                ids.append(torch.tensor(tokenizer(made)["input_ids"]))
                item_of.append(i)
                row_of.append(row)
                at.append(phrase_end(tokenizer, made, phrase))
    return TemplatePrompts(ids, np.array(item_of, dtype=int), np.array(row_of, dtype=int), at)


def put_phrase(text: str, original: str, phrase: str) -> str | None:
    """`text` with its first "the <original>" (or bare <original>) replaced by `phrase`, capitalised
    where the replaced words were; a phrase's own "the " is dropped where the text had no article.
    None where `original` is not in `text`."""
    found = re.search(rf"(?:\b(the|The) )?\b{re.escape(original)}\b", text)
    if not found:
        return None
    words = phrase if found.group(1) else re.sub(r"^(the|The) ", "", phrase)
    if found.group(0)[:1].isupper():
        words = words[:1].upper() + words[1:]
    return text[: found.start()] + words + text[found.end() :]


def phrase_end(tokenizer, text: str, phrase: str) -> int:
    """The position, in `text` tokenised, of the last token of the first whole-word occurrence of
    `phrase`'s last word ("king" of "the king", which put_phrase may have put in without its article;
    any case); -1 where the phrase is empty or its word absent."""
    word = phrase.split()[-1] if phrase.strip() else None
    found = re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) if word else None
    if found is None:
        return -1
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    return max(t for t, (start, end) in enumerate(offsets) if end > start and start < found.end())
