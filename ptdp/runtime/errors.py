"""The one shape every user-facing error takes: ``ptdp <command>: error: <message>`` on one line of stderr.

Messages are built from exceptions whose text may hold newlines (a parser's excerpt, a library's
multi-line complaint); joined here into one line, ending with a newline and flushed, so a log reader or a
test that keeps the ``error:`` lines gets exactly one whole line per problem, even when the process exits
right after (``os._exit``, a launcher that tears the worker down).
"""

from __future__ import annotations

import sys


def error_line(command: str | None, message: object) -> str:
    """``ptdp [command]: error: message`` as one line, newline-terminated."""
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return f"ptdp{' ' + command if command else ''}: error: {text}\n"


def print_error(command: str | None, message: object) -> None:
    """Write :func:`error_line` to stderr and flush it."""
    sys.stderr.write(error_line(command, message))
    sys.stderr.flush()


def write_line(stream, line: str) -> None:
    """``line`` to ``stream``, flushed at once; a stream already closed (a process being torn down, a reader
    gone) is ignored: these lines are a courtesy that must never raise from a signal handler or at exit."""
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
