"""The base of every error caused by the user's input rather than by a bug.

The entry prints such an error as one line (``error: ...``) and exits with status 2;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: a flag, a file, a layout or a missing package, named in the message."""
