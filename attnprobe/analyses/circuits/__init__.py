"""Circuits found, not guessed (`attnprobe edit --circuits`): every part's attribution (EAP and
EAP-IG, eap.py), circuits of growing size chosen by it on one quarter of the items and
judged by exact patching on the opposite quarter (runs.py), and their tables (tables.py). The
parts and the ranking are graph.py's; at the grain of edges (`--circuit-grain edges`) the edges
and their pruning are edges.py's, each receiver's own copy of the stream wiring.py's, and the
edges' attribution and exact runs edge_passes.py's."""

from .runs import CIRCUITS_VERSION, measure_run_circuits
from .tables import write_circuits

__all__ = ["CIRCUITS_VERSION", "measure_run_circuits", "write_circuits"]
