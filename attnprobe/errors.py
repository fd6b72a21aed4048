"""Every error class of attnprobe: the one exception family that carries user-facing messages.

The CLI prints `str(error)` on one line and exits with `error.exit_code`; no traceback for a
user mistake. Raise the most specific subclass; catch `AttnprobeError`.
"""


class AttnprobeError(Exception):
    """A problem the user can fix; the message says what and how."""

    exit_code = 2  # what the command line exits with

    def __init__(self, message: str):
        # One line, always: user text quoted in a message (a slot value, a YAML key) may hold
        # line breaks, which are shown escaped.
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


class SuiteError(AttnprobeError):
    """A suite that cannot be run; the message is `file:line: what is wrong; how to fix it`."""


class ModelSpecError(AttnprobeError):
    """A model spec that cannot be resolved or loaded."""


class CaptureError(AttnprobeError):
    """A capture request that does not fit the model or the batch."""


class RunError(AttnprobeError):
    """A run directory that cannot be used as asked."""


class RunInterrupted(AttnprobeError):
    """Ctrl-C during a run: the current chunk was finished and everything so far is kept."""

    exit_code = 130


class UnsupportedFamily(AttnprobeError):
    """verify: no from-scratch recomputation exists for this model family."""


class AnalysisError(AttnprobeError):
    """A run whose tables cannot be analysed as declared (e.g. two prompts of one item share a label)."""


class RegistryError(AttnprobeError):
    """A measure or edit kind whose name or files clash with another's, or whose name cannot name a
    file (attnprobe.registry)."""
