"""Circuits found, not guessed (`attnprobe edit --circuits`, search.py): every part's attribution
(EAP and EAP-IG), circuits of growing size chosen by it on one quarter of the items and judged
by exact patching on the opposite quarter (runs.py), the greedy worst subset of those that meet
the target (search.py), and their tables (tables.py). The parts, their attribution and the
ranking are graph.py's; at the grain of edges (`--circuit-grain edges`) the edges
and their pruning are edges.py's, each receiver's own copy of the stream wiring.py's, and the
edges' attribution and exact runs edge_passes.py's."""

from .runs import CIRCUITS_VERSION
from .search import hypotheses, measure_run_circuits
from .tables import write_circuits

__all__ = ["CIRCUITS_VERSION", "hypotheses", "measure_run_circuits", "write_circuits"]
