"""ptdp's per-iteration overhead against a plain PyTorch training loop of the same model.

    python benchmarks/overhead.py --json          # one JSON object on stdout
    python benchmarks/overhead.py --iters 8 --repeats 5 --threads 1

The same small GPT (GPT-2 block: pre-LN, fused-qkv linear, SDPA causal, tanh-GeLU MLP, tied embedding;
AdamW with ptdp's decay groups, global-norm clipping, m microbatches of gradient accumulation) is trained
by ``ptdp.train.step.train_step`` at t = p = d = 1 and by :class:`PlainGPT` + a 15-line loop that uses no
ptdp code, in one process, starting from the same weights on the same batches. Repeats alternate between
the two; the result is the median over repeats of the mean iteration time, and their ratio
``time_over_plain_pytorch`` (goal <= 1.03). The losses of the two are compared too, which shows that the
plain loop really is the same computation.

``--llama`` does the same for the Llama-family options (rotary positions, RMSNorm, SwiGLU, grouped-query
attention with ``--groups`` K/V heads, untied output, no biases) against :class:`PlainLlama`, written here
with plain PyTorch as well.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------- plain PyTorch


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output embedding


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, h: int, heads: int, groups: int, ffn: int):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, h // heads
        self.ln1, self.ln2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.d, bias=False)  # per group: its q heads, k, v
        self.proj = nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)  # fc1 = [gate; up]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        g = self.qkv(self.ln1(x)).view(b, s, self.groups, self.heads // self.groups + 2, self.d)
        q = g[:, :, :, :-2].reshape(b, s, self.heads, self.d).transpose(1, 2)
        k, v = g[:, :, :, -2].transpose(1, 2), g[:, :, :, -1].transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.heads // self.groups
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.fc1(self.ln2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, heads: int, layers: int, groups: int, ffn: int,
                 base: float = 10000.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(LlamaBlock(h, heads, groups, ffn) for _ in range(layers))
        self.ln_f = nn.RMSNorm(h, eps=1e-5)
        self.lm_head = nn.Linear(h, vocab, bias=False)  # untied
        d = h // heads
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(seq).float(), inv_freq).repeat(1, 2)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.ln_f(x))


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, microbatches, clip: float) -> float:
    opt.zero_grad(set_to_none=False)
    total = 0.0
    for tokens, labels in microbatches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()) / len(microbatches)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return total


# ---------------------------------------------------------------------------------------------- ptdp


def ptdp_trainer(args):
    from ptdp.config import Config, validate
    from ptdp.train.state import setup

    c = Config()
    m, tr, o = c.model, c.training, c.optimizer
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = args.layers, args.hidden, args.heads, args.seq
    m.hidden_dropout = m.attention_dropout = 0.0
    m.make_vocab_size_divisible_by = 1  # no padded logits: the plain model has the same vocabulary
    if args.llama:
        m.position_embedding_type, m.normalization, m.swiglu = "rope", "RMSNorm", True
        m.group_query_attention, m.num_query_groups = True, args.groups
        m.untie_embeddings_and_output_weights = m.disable_bias_linear = True
    tr.micro_batch_size, tr.global_batch_size = args.micro_batch, args.micro_batch * args.microbatches
    tr.train_iters = 10**6
    o.lr_warmup_iters, o.lr_decay_style = 0, "constant"
    errors = validate(c, 1)
    if errors:
        raise SystemExit("overhead.py: " + errors[0])
    trainer = setup(c)
    for chunk in trainer.chunks:
        chunk.train()
    return trainer


def plain_from(trainer) -> tuple[PlainGPT, torch.optim.Optimizer]:
    """A PlainGPT holding ptdp's initial weights; AdamW with the same decay groups as ptdp's."""
    cfg = trainer.config
    m = cfg.model
    if m.swiglu:
        model = PlainLlama(trainer.chunks[0].vocab_size, m.seq_length, m.hidden_size, m.num_attention_heads,
                           m.num_layers, m.num_query_groups, m.ffn_size)
    else:
        model = PlainGPT(trainer.chunks[0].vocab_size, m.seq_length, m.hidden_size, m.num_attention_heads,
                         m.num_layers)
    src = dict(trainer.chunks[0].named_parameters())
    rename = {"wte.weight": "embedding.word_embeddings.weight", "wpe.weight": "embedding.position_embeddings.weight",
              "ln_f.weight": "final_layernorm.weight", "ln_f.bias": "final_layernorm.bias",
              "lm_head.weight": "lm_head.weight"}
    parts = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "qkv": "attention.qkv",
             "proj": "attention.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("blocks."):
                _, i, part, kind = name.split(".")
                theirs = src[f"layers.{i}.{parts[part]}.{kind}"]
            else:
                theirs = src[rename[name]]
            p.copy_(theirs.reshape(p.shape))
            p.decay = not (name.endswith("bias") or name.startswith("ln") or ".ln" in name)
    o = cfg.optimizer
    decay = [p for p in model.parameters() if p.decay]
    rest = [p for p in model.parameters() if not p.decay]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--llama", action="store_true", help="the Llama-family model (RoPE, RMSNorm, SwiGLU, GQA, "
                        "untied, no biases)")
    parser.add_argument("--groups", type=int, default=2, help="key/value groups with --llama")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ptdp.train.batches import Microbatches
    from ptdp.train.step import train_step

    trainer = ptdp_trainer(args)
    model, opt = plain_from(trainer)
    clip = trainer.config.optimizer.clip_grad
    total_iters = 1 + args.repeats * args.iters
    def microbatches(it: int) -> list:
        source = Microbatches(trainer.data.train, it - 1, trainer.batch_format, trainer.plan.groups, args.microbatches)
        return [(source.inputs(j), source.labels(j)) for j in range(args.microbatches)]

    batches = {it: microbatches(it) for it in range(1, total_iters + 1)}
    losses = {"ptdp": [], "plain": []}
    times = {"ptdp": [], "plain": []}
    cpu = {"ptdp": [], "plain": []}  # process CPU time: steadier than wall time on a shared machine
    # iteration 1 of each is a warm-up (allocations, first AdamW step), not timed
    losses["ptdp"].append(float(train_step(trainer, 1)["loss"]))
    losses["plain"].append(plain_step(model, opt, batches[1], clip))
    for r in range(args.repeats):
        its = range(2 + r * args.iters, 2 + (r + 1) * args.iters)
        order = ("ptdp", "plain") if r % 2 == 0 else ("plain", "ptdp")
        for who in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for it in its:
                if who == "ptdp":
                    losses[who].append(float(train_step(trainer, it)["loss"]))
                else:
                    losses[who].append(plain_step(model, opt, batches[it], clip))
            times[who].append((time.perf_counter() - t0) / args.iters)
            cpu[who].append((time.process_time() - c0) / args.iters)
    ptdp_s, plain_s = statistics.median(times["ptdp"]), statistics.median(times["plain"])
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ptdp"], losses["plain"], strict=True))
    result = {
        "benchmark": "overhead", "time_over_plain_pytorch": ptdp_s / plain_s, "goal": 1.03,
        "ptdp_iteration_s": ptdp_s, "plain_iteration_s": plain_s,
        "ptdp_repeat_s": times["ptdp"], "plain_repeat_s": times["plain"],
        # each repeat pairs two adjacent measurements, so this one is robust to a machine whose load drifts
        "median_paired_ratio": statistics.median(a / b for a, b in zip(times["ptdp"], times["plain"], strict=True)),
        "cpu_time_over_plain_pytorch": statistics.median(cpu["ptdp"]) / statistics.median(cpu["plain"]),
        "ptdp_cpu_iteration_s": statistics.median(cpu["ptdp"]), "plain_cpu_iteration_s": statistics.median(cpu["plain"]),
        "loss_max_rel_diff": diff, "final_loss": losses["ptdp"][-1],
        "model": {"family": "llama" if args.llama else "gpt2", "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
                  "micro_batch": args.micro_batch, "microbatches": args.microbatches,
                  "params": sum(p.numel() for p in model.parameters())},
        "iters": args.iters, "repeats": args.repeats, "threads": args.threads,
        "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"ptdp  {ptdp_s * 1e3:8.1f} ms/iteration   plain PyTorch {plain_s * 1e3:8.1f} ms/iteration   "
          f"ratio {ptdp_s / plain_s:.3f} (goal <= 1.03)   CPU-time ratio {result['cpu_time_over_plain_pytorch']:.3f}   "
          f"loss max rel diff {diff:.1e}")
    if not math.isfinite(diff) or diff > 1e-3:
        print("warning: the losses differ: the two loops do not compute the same thing")


if __name__ == "__main__":
    main()
