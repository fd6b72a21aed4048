"""What a notebook holds: a finished run as tables (api.Run), ad-hoc probes of sentences (adhoc),
attention views (views) and the linear readout of a covariate from the residual stream (readout)."""
