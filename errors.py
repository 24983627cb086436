"""The user-facing errors: each is reported as one line (one_line_errors), never a traceback."""
import sys


class UsageError(Exception):
    """Bad flags or input, reported as one line (one_line_errors)."""


class CheckpointError(Exception):
    """A user-facing, one-line problem with finding, fetching or preparing a checkpoint."""


class ModelError(Exception):
    """A user-facing problem with a checkpoint (one-line message)."""


def one_line_errors(fn, args, errors=(UsageError, ModelError, CheckpointError, ValueError)) -> int:
    """fn(args), with bad input reported as one line and exit code 2."""
    try:
        return fn(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
