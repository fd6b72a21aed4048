"""The package version, in a module that imports nothing (so any module may import it)."""

__version__ = "0.1.0"
