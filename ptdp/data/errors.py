"""The one exception type the data pipeline raises for bad user input.

Callers (the CLI, the trainer) catch :class:`DataError` and print ``str(err)`` as a single line, so every
message names the offending flag or file and says what to do about it.
"""


class DataError(Exception):
    """Bad data input (missing file, corrupt index, inconsistent blend); the message is one line."""
