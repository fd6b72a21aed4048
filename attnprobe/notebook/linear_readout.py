"""`ap.linear_readout`: where a covariate becomes linearly readable (the method: analyses.readout)."""

from __future__ import annotations

import pandas as pd

from ..analyses.readout import readout_table


def linear_readout(
    model, suite, span: str | None = None, folds: int = 10, permutations: int = 999, seed: int = 0
) -> pd.DataFrame:
    """Per layer (0: the embeddings): how well the suite's covariate is read linearly from the
    residual stream at the unit's span, held out over units (attnprobe.analyses.readout). `model`: a
    ProbeModel or spec; `suite`: a Suite or its path; `span`: default the covariate's unit."""
    from ..errors import AnalysisError
    from ..suite import Suite, load_suite
    from .adhoc import model_of

    suite = suite if isinstance(suite, Suite) else load_suite(suite)
    analysis = suite.analysis
    if not analysis.covariate or not analysis.unit:
        raise AnalysisError(
            f"{suite.path}: the linear readout needs a covariate owned by a unit (analysis: covariate)"
        )
    return readout_table(model_of(model), suite, span or analysis.unit, folds, permutations, seed)
