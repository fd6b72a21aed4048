"""A model's memory and time from its config alone (no weights): what `attnprobe check` prints and what
`run`, `verify`, `probe` and `edit` refuse on before any weights load.

Memory (bytes) = the weights (parameters x the dtype's size) + the largest working set of a phase:

- a forward pass without gradients holds about one layer's intermediates at a time, per token
  (residual, normed input, q, k, v, attention output, the MLP's gate, up and activated rows):
  (3 E + 3 I + (H + 2 Hkv) D) x bytes, E model width, I MLP width, H heads, Hkv key/value heads, D head
  size; plus the logits attnprobe reads (one row of V per sequence, float32);
- a phase that records a chunk's clean runs at every layer (hidden state, keys, values, head
  outputs, MLP output: (3 E + 2 Hkv D + H D) per token and layer; the head effects) holds them beside
  one patched pass of ROW_TOKENS rows x the padded length, and a backward pass over the chunk (the
  attribution): every layer's intermediates at once.

A patched pass on a GPU is sized from the memory free when the patching starts (patch_budget: the
largest power of two of rows x length whose working set takes at most half of it), so a GPU runs
few, large passes; on a CPU it stays ROW_TOKENS.

Time on a GPU = FLOPs / (the card's dense peak for the dtype x the share of it a phase reaches), with
FLOPs = 2 x (parameters besides the embeddings) per forwarded token, plus the prompt phase's host
time per prompt (reading the captured rows into tables). Both were measured by benchmarks/gpu.py
(EFFICIENCY, HOST_SECONDS_PER_PROMPT: card, date and shape beside them; benchmarks/results/gpu.md);
on a CPU the reference rates of forward/estimates.py apply instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..defaults import ROW_TOKENS
from ..errors import ModelSpecError

GB = 1e9
# Dense peak in TFLOP/s by (card, dtype) from the vendors' data sheets (SXM parts, no sparsity);
# float32 is the CUDA cores' rate (torch leaves TF32 off for matrix products by default).
PEAK_TFLOPS = {
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
}
ASSUMED_CARD = ("H100", 81559 * 2**20)  # what `check --device cuda` assumes without a GPU (nvidia-smi's MiB)
# Measured by benchmarks/gpu_pace.py on an NVIDIA H200, 2026-11-30: the full gender suite (6,840
# prompts, 1,920 head-effect pairs) at the Llama 3.1 8B shape in bfloat16 computed in 105.7 s, where
# the model before these figures (prompts at 40% of the dense peak plus 1.4 ms a prompt on the host,
# every other phase at 4.5%, from the H100's 600-prompt shape runs) said 123.3 s (+17%). Refitted to
# that run: the prompt phase 4.45 s (0.5 s of FLOPs at 40% plus 0.58 ms a prompt on the host), the
# head effects 60.6 s (8.1% of the peak), and the rest of the compute 40.6 s, charged to direct
# attribution (0.41%: one small pass per prompt and cut, plus assembling some 15 million attention
# rows). Smaller shapes reach less of the peak; other shapes and cards are extrapolated from these.
# The same fit in the CPU's rates of 2026-11-30 (forward/estimates.py, which the phases' work is counted
# in), the head effects' every-head patching now charged for the 8B shape's 32 layers of 32 heads and
# direct attribution at its own rate: 8.1% -> 14.0% and 0.41% -> 2.30%, the 8B's estimate unchanged.
EFFICIENCY = {"prompts": 0.40, "head effects": 0.1397, "direct_attribution": 0.02299}
OTHER_PHASES = EFFICIENCY["head effects"]  # an unmeasured phase of small passes: as the head effects
HOST_SECONDS_PER_PROMPT = 0.00058


@dataclass(frozen=True)
class Shape:
    """The sizes the estimates read, from a config's text part."""

    parameters: int
    embeddings: int
    E: int
    I: int  # noqa: E741 (the MLP width, as in the formulas above)
    L: int
    H: int
    Hkv: int
    D: int
    V: int

    @classmethod
    def of(cls, config) -> Shape | None:
        """None where the config cannot be counted (a family with its own code)."""
        from . import head_shape
        from .shapes import parameter_count

        counted = parameter_count(config)
        if counted is None:
            return None
        text = config.get_text_config()
        L, H, D = head_shape(config)
        return cls(
            *counted,
            text.hidden_size,
            getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
            L,
            H,
            getattr(text, "num_key_value_heads", None) or H,
            D,
            text.vocab_size,
        )

    def weights(self, dtype: str) -> float:
        return self.parameters * _bytes(dtype)

    def forward_working(self, dtype: str, tokens: int, sequences: int) -> float:
        per_token = 3 * self.E + 3 * self.I + (self.H + 2 * self.Hkv) * self.D
        return tokens * per_token * _bytes(dtype) + sequences * self.V * 4

    def recorded_working(self, dtype: str, tokens: int, sequences: int, longest: int) -> float:
        bank = tokens * self.L * (3 * self.E + (2 * self.Hkv + self.H) * self.D) * _bytes(dtype)
        backward = self.L * self.forward_working(dtype, tokens, 0)
        return bank + backward + self.forward_working(dtype, ROW_TOKENS, ROW_TOKENS // max(longest, 1))

    def flops_per_token(self) -> float:
        return 2.0 * (self.parameters - self.embeddings)


FREE_SHARE = 0.5  # of the memory free when patching starts, what one patched pass may take on a GPU
MAX_ROW_TOKENS = 1 << 20


def patch_budget(shape: Shape | None, dtype: str, free: float, longest: int, on_gpu: bool) -> int:
    """Rows x padded length of one patched pass (head effects, edits): ROW_TOKENS on a CPU (two cores
    gain nothing from larger passes, and the CPU times were measured at it); on a GPU the largest
    power of two whose pass fits in FREE_SHARE of `free` bytes at a token's working set there
    (forward_working per token, its row of attention scores over `longest` keys in float32, its share
    of a sequence's logit row), never below ROW_TOKENS nor above MAX_ROW_TOKENS."""
    if not on_gpu or shape is None:
        return ROW_TOKENS
    longest = max(longest, 1)
    per_token = shape.forward_working(dtype, 1, 1 / longest) + shape.H * longest * 4
    fit = int(FREE_SHARE * max(free, 0.0) / per_token)
    return max(ROW_TOKENS, min(MAX_ROW_TOKENS, 1 << max(fit.bit_length() - 1, 0)))


def prompt_batch(shape: Shape, dtype: str, room: float, longest: int, chunk_size: int) -> int:
    """Prompts per forward pass of the prompt phase on a GPU: a whole chunk (one pass per chunk: the
    phase is bound by the host's work per pass, not by FLOPs) where that pass's working set fits in
    FREE_SHARE of `room` (the card's bytes the weights leave), else the most that do (at least one)."""
    per_prompt = shape.forward_working(dtype, max(longest, 1), 1)
    return max(1, min(chunk_size, int(FREE_SHARE * max(room, 0.0) // per_prompt)))


def device_patch_budget(module, longest: int) -> int:
    """patch_budget of a loaded model (its module) where it runs, from the memory free there now (the
    blocks torch's caching allocator holds unused included)."""
    parameter = next(module.parameters())
    if parameter.device.type != "cuda":
        return ROW_TOKENS
    free, _ = torch.cuda.mem_get_info(parameter.device)
    free += torch.cuda.memory_reserved(parameter.device) - torch.cuda.memory_allocated(parameter.device)
    dtype = str(parameter.dtype).removeprefix("torch.")
    return patch_budget(Shape.of(module.config), dtype, free, longest, True)


def _bytes(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def card(device: str) -> tuple[str, float, float]:
    """(card name, free bytes, total bytes) of `device`; on a machine without it, what is assumed."""
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_available():
        index = torch.device(device).index or 0
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        known = next((k for k in PEAK_TFLOPS if k in name), name)
        return known, float(free), float(total)
    if kind == "cuda":
        return ASSUMED_CARD[0] + " (assumed: no GPU here)", float(ASSUMED_CARD[1]), float(ASSUMED_CARD[1])
    available = _available_cpu_memory()
    return "cpu", available, available


def available_memory() -> int | None:
    """Bytes the system can still give (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _available_cpu_memory() -> float:
    return float(available_memory() or float("inf"))  # unknown: nothing is refused


def peak_seconds(shape: Shape, dtype: str, tokens: int, device_card: str, phase: str) -> float | None:
    """Seconds for `tokens` forwarded tokens on a known GPU at the phase's measured share of the peak;
    None for a card or dtype without a known peak (a CPU: forward/estimates.py's rates)."""
    peak = PEAK_TFLOPS.get(device_card.split(" ")[0], {}).get(dtype)
    if peak is None:
        return None
    return tokens * shape.flops_per_token() / (peak * 1e12 * EFFICIENCY.get(phase, OTHER_PHASES))


def check_fits(
    config, spec: str, dtype: str, device: str, device_map: str | None, working: float = 0.0
) -> None:
    """Refuse, in one line and before any weights load, a model whose weights and working set exceed
    the device's free memory, naming what would fit (a smaller dtype, --device-map auto)."""
    if device_map is not None or torch.device(device).type not in ("cpu", "cuda"):
        return
    shape = Shape.of(config)
    if shape is None:
        return
    name, free, _ = card(device)
    need = shape.weights(dtype) + working
    if need <= free:
        return
    options = []
    if _bytes("bfloat16") < _bytes(dtype) and shape.weights("bfloat16") + working <= free:
        options.append(f"--dtype bfloat16 ({(shape.weights('bfloat16') + working) / GB:.1f} GB)")
    if torch.device(device).type == "cuda" and torch.cuda.device_count() > 1:
        together = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        if need <= together:
            options.append(
                f"--device-map auto ({torch.cuda.device_count()} GPUs, {together / GB:.0f} GB free)"
            )
    fix = (
        "use " + " or ".join(options)
        if options
        else "use a device with more memory or --device-map auto across GPUs (--shard splits the prompts, "
        "not the model)"
    )
    raise ModelSpecError(
        f"'{spec}' needs about {need / GB:.1f} GB in {dtype} ({shape.parameters / 1e9:.2f} B parameters) "
        f"but {device}{'' if name == 'cpu' else f' ({name})'} has {free / GB:.1f} GB free; {fix}"
    )
