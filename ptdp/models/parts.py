"""Pipeline parts: how a model family's modules cut into pipeline stages, declared by the family.

A model says which of its attributes hold the transformer layers (a module dictionary keyed by the GLOBAL
layer index, so parameter names, hence checkpoints, do not depend on the layout), which modules live only
on the first stage (the input embedding) and only on the last (the final norm, an untied output layer,
multi-token prediction), and where the pipeline may put its copies of the input embedding's table on the
last stage. ``ptdp.parallel.pipeline.stage`` (the split, the tied copies) and ``ptdp.parallel.vocab.stage``
(vocabulary parallelism) read this record and never the attribute names of one model class, as tensor
parallelism reads the sharding rules (``ptdp.models.sharding``).

It also says where a transformer layer may be cut (:class:`LayerCuts`): its residual halves in order, and in
each the linears where a parallelism that splits them communicates (:class:`Cut`: those that read the half's
input, the one that writes its output). The overlapped schedules run a
chunk's forward as pieces cut there (``ptdp.parallel.pipeline.program``), so that one microbatch's
communication runs while another's piece computes; the model itself keeps no such machinery. Recomputation
(``ptdp.parallel.recompute``) reads the same record for the layers it checkpoints.

A plain record, no torch: the declaration is data, as the sharding rules are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    """Where one kind of block is cut: ``first``, the block's attributes of the linears that read the normed
    input (nothing else reads it; all of them enter through the first one's exchange, so they must be split
    alike; an optional one, such as an attention output gate, may be None on the block); ``last``, the
    linear whose output the block returns (nothing follows it)."""

    first: tuple[str, ...]
    last: str


@dataclass(frozen=True)
class Half:
    """One residual half of a transformer layer, ``residual(block(norm(x)), x)``, and its cut points.

    ``name``: what its pieces are called ("attention", "mlp"). ``norm``, ``block``: the layer's attributes
    of the norm before the block and of the block; ``residual``: the layer's method ``(block output, x) ->
    output`` (the bias, a norm after the block, dropout, the residual add). ``documents``: whether the block
    takes the microbatch's document layout as its second argument. ``cuts``: the cut points of each kind of
    block the half may hold (softmax attention or a Gated DeltaNet); the first whose ``last`` the block has
    applies. A block of none of them (multi-latent attention) is one piece; a block that is a program of
    pieces itself (``LayerCuts.pieces``) brings its own cuts."""

    name: str
    norm: str
    block: str
    residual: str
    cuts: tuple[Cut, ...]
    documents: bool = False


@dataclass(frozen=True)
class LayerCuts:
    """Where a transformer layer may be cut: ``halves`` in the order the layer runs them (its forward is
    their composition), and ``pieces``, the method of a block that is already a program of pieces
    (``ptdp.models.pieces``: a MoE layer's route, dispatch, experts, combine) taking the names of its input
    and output values. ``selective``: the dotted path, from a layer, of the method selective recomputation
    checkpoints (the attention core)."""

    halves: tuple[Half, ...]
    pieces: str
    selective: str


@dataclass(frozen=True)
class PipelineParts:
    """The attribute names of a model's pipeline parts. An absent part is an attribute set to None (the
    model's forward runs each part only when present), so a chunk is the model with the other stages' parts
    set to None and the other layers deleted from ``layers``.

    ``layers``: the module dictionary of the transformer layers, keyed by global layer index.
    ``first``: the modules only the first stage holds (the input embedding among them).
    ``last``: the modules only the last stage holds (the final norm, the untied output layer, ``mtp``).
    ``input_embedding``: the input embedding, whose ``table`` submodule is its ``[V, h]`` word table (its
    ``weight`` is the tied output weight, and the source of every copy).
    ``final_norm``: the last stage's first module: present exactly on the last stage.
    ``untied_output``: the untied output layer (None on the model when the output weight is tied).
    ``to_logits``: the module that turns hidden states into logits (vocabulary parallelism replaces it).
    ``multi_token_prediction``: the last-stage module that embeds tokens too, or None if the model has no
    such module: where it is present the last stage keeps a copy of the whole input embedding.
    ``head_copy``: where the last stage keeps its copy of the tied table when the embedding is elsewhere.
    ``mtp_copy``: where the last stage keeps its copy of the input embedding for multi-token prediction.
    ``mtp_modules``: the multi-token prediction module's dictionary of its modules (each one unit of full
    recomputation); ``mtp_layer``: the attribute of such a module that holds its transformer layer.
    ``run_layers``: the model's method that runs its layers in order, ``(x, documents) -> x`` (full
    recomputation replaces it); ``head``: the model's method from the last layer's output to the logits,
    ``(x, labels) -> logits`` (present with ``final_norm``).
    ``cuts``: where a layer may be cut into pieces (:class:`LayerCuts`).

    The field names are the pipeline's words, not a model's: the parallelisms name these, and the model
    maps them to its attributes."""

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    input_embedding: str
    table: str
    final_norm: str
    untied_output: str
    to_logits: str
    multi_token_prediction: str | None
    head_copy: str
    mtp_copy: str
    mtp_modules: str
    mtp_layer: str
    run_layers: str
    head: str
    cuts: LayerCuts

    @property
    def table_weight(self) -> str:
        """The full-model name of the input embedding's table (the tied output weight)."""
        return f"{self.input_embedding}.{self.table}.weight"

    @property
    def output_weight(self) -> str:
        """The full-model name of the untied output layer's weight."""
        return f"{self.untied_output}.weight"

    @property
    def copies(self) -> tuple[str, str]:
        """The parameter names of the last stage's copies of the table: checkpoints save them as
        :attr:`table_weight`, once."""
        return f"{self.head_copy}.weight", f"{self.mtp_copy}.{self.table}.weight"

    def logical_name(self, name: str) -> str:
        """The full-model name of a chunk's parameter (a copy of the table is the table)."""
        return self.table_weight if name in self.copies else name
