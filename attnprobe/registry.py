"""Kinds by name, neutral (no measure, edit or model code): the built-in kinds, registered in order
with `register` (a second kind of one name is refused), then those installed packages register under
an entry-point group, loaded when the registry is first read (never while attnprobe is being
imported, so a plug-in may import any of attnprobe).

A plug-in is checked when it registers: its name (lower-case letters, digits and `_`: it names
files and table columns) and its type; a name or a file that clashes with a built-in or another
plug-in is refused in one line naming both (RegistryError). One that cannot be imported, or
exits while importing, is skipped with a line on stderr: a broken package does not stop attnprobe.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from .errors import RegistryError

NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class Registry(dict):
    """Kinds by name. `base`: the class each kind is (or subclasses); `key`: the attribute that names
    it; `make`: what is stored for a loaded plug-in; `clash(kind, others)`: a reason the kind cannot
    live beside the registered `others` (their files, say), or None."""

    def __init__(self, group: str, base: type, key: str, make: Callable = lambda found: found, clash=None):
        super().__init__()
        self.group, self.base, self.key, self.make = group, base, key, make
        self.clash = clash or (lambda kind, others: None)
        self._complete = False

    def register(self, kind, origin: str | None = None):
        """Add `kind` (a built-in, in registry order; usable as a decorator); a clash is refused."""
        name = getattr(kind, self.key, None)
        where = origin or _origin(kind)
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise RegistryError(
                f"{self.group}: {where} is named {name!r}; a kind's {self.key} is lower-case letters, digits "
                "and _ (it names files): rename it"
            )
        if super().__contains__(name):
            raise RegistryError(
                f"{self.group}: {where} is named {name!r} like {_origin(super().__getitem__(name))}; "
                f"rename one of them (its {self.key})"
            )
        reason = self.clash(kind, list(super().values()))
        if reason:
            raise RegistryError(f"{self.group}: {where} {reason}; rename it")
        super().__setitem__(name, kind)
        return kind

    def _completed(self) -> None:
        if not self._complete:
            self._complete = True  # first: a plug-in reading the registry while it loads sees the rest
            for point, loaded in _loaded(self.group):
                cls = loaded if isinstance(loaded, type) else type(loaded)
                where = f"the plug-in {point.name} ({point.value})"
                try:
                    if not issubclass(cls, self.base):
                        raise TypeError(f"not a {self.base.__name__}")
                    made = self.make(loaded)
                except Exception as exc:  # not a kind, or one that cannot be made: named, and skipped
                    _skip(self.group, point, f"{type(exc).__name__}: {exc}")
                    continue
                self.register(made, where)

    def __getitem__(self, name):
        self._completed()
        return super().__getitem__(name)

    def __iter__(self):
        self._completed()
        return super().__iter__()

    def __contains__(self, name):
        self._completed()
        return super().__contains__(name)

    def __len__(self):
        self._completed()
        return super().__len__()

    def get(self, name, default=None):
        self._completed()
        return super().get(name, default)

    def keys(self):
        self._completed()
        return super().keys()

    def values(self):
        self._completed()
        return super().values()

    def items(self):
        self._completed()
        return super().items()


def _origin(kind) -> str:
    cls = kind if isinstance(kind, type) else type(kind)
    return f"{cls.__module__}.{cls.__qualname__}"


def _loaded(group: str) -> list:
    """(entry point, what it loads) for each plug-in of `group` that imports; one that raises, or
    exits (`exit()`, SystemExit) while importing, is skipped with a line on stderr."""
    from importlib.metadata import entry_points

    found = []
    for point in entry_points(group=group):
        try:
            found.append((point, point.load()))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a plug-in's own bug, even exit() on import: named, and skipped
            _skip(group, point, f"{type(exc).__name__}: {exc}")
    return found


def _skip(group: str, point, why: str) -> None:
    print(f"attnprobe: the {group} plug-in {point.name} ({point.value}) is skipped: {why}", file=sys.stderr)
