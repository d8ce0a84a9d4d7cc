"""The pieces the configuration tree is made of: a field with its flag (:func:`opt`), the one-line error
type every check raises (:class:`ConfigError`), the ``--pipeline-schedule`` help read from the schedule
registry and the overlapped pairs' flags' help. Kept apart from ``ptdp.config.schema`` so the
tree itself stays one screenful per section."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from ptdp.schedule.registry import REGISTRY


class ConfigError(Exception):
    """Problems with the user's configuration, one line each naming the flag (or TOML key) and the fix.

    ``ConfigError(line)`` is one problem; ``ConfigError(*lines)`` several, all reported (``problems``).
    """

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def schedule_help() -> str:
    """The ``--pipeline-schedule`` help: each schedule's bubble and activation memory against 1F1B's
    (the registry's ``ScheduleSpec`` fields)."""
    return ("pipeline schedule (default: interleaved when v > 1, else 1f1b). Bubble / activation memory "
            "against 1F1B's (p-1)/m / 1x: " + "; ".join(f"{s.name} ({s.help}) {s.bubble} / {s.memory}"
                                                         for s in REGISTRY.values()))


OVERLAP_HELP = ("1f1b and interleaved: run each steady-state forward together with another microbatch's "
                "backward, piece by piece, so that the expert dispatch and combine of one hide under the other's "
                "compute (Megatron-Core's combined 1F1B; one more microbatch in flight; dualpipev always overlaps)")
DELAY_WGRAD_HELP = ("in an overlapped pair, compute a piece's weight gradients after issuing the communication of "
                    "its input gradients, as more work to hide it behind")


def opt(default: Any, help: str, flag: str | None = None, aliases: tuple[str, ...] = (), **argparse_kwargs: Any) -> Any:
    """A dataclass field with its command-line flag (derived from the field name unless given) and any
    older spellings of it (``aliases``: flags and TOML keys that Megatron-LM still accepts)."""
    metadata = {"help": help, "flag": flag, "aliases": aliases, "argparse": argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
