"""A model chunk's pipeline parts, read through its model's declaration (``ptdp.models.parts``).

The pipeline split (``ptdp.parallel.pipeline.stage``) and vocabulary parallelism (``ptdp.parallel.vocab``)
reach a chunk's embedding, final norm, output layer and the pipeline's copies only through this view, so
they name no attribute of one model class: a model family declares its parts (``pipeline_parts()``) and
both parallelisms cut it, as tensor parallelism applies its sharding rules.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ptdp.models.parts import PipelineParts


class ChunkParts:
    """``chunk``'s parts by their declared names; a part this chunk does not hold reads as None."""

    def __init__(self, chunk: nn.Module):
        self.chunk = chunk
        self.names: PipelineParts = chunk.pipeline_parts()

    def get(self, name: str | None) -> Any:
        return None if name is None else getattr(self.chunk, name, None)

    def set(self, name: str, module: nn.Module | None) -> None:
        setattr(self.chunk, name, module)

    @property
    def layers(self) -> nn.ModuleDict:
        """The transformer layers this chunk holds, keyed by global layer index."""
        return self.get(self.names.layers)

    @property
    def input_embedding(self) -> nn.Module | None:
        return self.get(self.names.input_embedding)

    @property
    def final_norm(self) -> nn.Module | None:
        return self.get(self.names.final_norm)

    @property
    def untied_output(self) -> nn.Module | None:
        """The untied output layer (None when tied, or off the last stage)."""
        return self.get(self.names.untied_output)

    @property
    def head_copy(self) -> nn.Module | None:
        """The last stage's copy of the tied table (its own chunk, the embedding elsewhere)."""
        return self.get(self.names.head_copy)

    @property
    def mtp_copy(self) -> nn.Module | None:
        """The last stage's copy of the input embedding, for multi-token prediction, which embeds tokens."""
        return self.get(self.names.mtp_copy)

    @property
    def multi_token_prediction(self) -> nn.Module | None:
        return self.get(self.names.multi_token_prediction)

    def table(self, embedding: nn.Module) -> nn.Module:
        """The ``[V, h]`` word table of ``embedding`` (the input embedding or its copy)."""
        return getattr(embedding, self.names.table)

    def set_table(self, embedding: nn.Module, module: nn.Module) -> None:
        setattr(embedding, self.names.table, module)

    def is_first(self) -> bool:
        return self.input_embedding is not None

    def is_last(self) -> bool:
        return self.final_norm is not None
