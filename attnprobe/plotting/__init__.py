"""Figures of a run's statistics: `plots` draws them (seaborn, computing nothing new), `figures`
saves them under a run's figures/ for the report. Below the measures, so that each measure's report
section (attnprobe.measures.Measure.section) draws its own figures."""

from __future__ import annotations

from .figures import Figures, figure, file_name, largest_abs

__all__ = ["Figures", "figure", "file_name", "largest_abs"]
