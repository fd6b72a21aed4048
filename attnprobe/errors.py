"""The one exception family that carries user-facing messages.

The CLI prints `str(error)` on one line and exits non-zero; no traceback for a user mistake.
"""


class AttnprobeError(Exception):
    """A problem the user can fix; the message says what and how."""

    exit_code = 2  # what the command line exits with

    def __init__(self, message: str):
        # One line, always: user text quoted in a message (a slot value, a YAML key) may hold
        # line breaks, which are shown escaped.
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


class ModelSpecError(AttnprobeError):
    """A model spec that cannot be resolved or loaded."""


class CaptureError(AttnprobeError):
    """A capture request that does not fit the model or the batch."""


class RunInterrupted(AttnprobeError):
    """Ctrl-C during a run: the current chunk was finished and everything so far is kept."""

    exit_code = 130
