class UsageError(Exception):
    """Bad flags or input, reported as one line (generate.one_line_errors)."""


class CheckpointError(Exception):
    """A user-facing, one-line problem with finding, fetching or preparing a checkpoint."""
