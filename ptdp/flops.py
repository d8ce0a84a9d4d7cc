"""Model FLOPs and parameter counts of a GPT, exactly as the PTD-P paper counts them.

See ptdp-facts.md, §FLOPs (the paper's Appendix, eq. 3). The trainer calls ``flops_per_iteration`` every
iteration to report TFLOP/s per GPU, so everything here is closed-form integer arithmetic.

Where the paper assumes ``ffn_hidden_size = 4h`` we keep its structure and only replace the MLP term, so
the general formulas reduce *exactly* to eq. (3) when ``ffn = 4h``:

* per layer forward, ``2·(matmul FLOPs)`` per multiply-add:
  QKV projection ``6·B·s·h²`` + attention output projection ``2·B·s·h²`` + MLP ``4·B·s·h·ffn``
  (two GEMMs of ``h × ffn``) + attention scores and weighted values ``4·B·s²·h``.
  With ``ffn = 4h`` that is the paper's ``24·B·s·h² + 4·B·s²·h``.
* logits: ``2·B·s·h·V`` forward.
* a backward pass costs twice its forward; full activation recomputation runs the layers' forward once
  more (the logit layer is not recomputed), hence the factor 4 (= 96/24) or 3 (= 72/24) on layer terms
  and always 3 on the logit term.
"""

from __future__ import annotations


def _ffn(hidden_size: int, ffn_hidden_size: int | None) -> int:
    return 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size


def layer_forward_flops(hidden_size: int, seq_length: int, tokens: int, ffn_hidden_size: int | None = None) -> int:
    """Forward FLOPs of one transformer layer for ``tokens`` = B·s tokens of sequence length s.

    ``(8·h² + 4·h·ffn + 4·s·h)·B·s``; equals the paper's ``24·B·s·h² + 4·B·s²·h`` when ffn = 4h.
    """
    h, f = hidden_size, _ffn(hidden_size, ffn_hidden_size)
    return tokens * (8 * h * h + 4 * h * f + 4 * seq_length * h)


def logit_forward_flops(hidden_size: int, vocab_size: int, tokens: int) -> int:
    """Forward FLOPs of the output (logit) layer: ``2·B·s·h·V``."""
    return 2 * tokens * hidden_size * vocab_size


def flops_per_iteration(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    global_batch_size: int,
    recompute: bool,
    ffn_hidden_size: int | None = None,
) -> int:
    """FLOPs of one training iteration (forward + backward [+ recomputed forward]) over the global batch.

    With ``recompute=True`` (full activation recomputation) and ffn = 4h this is the paper's eq. (3),
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``; without it the layer terms get 72 instead of 96 and the
    logit term stays ``6·B·s·h·V`` (ptdp-facts.md, §FLOPs). Selective recomputation re-runs only the
    attention core; like Megatron we do not count it (pass ``recompute=False``).
    """
    tokens = global_batch_size * seq_length
    layer_passes = 4 if recompute else 3
    layers = num_layers * layer_passes * layer_forward_flops(hidden_size, seq_length, tokens, ffn_hidden_size)
    return layers + 3 * logit_forward_flops(hidden_size, vocab_size, tokens)


def layer_parameter_count(hidden_size: int, ffn_hidden_size: int | None = None) -> int:
    """Parameters of one layer: QKV + projection ``4h² + 4h``, MLP ``2·h·ffn + ffn + h``, 2 LayerNorms ``4h``.

    Equals the paper's ``12h² + 13h`` when ffn = 4h.
    """
    h, f = hidden_size, _ffn(hidden_size, ffn_hidden_size)
    return 4 * h * h + 2 * h * f + f + 9 * h


def parameter_count(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
) -> int:
    """Parameters ``P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` (ptdp-facts.md, §FLOPs).

    Layers plus word embeddings ``V·h`` (tied with the output layer) plus learned positions ``s·h``.
    Like the paper, the final LayerNorm (2h) is not counted.
    """
    return num_layers * layer_parameter_count(hidden_size, ffn_hidden_size) + (vocab_size + seq_length) * hidden_size
