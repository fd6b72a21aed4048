"""Contracts any measure or edit kind can be checked against, attnprobe's own and other packages'
(as scikit-learn's check_estimator): each runs the kind on a tiny model through every method the
command line calls and raises AssertionError naming the part that fails.

  check_measure(kind, suite, model, directory)  parse, plan, run, tables, prompt ids, statistics,
                                                report section, compare's pairing, resume, merge
  check_measures(kinds, suite, model, directory)  the same for several kinds of one suite, its
                                                runs shared
  check_edit_kind(kind, model, inputs)          fit, output shape, identity on no heads, save and
                                                load, packed passes equal to separate ones
  check_site_mode(name, model, inputs)          a per-layer edit's mode: fit at every layer, shape,
                                                finite, save and load
  edit_inputs(model, suite)                     the recorded inputs an edit kind is fitted on
  stand_in_device()                             a CPU standing in for a GPU: refuses what CUDA
                                                refuses (a table read from a tensor left there)
"""

from .edit_kinds import check_edit_kind, check_site_mode, edit_inputs
from .measures import check_measure, check_measures
from .stand_in import stand_in_device

__all__ = [
    "check_edit_kind",
    "check_measure",
    "check_measures",
    "check_site_mode",
    "edit_inputs",
    "stand_in_device",
]
