"""The edit-kind contract (attnprobe.testing.check_edit_kind): every registered kind passes it on a
tiny model, and a kind with a planted fault fails it, naming the part."""

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from conftest import edit_suite

from attnprobe.edits.kinds import KINDS, HeadEdit, Mean
from attnprobe.model import load_model
from attnprobe.suite import load_suite
from attnprobe.testing import check_edit_kind, edit_inputs


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama and the inputs `attnprobe edit` records for the edit suite on it."""
    model = load_model(str(tiny_llama_dir))
    suite = load_suite(edit_suite(tmp_path_factory.mktemp("suite")))
    return model, edit_inputs(model, suite)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_registered_kind_passes_the_contract(name, tiny):
    check_edit_kind(KINDS[name], *tiny)


@dataclass(frozen=True)
class _Narrow(HeadEdit):
    kind: ClassVar[str] = "narrow"

    def replacement(self, layer, z):
        return z[..., :1]  # one dimension of each head's output: the wrong shape


@dataclass(frozen=True)
class _Forgetful(Mean):
    """Saves its means under a name it cannot load back."""

    kind: ClassVar[str] = "forgetful"
    means: torch.Tensor = field(default=None, repr=False)

    def stored(self):
        tensors, scalars, where = super().stored()
        return {"averages": tensors["means"]}, scalars, where


@pytest.mark.parametrize(
    "planted, message",
    [
        (_Narrow, r"narrow: replacement gave torch.Size\(\[2, 2, 3, 1\]\) for head outputs \(2, 2, 3, 8\)"),
        (_Forgetful, r"forgetful: load raised AttnprobeError: .*averages"),
    ],
)
def test_a_planted_fault_fails_the_contract(planted, message, tiny, monkeypatch):
    monkeypatch.setitem(KINDS, planted.kind, planted)  # a saved file names its kind: load finds it
    with pytest.raises(AssertionError, match=message):
        check_edit_kind(planted, *tiny)
