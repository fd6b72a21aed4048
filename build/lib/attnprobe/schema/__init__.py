"""What every part of a suite shares: YAML read with its lines and the one-line error context
(yamllines), character and token spans (spans), and the declared analysis as plain data (analysis)."""
