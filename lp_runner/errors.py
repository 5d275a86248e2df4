"""User-facing errors: each carries one line that names the problem and, where possible, the fix.

The CLI prints ``error: <message>`` for these and exits non-zero without a traceback; anything else is a bug
and keeps its traceback.
"""

# The exit codes of every command (run, tune, study) and of each rank: the user's input, a failed peer, interrupted.
EXIT_USER_ERROR = 2
EXIT_PEER_FAILURE = 3
EXIT_INTERRUPTED = 130


class LPError(Exception):
    """Base class for errors whose message is meant for the user."""


class ConfigError(LPError):
    """Invalid configuration or command-line input."""


class InputError(LPError):
    """Unreadable or invalid prompts, or a prompt that does not fit the model's context."""


class DistributedError(LPError):
    """A peer died, stalled or disagrees (config or weights) in a multi-worker run."""


def first_line(exc: BaseException) -> str:
    """An exception's first line, at most 200 characters (for one-line ``error:`` messages)."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
