"""A loaded model's thin methods (`pm.capture`, `pm.edited`, `pm.probe`, ...): each is the free
function with the model as its first argument, and `dir(pm)` lists them."""

import torch

import attnprobe
from attnprobe.edits import Zero


def test_the_methods_are_the_free_functions(tiny_llama_dir):
    pm = attnprobe.load_model(str(tiny_llama_dir))
    public = {name for name in dir(pm) if not name.startswith("_")}
    assert {"capture", "edited", "probe", "str_tokens", "span_tokens", "verify"} <= public
    texts = ["The nurse said that she", "Hi"]
    batch = attnprobe.encode(pm.tokenizer, texts)
    expected = attnprobe.run_with_capture(pm, batch["input_ids"], batch["attention_mask"])
    got = pm.capture(texts)
    assert all(torch.equal(got.weights[layer], expected.weights[layer]) for layer in expected.weights)
    assert pm.str_tokens("The nurse said") == attnprobe.str_tokens(pm, "The nurse said")
    assert pm.span_tokens("The nurse said", "nurse") == (1, 2)
    with pm.edited(Zero(heads=((0, 1),))):  # the edit reaches the next layer's attention
        edited = pm.capture(texts[:1]).weights[1]
    assert not torch.allclose(edited, pm.capture(texts[:1]).weights[1])
    assert not hasattr(pm, "no_such_method")
