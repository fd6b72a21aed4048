"""Edits of a vector site, one per layer: the stream entering a decoder layer (stream), what a layer's
MLP adds to it (mlp), and the modes either is fitted by (modes: the built-ins and plug-ins)."""
