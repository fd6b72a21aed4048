"""Each registered measure's statistics, one module per kind, named after it: attention (the
interaction with the covariate and the plain difference), next_token (next-token log-ratios),
head_effects (head interventions), referents (referent accuracy and choice), likelihood (sentence
preference), multiple_choice, direct_attribution. A kind's `statistics` (attnprobe.measures) calls
its module; the tests and designs they share are one level up (stats.inference, stats.design).
"""
