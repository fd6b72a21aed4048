"""A few sentences without a YAML file: `probe` (attention from a bracketed span to every token) and
the token helpers `str_tokens` and `span_tokens`.

    ap.probe("smollm2-135m", ["The [nurse] said that [she]", "The [pilot] said that [he]"])

returns one row per sentence, layer, head and token: the attention from the source span (the last
bracketed span unless `source` names one; mean over its tokens, as a suite's attention measure)
to that token, with the span the token belongs to. Summing `weight` over a span's tokens gives the
suite's default target aggregation.
"""

from __future__ import annotations

import pandas as pd
import torch

from ..attention.capture import run_with_capture
from ..errors import AnalysisError, SuiteError
from ..forward.longdoc import CHUNK_TOKENS, read_rows
from ..forward.packing import pad_right
from ..model import ProbeModel, load_model
from ..schema.spans import token_spans
from ..suite.files.sentences import parse_marked


def model_of(model) -> ProbeModel:
    """A loaded model: a ProbeModel as given, a spec loaded."""
    return model if isinstance(model, ProbeModel) else load_model(model)


def _tokenizer(model_or_tokenizer):
    if isinstance(model_or_tokenizer, ProbeModel):
        return model_or_tokenizer.tokenizer
    if isinstance(model_or_tokenizer, str):
        from ..model import load_tokenizer

        return load_tokenizer(model_or_tokenizer)[0]
    return model_or_tokenizer


def str_tokens(model_or_tokenizer, text: str) -> list[str]:
    """The tokens of `text` as the model sees them (special tokens included), each decoded alone."""
    tokenizer = _tokenizer(model_or_tokenizer)
    return [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]


def span_tokens(model_or_tokenizer, text: str, span: str | tuple[int, int]) -> tuple[int, int]:
    """Token range [start, end) of `span`: the first occurrence of those words in `text`, or a
    (char_start, char_end) range; indices into `str_tokens(text)`."""
    if isinstance(span, str):
        start = text.find(span)
        if start < 0:
            raise SuiteError(f"{span!r} does not occur in {text!r}")
        span = (start, start + len(span))
    offsets = [
        tuple(o) for o in _tokenizer(model_or_tokenizer)(text, return_offsets_mapping=True)["offset_mapping"]
    ]
    found = token_spans(offsets, {"span": span})["span"]
    if found == (-1, -1):
        raise SuiteError(f"characters {span} of {text!r} hold no token")
    return found


def checked_sentences(sentences, batch_size: int) -> list[str]:
    """The notebook's sentences as a list of text (one string is one sentence), or one line saying
    what is wrong: no sentences, a value that is not text, a batch size below 1."""
    if not isinstance(sentences, (str, list, tuple)):
        raise SuiteError(
            f"sentences is {type(sentences).__name__}; pass text or a list of texts such as "
            "['The nurse said that [it] was late']"
        )
    sentences = [sentences] if isinstance(sentences, str) else list(sentences)
    if not sentences:
        raise SuiteError("no sentences given; pass a list such as ['The nurse said that [it] was late']")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise SuiteError(f"sentence {i + 1} is {type(sentence).__name__}, not text")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SuiteError(f"batch_size must be a whole number of at least 1, got {batch_size!r}")
    return sentences


@torch.no_grad()
def marked_attention(model, sentences: list[str], batch_size: int = 8):
    """Per sentence with [bracketed] spans (named inline or span1, span2, ... by order): its text,
    the spans' token ranges, its tokens and every layer's full attention (L, H, T, T). All
    sentences are parsed before the model runs, so a bad one fails at once."""
    sentences = checked_sentences(sentences, batch_size)
    pm = model_of(model)
    parsed = [parse_marked(marked, f"sentence {i + 1}")[:2] for i, marked in enumerate(sentences)]
    for start in range(0, len(parsed), batch_size):
        batch = parsed[start : start + batch_size]
        encodings = pm.tokenizer([text for text, _ in batch], return_offsets_mapping=True)
        for b, ids in enumerate(encodings["input_ids"]):
            if pm.info.max_positions and len(ids) > pm.info.max_positions:
                raise SuiteError(
                    f"sentence {start + b + 1} has {len(ids):,} tokens, more than the model's context of "
                    f"{pm.info.max_positions:,}; shorten it"
                )
        ids, mask = pad_right(encodings["input_ids"], pm.tokenizer.pad_token_id)
        captured = run_with_capture(pm, ids, mask)
        W = torch.stack([captured.weights[layer] for layer in sorted(captured.weights)])  # (L, B, H, T, T)
        for b, (text, spans) in enumerate(batch):
            offsets = [tuple(o) for o in encodings["offset_mapping"][b]]
            T = len(offsets)
            yield {
                "text": text,
                "spans": token_spans(offsets, spans),
                "weights": W[:, b, :, :T, :T],
                "tokens": [pm.tokenizer.decode([i]) for i in encodings["input_ids"][b]],
            }


