"""The ``ptdp`` argument parser's manners, as Megatron-LM's: no abbreviated flags, one-line errors.

- ``allow_abbrev=False`` (Megatron-LM's choice): ``--train-iter 3`` is not silently taken for
  ``--train-iters 3``, and a flag added later cannot make an abbreviation that worked ambiguous.
- A usage error is one line, ``ptdp <command>: error: ...`` (the shape of every ptdp error,
  ``ptdp.runtime.errors``), not a 58-line usage block; an unknown flag names the closest valid one ("did you
  mean --train-iters?"), an unknown command or choice the closest one (``ptdp trian``: "did you mean
  train?"). ``--help`` still prints the whole usage.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

from ptdp.runtime.errors import print_error


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations and with one-line errors (sub-parsers too)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("ptdp").strip() or None
        print_error(command, with_suggestion(message))
        sys.exit(2)


def with_suggestion(message: str) -> str:
    """argparse's "invalid choice: 'trian' (choose from 'train', 'plan', ...)" with "did you mean train?"
    (a sub-command or a flag's choice); other messages unchanged."""
    match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not match:
        return message
    choices = re.findall(r"'([^']*)'", match.group(2)) or [c.strip() for c in match.group(2).split(",")]
    close = difflib.get_close_matches(match.group(1), choices, n=1, cutoff=0.6)
    return message + (f"; did you mean {close[0]}?" if close else "")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every long flag ``parser`` accepts."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def closest_flag(name: str, parser: argparse.ArgumentParser) -> str | None:
    """The valid flag nearest to ``name`` (``--train-iter`` -> ``--train-iters``), or None."""
    flag = name.split("=", 1)[0]
    options = option_strings(parser)
    prefixed = [o for o in options if o.startswith(flag)]  # an abbreviation: the flag it abbreviates
    if len(prefixed) == 1:
        return prefixed[0]
    match = difflib.get_close_matches(flag, prefixed or options, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_arguments_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """One line for the arguments no flag took, with a suggestion for the first unknown flag; for a
    well-known Megatron-LM flag ptdp does not implement, what it is and what to do instead."""
    from ptdp.config.megatron_flags import explanation

    flags = [e for e in extras if e.startswith("--")]
    explained = next((line for line in map(explanation, flags) if line), None)
    if explained:
        return explained
    message = f"unrecognized argument(s): {' '.join(extras)}"
    suggestion = closest_flag(flags[0], parser) if flags else None
    return message + (f"; did you mean {suggestion}?" if suggestion else "")


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    """The sub-command parser ``name`` of ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` with :func:`unknown_arguments_message` for arguments nothing took."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = args.command  # the sub-command (required: argparse stops before this without one)
        sub = subparser(parser, command) if command else None
        print_error(command, unknown_arguments_message(extras, sub or parser))
        sys.exit(2)
    return args
