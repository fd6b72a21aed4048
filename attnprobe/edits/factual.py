"""The control's gendered phrases in the suite's own sentences. Each distinct phrase of the control
("the king", "Mary": its `phrase` column) takes the place of "the <occupation>" in one item of every
head-effects template, and the prompt is cut where that item is cut. So the stereotype (the
occupations' covariate) and the factual gender (the phrases' labels) are read in the same
templates, at the same position, with the same label words (" she" / "She" / " her"), and
stats/joint.py fits both terms in one regression. These prompts are never fitted on: a keep
constraint is fitted on the control file's own prompts, so the templates are a family no keep fit
saw, and a noun is judged with the edit fitted on the other half of the word pairs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

SUFFIX = "_templates"  # a control set's phrases in the templates: set "nouns" -> "nouns_templates"


@dataclass(frozen=True)
class TemplatePrompts:
    ids: list[torch.Tensor]  # per prompt, its tokens (cut like its item)
    item: np.ndarray  # per prompt, the item whose template, cut and label words it takes
    row: np.ndarray  # per prompt, the first control row with its phrase (its label, pair, set, half)


def template_prompts(tokenizer, items, control) -> TemplatePrompts:
    """Every distinct phrase of `control` in one item of each template `items` use (in the order of
    the items); a template whose item has no "the <slot>" or bare slot word to replace is skipped."""
    first: dict[str, int] = {}
    for row, phrase in enumerate(control.phrases):
        first.setdefault(phrase, row)
    per_template: dict[str, int] = {}
    for i, item in enumerate(items):
        per_template.setdefault(item.template_id, i)
    ids, item_of, row_of = [], [], []
    for i in per_template.values():
        text = tokenizer.decode(items[i].x, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for phrase, row in first.items():
            made = put_phrase(text, items[i].original, phrase)
            if made is not None:
                ids.append(torch.tensor(tokenizer(made)["input_ids"]))
                item_of.append(i)
                row_of.append(row)
    return TemplatePrompts(ids, np.array(item_of, dtype=int), np.array(row_of, dtype=int))


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
