"""The edit-kind contracts (attnprobe.testing.check_edit_kind, check_site_mode): every registered head
kind and site mode passes its contract on a tiny model, and one with a planted fault fails it,
naming the part."""

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from conftest import edit_suite

from attnprobe.edits.kinds import KINDS, HeadEdit, Mean
from attnprobe.edits.layers.modes import SITE_MODES, Project, SiteMode, Zero
from attnprobe.errors import RegistryError
from attnprobe.model import load_model
from attnprobe.registry import Registry
from attnprobe.suite import load_suite
from attnprobe.testing import check_edit_kind, check_site_mode, edit_inputs


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


@pytest.mark.parametrize("name", sorted(SITE_MODES))
def test_every_registered_site_mode_passes_the_contract(name, tiny):
    check_site_mode(name, *tiny)


class _Wide(Project):
    mode: ClassVar[str] = "wide"

    @classmethod
    def fit(cls, z, x, control, sign):
        u, f, mu = super().fit(z, x, control, sign)
        return torch.cat([u, u]), f, mu  # twice the site's width: would broadcast nowhere


class _Replacing(Zero):
    mode: ClassVar[str] = "replacing"

    @classmethod
    def fit(cls, z, x, control, sign):
        return z[0], z[0], z[0] * float("nan")


@pytest.mark.parametrize(
    "planted, message",
    [
        (_Wide, r"wide: fit raised AttnprobeError: site mode 'wide': fit must return .* width 16"),
        (_Replacing, r"replacing: fit raised AttnprobeError: .*three finite vectors"),
    ],
)
def test_a_planted_site_mode_fault_fails_the_contract(planted, message, tiny, monkeypatch):
    monkeypatch.setitem(SITE_MODES, planted.mode, planted)
    with pytest.raises(AssertionError, match=message):
        check_site_mode(planted.mode, *tiny)


def test_a_site_mode_is_refused_when_named_like_another_or_the_several_layers_prefix():
    fresh = Registry("test.site_modes", SiteMode, "mode", clash=SITE_MODES.clash)
    fresh.register(Zero)
    with pytest.raises(RegistryError, match="named 'zero' like attnprobe.edits.layers.modes.Zero"):
        fresh.register(type("Again", (Zero,), {}))
    with pytest.raises(RegistryError, match="'layers', the prefix of the edits of several layers"):
        fresh.register(type("Layers", (Zero,), {"mode": "layers"}))
    assert list(fresh) == ["zero"]
