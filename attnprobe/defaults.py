"""Defaults and names the command line shows in its help, kept free of heavy imports so that
`attnprobe --help` starts at once (the rooms that use them import them from here; a test checks
each list against the registry it names)."""

DEFAULT_MODEL = "smollm2-135m"
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")  # keys of model.DTYPES
DEFAULT_BATCH_SIZE = 256  # prompts per forward pass: a packed forward holds few tokens per prompt
DEFAULT_CHUNK_SIZE = 512  # prompts per chunk written to disk
# edits.kinds.KINDS
EDIT_KIND_NAMES = (
    "zero",
    "mean",
    "resample",
    "scale",
    "project",
    "orthogonal",
    "leace",
    "leace_mid",
    "leace_mid_last",
)
# the classic ablation, and the erasers that keep gender's difference (leace) and its midpoint too (leace_mid;
# orthogonal, a default until round 6, amplified the factual term on both bundled models: --kinds adds it)
DEFAULT_EDIT_KINDS = ("zero", "leace", "leace_mid")
DEFAULT_EDIT_K = (1, 5)
# random head sets per (kind, k); top heads zeroed alone; generated texts the cost is measured on
# (and placebo: refits of each covariate-fitted kind on a permuted covariate; 0: none)
DEFAULT_EDIT_COUNTS = {"draws": 20, "alone": 10, "texts": 64, "placebo": 0}
MIN_EDIT_COUNTS = {"draws": 0, "alone": 0, "texts": 2, "placebo": 0}  # KL's interval needs two texts
MAX_EDIT_COUNTS = {"draws": 10_000, "alone": 1_000, "texts": 64, "placebo": 10_000}  # 64 openings ship
ROW_TOKENS = 4096  # rows x padded length of one patched forward pass (head effects, edits; memory estimates)
