"""The training samples in the order training reads them (what ``ptdp samples`` prints, ``ptdp.cli.samples``).

Sample ``i`` of the training order is in global batch (iteration) ``i // B + 1``; inside it, data-parallel
rank ``r`` takes positions ``[r*B/d, (r+1)*B/d)`` and microbatch ``j`` rows ``[j*b, (j+1)*b)`` of that slice.
``tokens``/``labels`` are ``text[:-1]``/``text[1:]`` of the ``seq_length + 1`` ids, as in Megatron's GPTDataset.
With the document flags (``--reset-position-ids``, ``--reset-attention-mask``, ``--eod-mask-loss``) a record
also shows what training reads of them (``ptdp.data.documents``): the documents' boundaries ``cu_seqlens``
and, with ``--eod-mask-loss``, the positions left out of the loss. With ``--sft`` a record shows the
conversations' boundaries, the positions that carry the loss (``loss_positions``: their label is an assistant
token) and, with ``--decode``, the text with each run of loss-bearing tokens between ``[[`` and ``]]``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ptdp.data.documents import DocumentOptions, cu_seqlens
from ptdp.data.microbatch import microbatch_positions
from ptdp.data.tokenizer import BPETokenizer


def sample_record(dataset, i: int, iteration: int, dp_rank: int, microbatch: int, tokenizer=None,
                  documents: DocumentOptions | None = None) -> dict:
    """One sample as ``ptdp samples`` prints it (``dataset``: a GPTDataset, a BlendedDataset or the train stream,
    each of which locates its samples); ``documents``: the document flags given, if any (module docstring)."""
    member, k = dataset.locate(i)
    text = member[k]
    record = {"sample": i, "iteration": iteration, "dp_rank": dp_rank, "microbatch": microbatch,
              "dataset": member.indexed.prefix, "dataset_sample": k, "document_ids": member.document_ids(k),
              "tokens": text[:-1].tolist(), "labels": text[1:].tolist()}
    if documents is not None and documents.sft:
        _, weights, bounds = member.sft_sample(k)
        record["cu_seqlens"] = list(bounds)
        record["conversations"] = len(record["document_ids"])
        record["loss_positions"] = [int(p) for p in weights.nonzero()[0]]
        if tokenizer is not None:
            record["text"] = marked_text(text, weights, sum(n for _, n in member.conversations(k)), tokenizer)
        return record
    if documents is not None:
        record["cu_seqlens"] = list(cu_seqlens(text[:-1], documents.eod))
        if documents.eod_mask_loss:
            record["loss_masked_positions"] = [int(k) for k in (text[:-1] == documents.eod).nonzero()[0]]
    if tokenizer is not None:
        record["text"] = tokenizer.decode(record["tokens"])
    return record


LOSS_OPEN, LOSS_CLOSE = "[[", "]]"


def marked_text(text, weights, end: int, tokenizer) -> str:
    """``--sft``'s sample as text, special tokens shown, each run of tokens that carry the loss (the labels
    of the positions of weight 1) between ``[[`` and ``]]``; the padding after the conversations' ``end``
    left out."""
    carries = [False, *(bool(w) for w in weights)][:end]
    pieces, start = [], 0
    for t in range(1, end + 1):
        if t == end or carries[t] != carries[start]:
            run = tokenizer.decode(text[start:t].tolist(), keep_special=True) if isinstance(tokenizer, BPETokenizer) \
                else tokenizer.decode(text[start:t].tolist())
            pieces.append(f"{LOSS_OPEN}{run}{LOSS_CLOSE}" if carries[start] else run)
            start = t
    return "".join(pieces)


def iter_samples(dataset, global_batch: int, dp: int, micro: int, indices: Iterator[int] | list[int]):
    """(sample index, iteration, dp rank, microbatch) for ``indices`` of the training order."""
    per_rank = global_batch // dp
    for i in indices:
        q = i % global_batch
        yield i, i // global_batch + 1, q // per_rank, (q % per_rank) // micro


def batch_indices(iteration: int, global_batch: int, dp: int, micro: int) -> list[tuple[int, int, int]]:
    """(sample index, dp rank, microbatch) of every sample of global batch ``iteration`` (from 1), in the order
    each rank reads them; the same function the trainer's ``get_microbatch`` uses."""
    out = []
    for r in range(dp):
        for j in range(global_batch // (dp * micro)):
            out.extend((i, r, j) for i in microbatch_positions(iteration - 1, global_batch, r, dp, micro, j))
    return out
