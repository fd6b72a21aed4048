"""Forward passes: capturing attention (capture), packing prompts that share prefixes (packing,
sharing), scoring continuations (scoring), long documents in chunks (longdoc), and the time a pass
takes on the reference machine (estimates)."""
