"""The one exception family that carries user-facing messages.

The CLI prints `str(error)` on one line and exits non-zero; no traceback for a user mistake.
"""


class AttnprobeError(Exception):
    """A problem the user can fix; the message says what and how."""


class ModelSpecError(AttnprobeError):
    """A model spec that cannot be resolved or loaded."""


class CaptureError(AttnprobeError):
    """A capture request that does not fit the model or the batch."""
