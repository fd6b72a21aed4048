"""`attnprobe edit RUN_DIR`: the sweep of edit kinds over the heads a run found.

command  the command: the run reopened, the inputs recorded, each kind a resumable phase, the
         tables written
fitted   the chosen edits fitted and saved (all items, and each quarter's own)
options  EditOptions (what was asked, checked when made), listed heads, the settings hash
measure  the found and random head sets and each kind's raw values
single   the top heads each zeroed alone
permuted the covariate-fitted kinds refitted on permuted covariates (--placebo)
erased   the covariate read back from the edited heads on held-out items (R2 before and after)
"""
