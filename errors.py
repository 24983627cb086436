class UsageError(Exception):
    """Bad flags or input, reported as one line (generate.one_line_errors)."""
