"""Vocabulary parallelism across pipeline stages: the model transform and the runtime of S and T.

``apply_vocab_parallel`` takes the vocabulary layers out of a (tensor-parallel) model chunk: the first
stage keeps its position embeddings and dropout but reads the word embeddings the ``EMB`` collective
summed; the last stage stops at the final norm. Each rank's chunk 0 gets :class:`VocabSlices`, its
``V/(p·t)`` rows of the embedding and of the output weight (the same parameter when tied: no embedding
group all-reduce), ordinary parameters of the chunk, so optimizers, ZeRO and checkpoints see them like any
other (checkpoints save them as the global input table and untied output weight the model declares,
``PipelineParts.table_weight`` / ``output_weight``, sharded over the pipeline and tensor ranks: their
placements are ``Split("pp", 0, p, pp_rank)`` then ``Split("tp", 0, t, tp_rank)`` with the role ``vocab``,
``ptdp.parallel.placement``). The chunk's parts are reached through the model's declaration
(``ptdp.parallel.pipeline.parts``), never by one model class's attribute names.

:class:`VocabStage` runs the actions of ``ptdp.schedule.vocab`` (its handlers; :class:`VocabParallel` is the
plug-in that makes such stages for training and evaluation). The cross-entropy is the tensor-parallel
one (``ptdp.parallel.tensor.cross_entropy``) taken one level up: the slices of a pipeline rank combine over
the TP group inside S and T; the p pipeline ranks combine in the barriers, by rescaling each rank's
sum of exponentials to the global max. With one barrier, S also computes this slice's input-gradient
terms ``exp(z - max_r) W_r`` and the target rows, which C0 carries with the statistics, so the last stage
assembles the input gradient without a second barrier (the math: ``ptdp.parallel.vocab.heads``).

Multi-token prediction: its modules run on the last stage, but their output projections and
cross-entropies are heads of S and T like the model's (``heads``), so no stage computes 1 + D vocabulary
layers: the last chunk returns the model's and the D modules' hidden states stacked, BCAST_H carries them
all, and T's input gradient comes back stacked. The modules embed tokens 1..D places ahead, which are the
microbatch's own ids (and token 0 past the end): EF embeds the ids with one more column of token 0, EMB
sums them on every rank (an all-reduce instead of a reduce), the last stage reads the rows the modules ask
for from it (:class:`_ProvidedTokens`), and EMB_G sums both ends' gradients (an all-reduce instead of a
broadcast) before EB adds them into each rank's rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptdp.models.mtp import MultiTokenPrediction, ShiftLabels
from ptdp.observability import communication
from ptdp.parallel.collectives import group_rank, group_size
from ptdp.parallel.data.protocol import GradReducer
from ptdp.parallel.pipeline.handlers import ActionHandler, Handler
from ptdp.parallel.pipeline.module_stage import BatchSource, LossFn, ModuleStage, StageLayout
from ptdp.parallel.pipeline.parts import ChunkParts
from ptdp.parallel.placement import Placement, Placements, Split
from ptdp.parallel.vocab.heads import Saved, gather_sequence, rows_of, s_pass, t_pass, tp_sum
from ptdp.schedule.actions import Action
from ptdp.schedule.vocab import VOCAB_COLLECTIVES, VOCAB_COMPUTE, end_ranks, waits_for

SLICES = "vocab_slices"  # the attribute of chunk 0 holding this rank's vocabulary rows


class VocabSlices(nn.Module):
    """This rank's rows ``[start, start + rows)`` of the padded vocabulary: input and output weights."""

    def __init__(self, rows: int, hidden: int, start: int, tied: bool):
        super().__init__()
        self.start, self.rows = start, rows
        self.embedding = nn.Parameter(torch.empty(rows, hidden))
        self.head = None if tied else nn.Parameter(torch.empty(rows, hidden))

    def output_weight(self) -> Tensor:
        return self.embedding if self.head is None else self.head


class _Provided(nn.Module):
    """Stands in for the word embeddings on the first stage: returns what the stage put in ``current``."""

    current: Tensor | None = None

    def forward(self, ids: Tensor) -> Tensor:
        return self.current


