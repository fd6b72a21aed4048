"""HeadSet: the one vocabulary for a set of attention heads.

A head is (layer, head); a set keeps its heads in the order given, once each. Every other form the
package needs comes from here: the text users write and read ("L26H2 L25H2"; parsing also takes
commas and lower case), flat indices l x H + h (how selection ranks heads) and an (L, H) boolean mask
(how edits and patching select them). No other module formats or parses a head.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import AttnprobeError

if TYPE_CHECKING:
    import torch

_HEAD = re.compile(r"[Ll](\d+)[Hh](\d+)")


def _check_in_model(layer: int, head: int, n_layers: int, n_heads: int) -> None:
    """A head of a model with these sizes, or one error naming them (negative indices included: they
    would count from the end)."""
    if not (0 <= layer < n_layers and 0 <= head < n_heads):
        raise AttnprobeError(
            f"head {HeadSet.name(layer, head)} is not in this model ({n_layers} layers L0-L{n_layers - 1}, "
            f"{n_heads} heads H0-H{n_heads - 1} per layer)"
        )


@dataclass(frozen=True)
class HeadSet:
    pairs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "pairs", tuple(dict.fromkeys((int(l), int(h)) for l, h in self.pairs)))

    @classmethod
    def parse(cls, text: str, n_layers: int | None = None, n_heads: int | None = None) -> HeadSet:
        """'L26H2,L25H2' (commas or spaces, any case) -> HeadSet; a head outside the model (when its
        sizes are given), a word of another form or no head at all is one error."""
        out = []
        for part in filter(None, re.split(r"[,\s]+", text.strip())):
            match = _HEAD.fullmatch(part)
            if not match:
                raise AttnprobeError(f"head {part!r} is not of the form L<layer>H<head>, e.g. L26H2")
            layer, head = map(int, match.groups())
            if n_layers is not None:
                _check_in_model(layer, head, n_layers, n_heads)
            out.append((layer, head))
        if not out:
            raise AttnprobeError("no heads given: list them as L<layer>H<head>, e.g. --heads L26H2,L25H2")
        return cls(tuple(out))

    @classmethod
    def from_flat(cls, flat: Iterable[int], n_heads: int) -> HeadSet:
        """Flat indices l x H + h -> HeadSet."""
        return cls(tuple((int(i) // n_heads, int(i) % n_heads) for i in flat))

    def flat(self, n_heads: int) -> list[int]:
        return [layer * n_heads + head for layer, head in self.pairs]

    def mask(self, n_layers: int, n_heads: int) -> torch.Tensor:
        """(L, H) bool, True at the set's heads."""
        import torch  # heads are named and parsed without it

        out = torch.zeros(n_layers, n_heads, dtype=torch.bool)
        for layer, head in self.pairs:
            _check_in_model(layer, head, n_layers, n_heads)  # never L-1 as the last layer
            out[layer, head] = True
        return out

    @staticmethod
    def name(layer: int, head: int) -> str:
        """One head as users read it: L26H2."""
        return f"L{int(layer)}H{int(head)}"

    def __str__(self) -> str:
        return " ".join(self.name(layer, head) for layer, head in self.pairs)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)
