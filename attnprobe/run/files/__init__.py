"""A run's files: what a run directory holds and how each is named (layout), its typed manifest
(manifest), starting over without touching anyone else's files (fresh), joining shards (merge) and
reading a finished run, or reopening it for more work (reader: RunFiles).
"""