class _ProvidedTokens(nn.Module):
    """Stands in for the word embeddings of the last stage's copy (multi-token prediction): the rows of the
    tokens asked for, read from EMB's sum for the microbatch's ids, ``current`` (``[b, s + 1, h]``, a leaf
    whose gradient EMB_G returns) at ``ids`` (``[b, s + 1]``). A token's row is the same wherever it
    occurs, and so is the row its gradient goes to, so any of its positions serves."""

    current: Tensor | None = None
    ids: Tensor | None = None

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows

    def forward(self, tokens: Tensor) -> Tensor:
        where = torch.zeros(self.rows, dtype=torch.long, device=tokens.device)
        where[self.ids.flatten()] = torch.arange(self.ids.numel(), device=tokens.device)
        return self.current.flatten(0, 1)[where[tokens]]


def _stacked_hidden_states(mtp: MultiTokenPrediction, hidden: Tensor, labels: Tensor, embed, head) -> Tensor:
    """The multi-token prediction modules' forward under vocabulary parallelism: the model's final hidden
    states and the D modules' stacked (``[1 + D, b, s, h]``) for the vocabulary passes, whose heads compute
    their losses."""
    return torch.stack([hidden, *mtp.hidden_states(hidden, labels, embed)])


class _NoWeight(nn.Module):
    weight = None


class _Hidden(nn.Module):
    """Stands in for the logits on the last stage: the final-norm output goes to the vocabulary passes."""

    def forward(self, x: Tensor, weight: Any, shared: bool) -> Tensor:
        return x


def apply_vocab_parallel(chunk: nn.Module, local_chunk: int, pp_rank: int, p: int, tp_rank: int, t: int,
                         padded_vocab: int, placements: Placements) -> nn.Module:
    """Take the vocabulary layers out of ``chunk`` (module docstring); chunk 0 gets the slices, recorded in
    ``placements``: distinct on every rank (each counts its own in the norm), weight-decayed as the full
    tables are."""
    parts = ChunkParts(chunk)
    names = parts.names
    if parts.input_embedding is not None:
        placements.remove(parts.table(parts.input_embedding))
        parts.set_table(parts.input_embedding, _Provided())
    if parts.is_last():
        for gone in (parts.untied_output, parts.head_copy):
            if gone is not None:
                placements.remove(gone)
        parts.set(names.untied_output, None)
        parts.set(names.head_copy, _NoWeight())
        parts.set(names.to_logits, _Hidden())
    if parts.mtp_copy is not None:  # the MTP modules read EMB's rows, their heads go to S/T
        placements.remove(parts.table(parts.mtp_copy))
        parts.set_table(parts.mtp_copy, _ProvidedTokens(padded_vocab))
        mtp = parts.multi_token_prediction
        mtp.forward = functools.partial(_stacked_hidden_states, mtp)
    if local_chunk == 0:
        rows = padded_vocab // (p * t)
        device = next(chunk.parameters(), torch.empty(0, device="meta")).device  # meta in build_model_chunks
        with torch.device(device):
            slices = VocabSlices(rows, chunk.cfg.hidden_size, (pp_rank * t + tp_rank) * rows, chunk.cfg.tied_embeddings)
        splits = (Split("pp", 0, p, pp_rank), Split("tp", 0, t, tp_rank))  # row block pp_rank·t + tp_rank
        full = {"embedding": names.table_weight, "head": names.output_weight}  # the slices' full-model names
        for name, param in slices.named_parameters():
            placements.record(param, Placement(full[name], splits, role="vocab"))
        setattr(chunk, SLICES, slices)
    return chunk


def vocab_slices(chunks: Sequence[nn.Module]) -> VocabSlices | None:
    return getattr(chunks[0], SLICES, None) if chunks else None


def _accumulate(param: nn.Parameter, grad: Tensor, grads: GradReducer | None) -> None:
    """Add into the gradient buffer (``main_grad``), as the buffers' hook does for autograd's grads; a
    ZeRO-2/3 bucket's buffer is allocated at its first gradient (``grads.allocate_main_grad``: no autograd
    hook sees this one, so its reduction waits for the step's end or ZeRO-3's reduce after EB)."""
    if grads is not None:
        grads.allocate_main_grad(param)
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad.to(main.dtype))
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad.to(param.dtype))


