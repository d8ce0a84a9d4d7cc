"""Context parallelism of the Gated DeltaNet layers (``ptdp.models.gated_deltanet``), two ways
(``--linear-attention-cp-comm-type``); the full-attention layers keep their own (``--cp-comm-type``).

A CP rank holds two load-balanced chunks of each sequence, chunk ``r`` and chunk ``2c-1-r`` of 2c
(``ptdp.parallel.context.attention``); the rule needs them in order, each from the state the previous chunk
left, and the convolution needs the previous chunk's last ``taps - 1`` tokens.

``state_passing`` (:class:`StatePassing`): the chunked rule is affine in the incoming state, so each chunk,
run from a zero state, collapses to one pair (A ``[K, K]``, B ``[K, V]``) per head with S_out = A·S_in + B
(``ptdp.models.delta_rule.summary``), whatever its length. Every rank all-gathers the 2c pairs and the 2c
convolution tails (one all-gather each; the gradient is reduce-scattered back), composes the prefix of the
pairs itself, sequentially (2c small K×K products: cheaper than a log-depth exchange of dependent rounds),
and runs its chunks from their true incoming states. Bytes sent and memory per rank do not depend on s.
Packed documents (:class:`_DocumentShard`): a boundary inside a chunk cuts it; the piece before the first
boundary takes the incoming state (and the previous chunk's convolution tail, less the tokens of an earlier
document), the pieces after it start from zero, and the chunk's summary forgets the incoming state (A = 0,
B the last piece's final state). A chunk that starts a document takes nothing from the one before.

``a2a`` (:class:`HeadParallel`, Megatron-Core's): an all-to-all turns the sequence split into a split of
the key-head groups (c must divide the key heads), the layer mixes the whole sequence for its heads (packed
documents too: the layout holds the whole sample's boundaries), and the inverse all-to-all returns its
tokens. Its bytes grow with s, as the activations it moves do.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ptdp.models import delta_rule
from ptdp.models.documents import DocumentLayout, masks_attention
from ptdp.models.gated_deltanet import GatedDeltaNet, documents_apply
from ptdp.parallel.collectives import gather_from_sequence_parallel_region, group_rank, group_size
from ptdp.parallel.context.attention import natural_order
from ptdp.parallel.context.ulysses import AllToAll


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[c, ...]``: every rank's ``x``, in rank order; the gradient reduce-scattered back."""
    return gather_from_sequence_parallel_region(x.unsqueeze(0).contiguous(), group, dim=0)


class StatePassing:
    """The state-passing mixer of a Gated DeltaNet layer on this rank's two chunks (module docstring)."""

    def __init__(self, cp_group):
        self.group, self.c, self.rank = cp_group, group_size(cp_group), group_rank(cp_group)

    def chunk(self, rank: int, half: int) -> int:
        """The sequence chunk (of 2c) that ``rank`` holds as its ``half`` (0 or 1)."""
        return rank if half == 0 else 2 * self.c - 1 - rank

    def __call__(self, layer: GatedDeltaNet, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 documents: DocumentLayout | None) -> torch.Tensor:
        c, n = self.c, conv_in.shape[1] // 2
        tail = layer.conv1d.weight.shape[1] - 1
        halves = [tuple(x[:, i * n:(i + 1) * n] for x in (conv_in, g, beta)) for i in (0, 1)]
        tails = _gather(torch.stack([h[0][:, n - tail:] for h in halves]), self.group)  # [c, 2, b, taps-1, C]
        by_chunk = {self.chunk(r, i): (r, i) for r in range(c) for i in (0, 1)}
        shards = []
        for i, streams in enumerate(halves):
            j = self.chunk(self.rank, i)
            context = None if j == 0 else tails[by_chunk[j - 1]]
            shard = (_DocumentShard(layer, streams, context, documents.bounds, j * n) if masks_attention(documents)
                     else _Shard(layer, streams, context))
            shards.append((shard, j))
        pairs = _gather(torch.stack([shard.summary() for shard, _ in shards]), self.group)  # [c, 2, b, H, K, K+V]
        dk = pairs.shape[-2]
        states, S = {}, None
        for j in range(max(j for _, j in shards) + 1):  # the incoming state of chunk j, in sequence order
            states[j] = S
            pair = pairs[by_chunk[j]]
            A, B = pair[..., :dk], pair[..., dk:]
            S = B if S is None else A @ S + B
        outs = [shard.output(states[j]) for shard, j in shards]
        return torch.cat(outs, 2).transpose(1, 2).to(conv_in.dtype)


