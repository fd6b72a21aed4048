"""The statistics of the analyses (attnprobe.analyses), pandas and numpy only:

ridge         the one ridge readout rule: the readout per layer's cross-fitted R2, bootstrap CI and
              permutation null, and the readout after an edit
paths_tables  the path tables' shares (ratio of means and of slopes), tests and edges
paths_parts   each receiver's output effect split into parts that add up, each head's role, and
              the circuit test's table
"""
