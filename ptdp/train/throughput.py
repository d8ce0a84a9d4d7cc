"""What the progress line counts: the paper's eq. 3 FLOPs of one iteration (``ptdp.models.flops``), with the
attention packed documents actually compute.

With ``--reset-attention-mask`` attention runs inside each document only, so eq. 3's ``4·s²·h`` per sample
is ``4·(sum of l_i²)·h`` over its documents (docs/references.md, §Packed sequences). The global batch's documents
change every iteration: :class:`IterationFlops` reads their boundaries from the samples of iteration k (on
the logging rank, when it logs: the host only, a scan for end-of-document tokens) and the record carries
``attention_length`` (the batch's sum of l_i² / s per sample), which the progress line names.
"""

from __future__ import annotations

from ptdp.config import Config
from ptdp.data.documents import DocumentOptions, sample_bounds, squared_lengths
from ptdp.models import flops


class IterationFlops:
    """FLOPs of iteration k (counted as ``tflops_per_gpu`` counts them, or without recomputation for MFU)."""

    def __init__(self, config: Config, vocab: int, dataset, documents: DocumentOptions | None) -> None:
        m, tr = config.model, config.training
        self.config, self.vocab, self.dataset = config, vocab, dataset
        self.eod = documents.eod if documents is not None and documents.reset_attention_mask else None
        self.documents = documents
        self._kwargs = dict(ffn_hidden_size=m.ffn_size, moe=flops.moe_shape(m, config.moe),
                            mtp_num_layers=flops.mtp_layers(m), **flops.architecture(m))
        self._args = (m.num_layers, m.hidden_size, m.seq_length, vocab, tr.global_batch_size)

    def attention_length(self, iteration: int) -> float | None:
        """sum of l_i² / s per sample over global batch ``iteration`` (from 1); None: whole windows."""
        if self.eod is None:
            return None
        batch, s = self.config.training.global_batch_size, self.config.model.seq_length
        start = (iteration - 1) * batch
        total = sum(squared_lengths(sample_bounds(self.dataset, i, self.documents))
                    for i in range(start, start + batch))
        return total / (batch * s)

    def __call__(self, recompute: bool, attention_length: float | None = None) -> int:
        """``attention_length``: the packed documents' (None: whole windows); sliding-window layers count their
        window (``flops.windowed_attention_length``)."""
        windowed = flops.windowed_attention_length(self.config.model, attention_length)
        return flops.flops_per_iteration(*self._args, recompute=recompute,
                                         attention_length=attention_length if windowed is None else windowed,
                                         **self._kwargs)
