"""The statistics of the analyses (attnprobe.analyses): ridge (the one ridge readout rule, its
cross-fitted R2, bootstrap CI and permutation null)."""
