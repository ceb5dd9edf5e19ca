"""The plugin's one type for a misuse of its options, on the lowest floor so that every part can raise it.

A :class:`UsageError` is a ``ValueError`` (callers that catch ``ValueError`` keep working); the fairseq commands
the plugin runs (fairseq-train, fairseq-generate, fairseq-interactive) and its own programs print it as one
``PROGRAM: error: ...`` line and exit with status 2, as argparse does for a bad option
(:func:`fairseq_fastgen.option_checks.exit_on_usage_error`).
"""


class UsageError(ValueError):
    """A misuse of the plugin's options, or of a decoder or architecture with a model: the message names the
    option and the value it refuses."""
