"""What `attnprobe edit` measures beside the sweep, each with its own tables:

paths         path patching of the top heads: value against pattern, and their senders
paths_tables  the path tables' shares, tests and edges
senders       which heads and MLPs write into a receiver's value (the screen and exact pairs)
tracing       the residual stream patched per layer and position
readout       a cross-fitted linear readout of the covariate from each layer
transfer      each chosen edit applied to other suites (--also)
"""
