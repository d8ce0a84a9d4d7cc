"""Sharding rules: how a model family's modules split under tensor parallelism, declared by the family.

A model says, per module (by its name in the full model, with ``*`` for any layer index), what a
tensor-parallel rank holds of it; ``ptdp.parallel.tensor.apply`` reads these rules and never the
attribute names of one model class (torchtitan's parallelize plans, in Megatron-Core's vocabulary). A
module that no rule names stays whole on every rank, with whole gradients.

The rules (Narayanan et al., SC'21, §2.3; Korthikanti et al., 2022, for sequence parallelism):

- :class:`ColumnParallel`: the output features split (each rank its heads, its MLP columns). QKV, fc1,
  MLA's up projections.
- :class:`RowParallel`: the input features split, the partial products summed (or, under sequence
  parallelism, reduce-scattered over the tokens). The attention output projection, fc2.
- :class:`VocabParallel`: a ``[V, h]`` table split by vocabulary rows (embeddings, the output layer).
- :class:`VocabParallelOutput`: the logits or the cross-entropy over a vocabulary-split table.
- :class:`SequenceEntry`: the module's output enters the residual stream (the embedding): scattered along
  the sequence under sequence parallelism.
- :class:`HeadSharedInput`: an input every head of the layer reads (MLA's one RoPE key): its gradient is
  summed over the ranks' heads.
- :class:`HeadSplit`: a module's per-head parameters (the attention sinks; a Gated DeltaNet's decay and
  convolution): each rank keeps its heads' rows, no communication.
- :class:`PartialGradient`: replicated, but each rank's gradient is a partial sum over ``"tokens"`` (the
  rank's tokens under sequence parallelism: the norms, the biases after a row-parallel sum) or over
  ``"heads"`` (the rank's heads, whatever the sequence layout: a per-head q/k norm). The placement records
  it (``partial_over``) and the gradients are summed over the tensor-parallel group after the backward.
  A per-head norm without this rule would silently train a different norm on each rank.

Plain records, no torch: the rules are data, as the schedules' ``ScheduleSpec`` are.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ColumnParallel:
    """Output features split. ``gather_output``: the full output on every rank afterwards;
    ``scatter_to_sequence``: then, under sequence parallelism, back to this rank's tokens."""

    gather_output: bool = False
    scatter_to_sequence: bool = False


@dataclass(frozen=True)
class RowParallel:
    """Input features split; the outputs summed over the ranks."""


@dataclass(frozen=True)
class VocabParallel:
    """A ``[V, h]`` table split by vocabulary rows."""


@dataclass(frozen=True)
class VocabParallelOutput:
    """The logits (``"logits"``) or the per-token cross-entropy (``"cross_entropy"``) over a table split by
    vocabulary rows: computed on each rank's slice of the vocabulary."""

    kind: Literal["logits", "cross_entropy"]


@dataclass(frozen=True)
class SequenceEntry:
    """The module's output is the start of the residual stream: split along the sequence under sequence
    parallelism."""


@dataclass(frozen=True)
class HeadSharedInput:
    """A module whose output every head reads (the identity in one process)."""


@dataclass(frozen=True)
class HeadSplit:
    """The module's own parameters hold one row per head (or per channel of a head) along dim 0, in head
    order: each rank keeps the rows of its heads, and nothing communicates (the attention sinks; a Gated
    DeltaNet's per-head decay parameters and its depthwise convolution over the heads' channels).

    ``head_counts``: the module's integer attributes that count its heads (``AttentionSinks.heads``, which
    sizes the fixed sinks that have no parameter): each becomes this rank's count. The rule names them so
    that the parallelism applying it names no attribute of a model."""

    head_counts: tuple[str, ...] = ()


@dataclass(frozen=True)
class PartialGradient:
    """Replicated; each rank's gradient is a partial sum over the ``over`` it holds ("tokens" under
    sequence parallelism, "heads" always)."""

    over: Literal["tokens", "heads"]


Rule = ColumnParallel | RowParallel | VocabParallel | VocabParallelOutput | SequenceEntry | HeadSharedInput \
    | HeadSplit | PartialGradient


@dataclass(frozen=True)
class ShardingRules:
    """A model's rules: ``(pattern, rule)`` pairs, the first pattern that matches a module's full name wins
    (``fnmatch``: ``layers.*.attention.qkv``)."""

    rules: tuple[tuple[str, Rule], ...]

    def rule_for(self, name: str) -> Rule | None:
        return next((rule for pattern, rule in self.rules if fnmatch.fnmatchcase(name, pattern)), None)

    def __add__(self, other: ShardingRules) -> ShardingRules:
        return ShardingRules(self.rules + other.rules)


def rules(pairs: Iterable[tuple[str, Rule]]) -> ShardingRules:
    return ShardingRules(tuple(pairs))
