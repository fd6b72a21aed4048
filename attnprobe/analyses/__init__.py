"""Analyses of a finished run: where the covariate goes in the model, measured beside the edits
(`attnprobe edit --trace --paths`), each with its own tables. They reopen nothing themselves and
import no edit: the edit sweep (edits.sweep.command) runs them on its recorded inputs.

paths         path patching of the top heads: value against pattern, and their senders (their
              tables and parts: stats.analyses)
senders       which heads and MLPs write into a receiver's value (the screen and exact pairs)
tracing       the residual stream patched per layer and position
readout       a cross-fitted linear readout of the covariate from each layer (its ridge:
              stats.analyses.ridge)
circuits/     circuits found by attribution over heads and MLPs, judged by exact runs
"""
