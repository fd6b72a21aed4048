"""The files a suite reads besides itself: sentence files (sentences: entries, bracketed spans,
marks), their rows in each layout (rows: text, delimited, JSON lines, numbered), sentences computed
from a row's columns (columns), multiple-choice rows (choices) and the published formats by name
(formats: CrowS-Pairs, StereoSet, BBQ, WinoBias, ...).
"""
