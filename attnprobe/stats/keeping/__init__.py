"""What an edit keeps of the factual contrast while it removes the stereotype.

definitional  the control prompts before and after an edit, per set: accuracy, gap kept, offset;
              the joint terms of each set put in the items' templates; specificity
goal          the debiasing goal per edit: the conditions met and those that fail (edits_goal.csv)
joint         the joint regression (stereotype and factual terms in one fit, one covariance)
layers        the layer a per-layer edit is judged at, chosen without the rows it is judged on
edit_search   the held-out search: the edit chosen among every one measured, judged on other rows
"""