@dataclass(frozen=True)
class VocabParallel:
    """The executor plug-in of vocabulary parallelism: a stage factory (``ptdp.parallel.assembly``) whose
    stages are :class:`VocabStage`s, which register the S/T/EF/EB passes and the barrier collectives as
    handlers. ``barriers``: 1 (fused) or 2 (``--disable-fb-fusion``)."""

    barriers: int
    pp_group: Any
    tp_group: Any
    pp_ranks: tuple[int, ...]  # global ranks of this pipeline
    sequence_parallel: bool
    grads: GradReducer | None = None  # the gradient buffers the slices' gradients go into

    def __call__(self, chunks: Sequence[nn.Module], layout: StageLayout, batches: BatchSource, loss_fn: LossFn,
                 loss_scale: float = 1.0, forward_only: bool = False, **options: bool) -> VocabStage:
        """``options``: ``ModuleStage``'s (``piecewise``, ``delay_weight_grads``)."""
        return VocabStage(chunks, layout, batches, loss_fn, loss_scale, forward_only, vocab=self, **options)


class VocabStage(ModuleStage):
    """``ModuleStage`` with the vocabulary layers taken out, plus the vocabulary actions
    (``ptdp.schedule.vocab``) as handlers. The cross-entropy is computed by S and T, not ``loss_fn``; each
    microbatch's loss factor is 1/m times ``loss_scale``, as ``ModuleStage``'s (the MTP heads' λ/D of it)."""

    def __init__(self, chunks: Sequence[nn.Module], layout: StageLayout, batches: BatchSource, loss_fn: LossFn,
                 loss_scale: float = 1.0, forward_only: bool = False, *, vocab: VocabParallel, **options: bool):
        super().__init__(chunks, layout, batches, loss_fn, loss_scale, forward_only, **options)
        self.m = batches.num_microbatches
        self.scale, self.barriers = loss_scale / self.m, vocab.barriers
        self.pp_group, self.tp_group, self.pp_ranks = vocab.pp_group, vocab.tp_group, list(vocab.pp_ranks)
        self.sp = vocab.sequence_parallel
        self.grads = vocab.grads
        self.slices = vocab_slices(chunks)
        cfg = chunks[0].cfg
        self.vocab_size, self.mtp_depth = chunks[0].vocab_size, cfg.mtp_num_layers or 0  # the MTP heads
        self.final_cap = cfg.final_logit_softcapping
        self.heads = 1 + (0 if forward_only else self.mtp_depth)  # the modules run in training only
        mtp_weight = cfg.mtp_loss_scaling_factor / max(self.mtp_depth, 1)
        self.weights = torch.tensor([self.scale] + [self.scale * mtp_weight] * (self.heads - 1), dtype=torch.float64)
        v = layout.v
        self.first_chunk = next((c for c in range(v) if self.is_first(c)), None)
        self.last_chunk = next((c for c in range(v) if self.is_last(c)), None)
        self.first_rank, self.last_rank, _ = end_ranks(layout.p, v, layout.placement)
        self._works: dict[tuple[str, int], Any] = {}
        self._buf: dict[tuple[str, int], Any] = {}  # collective buffers
        self._saved: dict[int, Saved] = {}  # S -> T
        self._grad_h: dict[int, Tensor] = {}
        self._leaves: dict[tuple[int, int], Tensor] = {}

    def handlers(self) -> Mapping[str, ActionHandler]:
        """The barrier collectives (posted, not timed) and the passes (timed as compute, ``vocab_<op>``)."""
        table: dict[str, ActionHandler] = {op: Handler(lambda a, _: self.collective(a)) for op in VOCAB_COLLECTIVES}
        table |= {op: Handler(lambda a, _: self.vocab(a), f"vocab_{op}") for op in VOCAB_COMPUTE}
        return table

    # ---- waits -----------------------------------------------------------------------------------
    def _wait(self, action) -> None:
        for key in waits_for(action, self.first_chunk, self.last_chunk, self.barriers, embeds_last=self.mtp_depth > 0):
            work = self._works.pop(key, None)
            if work is not None:
                work.wait()

    # ---- what enters and leaves a chunk, with the vocabulary layers taken out (ModuleStage's hooks) ------
    def _leaf(self, chunk: int, microbatch: int, columns: int | None) -> Tensor:
        """EMB's rows of the microbatch (its first ``columns`` positions) as a leaf whose gradient EB needs."""
        rows = self._buf["EMB", 0][microbatch]
        leaf = (rows if columns is None else rows[:, :columns]).detach().requires_grad_(not self.forward_only)
        self._leaves[chunk, microbatch] = leaf
        return leaf

    def _enter(self, chunk: int, microbatch: int, input: Tensor | None) -> Tensor:
        self._wait(Action("F", microbatch, chunk))
        if chunk == self.first_chunk:
            ids = self.batches.inputs(microbatch)
            parts = ChunkParts(self.chunks[chunk])
            parts.table(parts.input_embedding).current = self._leaf(chunk, microbatch, ids.shape[1])
        if chunk == self.last_chunk and self.heads > 1:  # the MTP modules' embedding rows
            parts = ChunkParts(self.chunks[chunk])
            provided = parts.table(parts.mtp_copy)
            provided.current, provided.ids = self._leaf(chunk, microbatch, None), self._ids[0][microbatch]
        return super()._enter(chunk, microbatch, input)

    def _exit(self, chunk: int, microbatch: int, y: Tensor) -> tuple[Tensor, Tensor | None]:
        """The last stage's final-norm output goes to the vocabulary passes (``BCAST_H``); it is the
        backward's root, seeded by T's gradient."""
        if chunk != self.last_chunk:
            return super()._exit(chunk, microbatch, y)
        self._buf["H", microbatch] = y.detach().contiguous().view(self._hidden_shape())
        return y, None

    def _seed(self, chunk: int, microbatch: int, output_grad: Tensor | None, root: Tensor) -> Tensor | None:
        self._wait(Action("B", microbatch, chunk))  # B and I wait for the same barrier
        if chunk != self.last_chunk:
            return output_grad
        g = self._grad_h.pop(microbatch)
        if self.sp:
            g = g.chunk(group_size(self.tp_group), dim=2)[group_rank(self.tp_group)]
        return g.to(root.dtype).view(root.shape).contiguous()

    def _after_backward(self, chunk: int, microbatch: int) -> None:
        """The embedding rows' gradient, into EMB_G's buffer: the first stage's and the MTP modules'."""
        leaf = self._leaves.pop((chunk, microbatch), None)
        if leaf is not None and leaf.grad is not None:
            self._emb_grads()[microbatch, :, :leaf.shape[1]].add_(leaf.grad)

    def _emb_grads(self) -> Tensor:
        if ("EMB_G", 0) not in self._buf:
            self._buf["EMB_G", 0] = torch.zeros_like(self._buf["EMB", 0])
        return self._buf["EMB_G", 0]

    # ---- collectives -------------------------------------------------------------------------------
    def collective(self, action) -> None:
        op, mb = action.op, action.microbatch
        first, last = self.pp_ranks[self.first_rank], self.pp_ranks[self.last_rank]
        issue = {"group": self.pp_group, "async_op": True, "action": repr(action)}  # recorded as the action
        if op == "EMB":  # with MTP the last stage reads the rows too
            buf = self._buf["EMB", 0]
            work = (communication.all_reduce(buf, **issue) if self.mtp_depth
                    else communication.reduce(buf, first, **issue))
        elif op == "BCAST_H":
            buf = self._buf.get(("H", mb))
            if buf is None:
                buf = self._buf["H", mb] = torch.empty(self._hidden_shape(), dtype=self._dtype())
            work = communication.broadcast(buf, last, **issue)
        elif op == "C0":
            mine = self._buf.pop(("S", mb))
            out = [torch.empty_like(mine) for _ in range(self.p)]
            self._buf["C0", mb] = out
            work = communication.all_gather(out, mine, **issue)
        elif op == "C1":
            buf = self._buf.pop(("C1", mb))
            work = communication.reduce(buf, last, **issue)
        elif op == "EMB_G":  # with MTP both ends hold gradients of the rows
            buf = self._emb_grads()
            work = (communication.all_reduce(buf, **issue) if self.mtp_depth
                    else communication.broadcast(buf, first, **issue))
        else:
            raise ValueError(f"unknown vocabulary collective {op}")
        self._works[op, mb] = work

    def _dtype(self) -> torch.dtype:
        return self.slices.embedding.dtype

    def _hidden_shape(self) -> tuple[int, ...]:
        """``[heads, b, s, h]`` of the last stage's output (s/t tokens under sequence parallelism)."""
        ids = self.batches.inputs(0)
        seq = ids.shape[1] // group_size(self.tp_group) if self.sp else ids.shape[1]
        return (self.heads, ids.shape[0], seq, self.slices.embedding.shape[1])

    # ---- vocabulary computes -----------------------------------------------------------------------
    def vocab(self, action) -> None:
        self._wait(action)
        with torch.no_grad():
            {"EF": self._embed, "EB": self._embed_backward, "S": self._s, "T": self._t}[action.op](action.microbatch)

    def _embed(self, _: int) -> None:
        ids = torch.stack([self.batches.inputs(j) for j in range(self.m)])
        if self.mtp_depth:  # and token 0, which the MTP modules read past the sequence's end
            ids = torch.cat([ids, ids.new_zeros(*ids.shape[:2], 1)], dim=2)
        local, outside = rows_of(ids, self.slices.start, self.slices.rows)
        part = F.embedding(local, self.slices.embedding).masked_fill(outside.unsqueeze(-1), 0.0)
        self._buf["EMB", 0] = tp_sum(part, self.tp_group)
        self._ids = (ids, local, outside)

    def _embed_backward(self, _: int) -> None:
        _, local, outside = self._ids
        grads = self._emb_grads()
        keep = ~outside
        dw = torch.zeros(self.slices.embedding.shape, dtype=torch.float32, device=grads.device)
        dw.index_add_(0, local[keep], grads[keep].float())
        _accumulate(self.slices.embedding, dw, self.grads)
        self._buf.clear()

    def _targets(self, mb: int) -> Tensor:
        """``[heads, b, s]``: the labels, and for MTP module k the labels k places ahead (-1: none)."""
        labels, shift = self.batches.labels(mb), ShiftLabels()
        return torch.stack([shift(labels, k) for k in range(self.heads)])

    def _s(self, mb: int) -> None:
        x = gather_sequence(self._buf.pop(("H", mb)), self.tp_group, self.sp)
        packed, saved = s_pass(x, self._targets(mb), self.slices.output_weight(), self.slices.start,
                               self.vocab_size, self.tp_group, self.barriers == 1 and not self.forward_only,
                               self.final_cap)
        self._buf["S", mb] = packed
        self._saved[mb] = saved

    def _t(self, mb: int) -> None:
        gathered = torch.stack(self._buf.pop(("C0", mb)))  # [p, heads, b, s, k]
        last = self.rank == self.last_rank
        w = self.slices.output_weight()
        out = t_pass(gathered, self._saved.pop(mb), w, self.rank, self.weights, last, self.barriers,
                     self.forward_only, self._dtype(), self.tp_group, self.batches.loss_weights(mb))
        if last:
            self.losses[mb] = out.losses[0] * self.scale  # as ModuleStage's: over m, times the loss scale
            if self.heads > 1:  # the MTP modules' cross-entropies, for their step hook
                stats = ChunkParts(self.chunks[self.last_chunk]).multi_token_prediction.stats
                stats["mtp_losses"] = stats["mtp_losses"] + out.losses[1:] if "mtp_losses" in stats \
                    else out.losses[1:].clone()
        if self.forward_only:
            return
        _accumulate(w, out.weight_grad, self.grads)
        if self.barriers == 2:
            self._buf["C1", mb] = out.partial
            if last:
                self._grad_h[mb] = out.partial
        elif last:
            self._grad_h[mb] = out.whole