class _Shard:
    """One chunk of every sample with no document boundary: run from a zero state, one (A, B) pair."""

    def __init__(self, layer: GatedDeltaNet, streams: tuple, context: torch.Tensor | None):
        self.prepared = delta_rule.prepare(*layer.streams(*streams, context))

    def summary(self) -> torch.Tensor:
        """``[b, H, K, K + V]``: A and B side by side."""
        return torch.cat(delta_rule.summary(self.prepared), -1)

    def output(self, state: torch.Tensor | None) -> torch.Tensor:
        """``[b, H, n, V]`` from the chunk's true incoming ``state``."""
        return delta_rule.scan(self.prepared, state)[0]


class _DocumentShard:
    """One chunk of packed samples (``bounds``: each sample's document boundaries over the whole sample; the
    chunk starts at token ``start``). Per sample, the chunk's tokens split at the boundaries inside it: the
    first piece continues the document the previous chunk left (its incoming state, its convolution tail
    with the tokens before that document's start zeroed) unless a document starts exactly here; every later
    piece starts from zero. The chunk's summary is then A = 0 (a boundary inside forgets the incoming state)
    and B = the last piece's final state, or the whole chunk's (A, B) when no boundary falls inside it."""

    def __init__(self, layer: GatedDeltaNet, streams: tuple, context: torch.Tensor | None,
                 bounds: Sequence[Sequence[int]], start: int):
        n = streams[0].shape[1]
        tail = layer.conv1d.weight.shape[1] - 1
        self.samples = []  # per sample: (carries, prepared pieces, outputs of those run from zero, final B)
        for i, row in enumerate(bounds):
            begun = max(p for p in row if p <= start)  # where the document the chunk starts in began
            carries = begun < start and context is not None
            edges = sorted({0, n, *(p - start for p in row if start < p < start + n)})
            pieces, outs, final = [], {}, None
            for k, (a, e) in enumerate(zip(edges[:-1], edges[1:])):
                ctx = None
                if k == 0 and carries:  # the tail's tokens from before ``begun`` are another document's
                    keep = torch.arange(start - tail, start, device=context.device) >= begun
                    ctx = context[i:i + 1] * keep[None, :, None].to(context.dtype)
                prepared = delta_rule.prepare(*layer.streams(*(x[i:i + 1, a:e] for x in streams), ctx))
                pieces.append(prepared)
                if k > 0 or not carries:
                    outs[k], final = delta_rule.scan(prepared)
            self.samples.append((carries, pieces, outs, final))

    def summary(self) -> torch.Tensor:
        rows = []
        for carries, pieces, _, final in self.samples:
            if carries and len(pieces) == 1:
                rows.append(torch.cat(delta_rule.summary(pieces[0]), -1))
            else:
                rows.append(torch.cat([final.new_zeros(*final.shape[:-1], final.shape[-2]), final], -1))
        return torch.cat(rows, 0)

    def output(self, state: torch.Tensor | None) -> torch.Tensor:
        rows = []
        for i, (carries, pieces, outs, _) in enumerate(self.samples):
            first = delta_rule.scan(pieces[0], state[i:i + 1])[0] if carries else outs[0]
            rows.append(torch.cat([first, *(outs[k] for k in range(1, len(pieces)))], 2))
        return torch.cat(rows, 0)


class HeadParallel:
    """The all-to-all mixer of a Gated DeltaNet layer (module docstring)."""

    def __init__(self, cp_group):
        self.group, self.c, self.rank = cp_group, group_size(cp_group), group_rank(cp_group)

    def __call__(self, layer: GatedDeltaNet, conv_in: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 documents: DocumentLayout | None) -> torch.Tensor:
        order, inverse = natural_order(self.c, conv_in.shape[1] // 2, conv_in.device)
        # [b, s/c, heads] sequence-sharded -> [b, s, heads/c] head-sharded (key-head groups), natural order
        whole = [AllToAll.apply(x, self.group, 2, 1).index_select(1, order) for x in (conv_in, g, beta)]
        width = whole[0].shape[-1]  # this rank's convolution channels: its key-head groups' rows
        mix = functools.partial(layer.mix, rows=slice(self.rank * width, (self.rank + 1) * width))
        out = documents_apply(mix, documents, *whole) if masks_attention(documents) else mix(*whole)
        return AllToAll.apply(out.index_select(1, inverse).contiguous(), self.group, 1, 2)


def apply_linear_context_parallel(model: torch.nn.Module, cp_group, comm_type: str) -> None:
    """Every Gated DeltaNet layer of ``model`` mixes its sequence over ``cp_group`` the ``comm_type`` way."""
    mixer = StatePassing(cp_group) if comm_type == "state_passing" else HeadParallel(cp_group)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.sequence_mixer = mixer

