"""SFT: packed conversations (``ptdp train --sft``) against one padded conversation per sample, tokens/s.

    python benchmarks/sft_packing.py            # 96 conversations of 16..256 tokens, s = 512, h = 64
    python benchmarks/sft_packing.py --json

The same conversations (random ids, the second half of each an assistant answer: content does not change
the cost) are trained for one epoch, in the same process, alternating the two arms ``--repeats`` times:

* **packed**: ``SFTDataset``'s samples (whole conversations packed greedily into ``s + 1`` tokens), attention
  and positions stopping at each conversation (the per-document kernel), as ``ptdp train --sft`` reads them;
* **padded**: one conversation per sample, padded to ``s + 1`` tokens, plain causal attention over the window
  (the usual padded SFT: the padding is computed and carries no loss).

Both go through ptdp's batch assembly (``ptdp.train.batches.Microbatches``), the GPT model and
``stage_loss`` with the SFT loss weights, then ``torch.optim.AdamW``. Printed: the seconds per epoch
(median, wall and CPU), the *useful* tokens/s (conversation tokens, padding excluded; and the loss-carrying
ones) of each arm, and the ratios packed / padded, per wall second and per CPU second -- the only numbers that
mean something on a shared machine (the CPU-time one is the less disturbed by other processes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from ptdp.config import ModelConfig
from ptdp.data.documents import DocumentOptions
from ptdp.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from ptdp.data.sft_dataset import LOSS_MASK_SUFFIX, SFTDataset, SFTOptions
from ptdp.models import GPTModel
from ptdp.ops.document_attention import PerDocument
from ptdp.parallel import ParallelDims, ParallelState
from ptdp.parallel.assembly import stage_loss
from ptdp.parallel.tensor.random import MODEL_PARALLEL_RNG, get_rng_tracker
from ptdp.train.batches import BatchFormat, Microbatches

VOCAB = 512


def write_conversations(prefix: str, count: int, shortest: int, longest: int, seed: int) -> None:
    """``count`` conversations of lengths uniform in [shortest, longest], the second half of each the answer."""
    rng = np.random.default_rng(seed)
    ids, masks = IndexedDatasetWriter(prefix, VOCAB), IndexedDatasetWriter(prefix + LOSS_MASK_SUFFIX, 0, np.uint8)
    for _ in range(count):
        n = int(rng.integers(shortest, longest + 1))
        ids.add_document(rng.integers(1, VOCAB, n))
        masks.add_document(np.arange(n) >= n // 2)
    masks.finalize()
    ids.finalize()


class Padded:
    """One conversation per sample, padded with id 0 to ``s + 1`` tokens: ``SFTDataset``'s sample interface."""

    def __init__(self, packed: SFTDataset) -> None:
        self.packed, self.s = packed, packed.seq_length
        self.documents = list(range(*packed.document_range))

    def __len__(self) -> int:
        return len(self.documents)

    def locate(self, i: int):
        return self, int(i)

    def sft_sample(self, i: int):
        doc = self.documents[i]
        n = int(self.packed.indexed.sequence_lengths[doc])
        tokens, weights = np.zeros(self.s + 1, np.int64), np.zeros(self.s, np.float32)
        tokens[:n] = self.packed.indexed.get(doc, 0, n)
        weights[:n - 1] = self.packed.masks.get(doc, 1, n - 1)
        return tokens, weights, (0, n, self.s) if n < self.s else (0, self.s)


def epoch(model: GPTModel, dataset, fmt: BatchFormat, micro: int) -> tuple[float, float]:
    """(wall, CPU) seconds to train one pass over ``dataset`` (the last, partial global batch dropped)."""
    state = ParallelState(ParallelDims(1, 1, 1, 1), 0, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    m = fmt.global_batch_size // micro
    start, cpu = time.perf_counter(), time.process_time()
    for index in range(len(dataset) // fmt.global_batch_size):
        batches = Microbatches(dataset, index, fmt, state, m)
        batches.begin()
        optimizer.zero_grad()
        for j in range(m):
            out = model(batches.inputs(j), **batches.extras(j))
            (stage_loss(out, batches.labels(j), batches.loss_weights(j)) / m).backward()
        optimizer.step()
    return time.perf_counter() - start, time.process_time() - cpu


def useful(dataset, fmt: BatchFormat) -> tuple[int, int]:
    """(conversation tokens, loss-carrying positions) of the samples one epoch trains."""
    tokens = weights = 0
    for i in range(len(dataset) // fmt.global_batch_size * fmt.global_batch_size):
        _, w, bounds = dataset.sft_sample(i)
        member, k = dataset.locate(i)
        used = sum(n for _, n in member.conversations(k)) if isinstance(member, SFTDataset) else bounds[1]
        tokens, weights = tokens + used, weights + int(w.sum())
    return tokens, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    s = args.seq_length
    with tempfile.TemporaryDirectory() as tmp:
        prefix = f"{tmp}/chat"
        write_conversations(prefix, args.conversations, args.shortest, min(args.longest, s + 1), 0)
        indexed = IndexedDataset(prefix)
        packed = SFTDataset(indexed, (0, indexed.num_documents), s, 1234, None, None, "train", SFTOptions(pad=0))
        padded = Padded(packed)
        gb, mb = args.global_batch_size, args.micro_batch_size
        arms = {"packed": (packed, BatchFormat(gb, mb, DocumentOptions(0, True, True, False, sft=True), PerDocument(),
                                               False)),
                "padded": (padded, BatchFormat(gb, mb, DocumentOptions(0, False, False, False, sft=True), None,
                                               False))}
        tracker = get_rng_tracker()
        if MODEL_PARALLEL_RNG not in tracker.states:
            tracker.add(MODEL_PARALLEL_RNG, 1234)
        torch.manual_seed(0)
        cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
                          seq_length=s, hidden_dropout=0.0, attention_dropout=0.0)
        initial = GPTModel(cfg, VOCAB, VOCAB).state_dict()
        seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for _ in range(args.repeats):
            for name, (dataset, fmt) in arms.items():
                model = GPTModel(cfg, VOCAB, VOCAB)
                model.load_state_dict(initial)
                seconds[name].append(epoch(model, dataset, fmt, mb))
        result = {"conversations": args.conversations, "lengths": [args.shortest, min(args.longest, s + 1)],
                  "seq_length": s, "hidden_size": args.hidden_size, "num_layers": args.num_layers,
                  "threads": args.threads, "repeats": args.repeats}
        for name, (dataset, fmt) in arms.items():
            tokens, loss_tokens = useful(dataset, fmt)
            t = statistics.median(w for w, _ in seconds[name])
            cpu = statistics.median(c for _, c in seconds[name])
            result[name] = {"samples": len(dataset), "epoch_s": round(t, 3), "epoch_cpu_s": round(cpu, 3),
                            "tokens_per_s": round(tokens / t, 1), "tokens_per_cpu_s": round(tokens / cpu, 1),
                            "loss_tokens_per_s": round(loss_tokens / t, 1),
                            "fill": round(tokens / (len(dataset) // gb * gb * (s + 1)), 3)}
        for key in ("tokens_per_s", "tokens_per_cpu_s"):
            result[f"ratio_packed_over_padded_{key}"] = round(result["packed"][key] / result["padded"][key], 3)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
