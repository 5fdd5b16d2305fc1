"""Errors that mean the user must change something (bad model name, bad flag, no GPU, ...).

The CLI prints these as one line without a traceback and exits non-zero; anything else is a bug.
"""


class UserError(Exception):
    """Bad user input. The message says what is wrong and what to do about it."""