def probe(
    model,
    sentences: list[str],
    source: str | None = None,
    batch_size: int = 8,
    long_tokens: int = CHUNK_TOKENS,
) -> pd.DataFrame:
    """Attention from one bracketed span of each sentence to every token (see the module doc).
    Brackets are named inline (`[pronoun: she]`) or by order (`span1`, `span2`, ...). A text of more
    than `long_tokens` tokens (a document, up to the model's context) is read alone in chunks,
    recording only the source's rows (attnprobe.forward.longdoc)."""
    sentences = checked_sentences(sentences, batch_size)
    for i, marked in enumerate(sentences):  # every source checked before the model runs
        spans = parse_marked(marked, f"sentence {i + 1}")[1]
        if not spans:
            raise SuiteError(
                f"sentence {i + 1}: mark the source span with [brackets], e.g. 'The nurse said that [it] was "
                "late'"
            )
        if (source or list(spans)[-1]) not in spans:
            raise SuiteError(f"sentence {i + 1}: no span '{source}' (spans: {', '.join(spans)})")
    pm = model_of(model)
    lengths = [len(pm.tokenizer(parse_marked(m, "")[0])["input_ids"]) for m in sentences]
    short = [i for i, n in enumerate(lengths) if n <= long_tokens]
    found = {}
    for i, sentence in zip(short, marked_attention(pm, [sentences[i] for i in short], batch_size)):
        name = source or list(sentence["spans"])[-1]
        t0, t1 = sentence["spans"][name]
        found[i] = (
            sentence,
            name,
            sentence.pop("weights")[:, :, t0:t1].mean(2),
        )  # (L, H, T) mean over the source
    for i in sorted(set(range(len(sentences))) - set(short)):
        found[i] = _long_sentence(pm, sentences[i], source, f"sentence {i + 1}")
    return pd.concat([_frame(n, *found[n]) for n in range(len(sentences))], ignore_index=True)


def _long_sentence(pm: ProbeModel, marked: str, source: str | None, where: str):
    """What marked_attention gives for one long text, with only the source's rows read (chunked)."""
    text, spans = parse_marked(marked, where)[:2]
    encoding = pm.tokenizer(text, return_offsets_mapping=True)
    tokens = token_spans([tuple(o) for o in encoding["offset_mapping"]], spans)
    name = source or list(spans)[-1]
    t0, t1 = tokens[name]
    if t0 < 0:
        raise SuiteError(f"{where}: the span '{name}' holds no token")
    rows = read_rows(pm, torch.tensor(encoding["input_ids"]), range(t0, t1))
    weights = torch.stack([rows[layer].mean(1) for layer in sorted(rows)])  # (L, H, T)
    sentence = {
        "text": text,
        "spans": tokens,
        "tokens": [pm.tokenizer.decode([i]) for i in encoding["input_ids"]],
    }
    return sentence, name, weights


def _frame(n: int, sentence: dict, name: str, weights: torch.Tensor) -> pd.DataFrame:
    """One row per layer, head and token: the weight from the source span `name` (weights (L, H, T))."""
    tokens = sentence["spans"]
    L, H, T = weights.shape
    owner = [next((s for s, (t0, t1) in tokens.items() if t0 <= t < t1), "") for t in range(T)]
    return pd.DataFrame(
        {
            "sentence": n,
            "text": sentence["text"],
            "layer": torch.arange(L).repeat_interleave(H * T).cpu().numpy(),
            "head": torch.arange(H).repeat_interleave(T).repeat(L).cpu().numpy(),
            "source": name,
            "position": torch.arange(T).repeat(L * H).cpu().numpy(),
            "token": sentence["tokens"] * (L * H),
            "span": owner * (L * H),
            "weight": weights.reshape(-1).float().cpu().numpy(),
        }
    )


def recompute_attention(model, text: str, n_tokens: int, layer: int, head: int) -> pd.DataFrame:
    """The (T, T) attention weights of one head for `text` as a run tokenised it (`n_tokens` with
    the BOS token a suite's `first_token: bos` prepends): rows are queries, columns keys, each
    labelled "position:token"."""
    pm = model_of(model)
    ids = pm.tokenizer(text)["input_ids"]
    if len(ids) == n_tokens - 1:  # the run prepended the BOS (else end-of-text) token
        bos = pm.tokenizer.bos_token_id
        ids = [pm.tokenizer.eos_token_id if bos is None else bos, *ids]
    if len(ids) != n_tokens:
        raise AnalysisError(
            f"the model's tokenizer gives {len(ids)} tokens for this prompt, the run recorded {n_tokens}: "
            "pass the run's own model"
        )
    captured = run_with_capture(pm, torch.tensor([ids]), layers=[layer])
    weights = captured.weights[layer][0, head].float().cpu().numpy()  # (T, T): queries x keys
    labels = [f"{i}:{pm.tokenizer.decode([t])}" for i, t in enumerate(ids)]
    return pd.DataFrame(weights, index=pd.Index(labels, name="query"), columns=pd.Index(labels, name="key"))
