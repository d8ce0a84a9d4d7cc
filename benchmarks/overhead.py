"""ptdp's per-iteration overhead against a plain PyTorch training loop of the same model.

    python benchmarks/overhead.py --json          # one JSON object on stdout
    python benchmarks/overhead.py --iters 8 --repeats 5 --threads 1

The same small GPT (GPT-2 block: pre-LN, fused-qkv linear, SDPA causal, GeLU MLP, tied embedding;
AdamW with ptdp's decay groups, global-norm clipping, m microbatches of gradient accumulation) is trained
by ``ptdp.train.step.train_step`` at t = p = d = 1 and by :class:`PlainGPT` + a 15-line loop that uses no
ptdp code, in one process, starting from the same weights on the same batches. Repeats alternate between
the two; the result is the median over repeats of the mean iteration time, and their ratio
``time_over_plain_pytorch`` (goal <= 1.03). The losses of the two are compared too, which shows that the
plain loop really is the same computation.

``--llama`` does the same for the Llama-family options (rotary positions, RMSNorm, SwiGLU, grouped-query
attention with ``--groups`` K/V heads, untied output, no biases) against :class:`PlainLlama`, written here
with plain PyTorch as well.

``--nanogpt`` is nanoGPT's CPU recipe (4 layers, h = 128, 4 heads, s = 64, b = 12, no biases, one
microbatch; the exact GeLU, nanoGPT's ``nn.GELU()`` and ptdp's without biases; ``--openai-gelu``: the tanh
one on both sides) with every iteration logged on both sides: ptdp's whole training loop (``ptdp.train.loop.train``:
the step, the metrics record with its memory and straggler report, the progress line, the checkpoint and
signal checks) against a nanoGPT-style loop (:func:`nanogpt_iteration`: get_batch, forward, backward, clip,
AdamW, ``zero_grad(set_to_none=True)``, ``loss.item()``, a log line). The plain iteration runs inside ptdp's
loop, right before each ``train_step``, so the two alternate every iteration; each side's time is the
process CPU time (and wall time) from one of its iterations to the next (goal <= 1.00).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------- plain PyTorch


class Block(nn.Module):
    def __init__(self, h: int, heads: int, bias: bool = True, approximate: str = "tanh"):
        super().__init__()
        self.heads, self.approximate = heads, approximate
        self.ln1, self.ln2 = nn.LayerNorm(h, bias=bias), nn.LayerNorm(h, bias=bias)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=bias), nn.Linear(h, h, bias=bias)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h, bias=bias), nn.Linear(4 * h, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, heads: int, layers: int, bias: bool = True,
                 approximate: str = "tanh"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, bias, approximate) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h, bias=bias)

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


class NanoGPTLoop:
    """nanoGPT's train.py loop body on the CPU (no DDP, no GradScaler, no evaluation), one iteration per call:
    the learning rate set, ``get_batch`` (``b`` samples stacked into one tensor; here the samples of ptdp's
    dataset at the same positions, so both sides see the same data), the forward and loss, the backward, the
    clip, the step, ``zero_grad(set_to_none=True)``, and the log: ``loss.item()``, the iteration time, the
    MFU estimate (its parameter count), one line to ``out``."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, data, batch: int, clip: float, lr: float, out):
        self.model, self.opt, self.data, self.batch, self.clip, self.lr, self.out = model, opt, data, batch, clip, lr, out
        self.t0 = time.time()

    def get_batch(self, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (it - 1) * self.batch
        sample = torch.from_numpy(np.stack([self.data[i] for i in range(start, start + self.batch)]))
        return sample[:, :-1], sample[:, 1:]

    def __call__(self, it: int) -> float:
        for group in self.opt.param_groups:
            group["lr"] = self.lr  # nanoGPT's get_lr(it): a constant schedule here, as ptdp's
        x, y = self.get_batch(it)
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, self.t0 = t1 - self.t0, t1
        lossf = loss.item()
        n_params = sum(p.numel() for p in self.model.parameters())  # nanoGPT's estimate_mfu
        print(f"iter {it}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, params {n_params}", file=self.out)
        return lossf


# ---------------------------------------------------------------------------------------------- ptdp


def ptdp_config(args):
    from ptdp.config import Config, validate

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
    if args.nanogpt:  # nanoGPT's bias=False: no bias in the linears nor the LayerNorms
        m.disable_bias_linear = m.disable_bias_norm = True  # and so the exact GeLU, nanoGPT's nn.GELU()
        m.openai_gelu = args.openai_gelu
        tr.train_iters, tr.log_interval = 2 + args.iters * args.repeats, 1
    errors = validate(c, 1)
    if errors:
        raise SystemExit("overhead.py: " + errors[0])
    return c


def ptdp_trainer(args):
    from ptdp.train.state import setup

    with contextlib.redirect_stdout(sys.stderr):  # the start-up's announcements: stdout is the JSON's
        trainer = setup(ptdp_config(args))
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
                         m.num_layers, bias=m.add_bias_linear, approximate=m.gelu_approximate)
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


def step_comparison(args) -> tuple[dict, dict, dict, nn.Module]:
    """``train_step`` against :func:`plain_step`, alternating blocks of ``--iters`` iterations: (losses, wall
    and CPU seconds per iteration of each block) per side, and the plain model."""
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
    return losses, times, cpu, model


def nanogpt_comparison(args) -> tuple[dict, dict, dict, nn.Module]:
    """ptdp's training loop against :class:`NanoGPTLoop`, alternating every iteration (module docstring):
    the plain iteration runs in place of the loop's call of ``train_step``, before it. Returns what
    :func:`step_comparison` does, each block the mean of ``--iters`` consecutive iterations."""
    import ptdp.train.loop as loop
    import ptdp.train.steppers as steppers  # the loop's plain stepper calls its train_step

    config = ptdp_config(args)
    real_step = steppers.train_step
    plain: list[NanoGPTLoop] = []
    losses = {"ptdp": [], "plain": []}
    seconds = {"ptdp": [], "plain": []}  # (wall, CPU) per iteration
    mark: list[tuple[float, float]] = []  # when ptdp's current iteration began (the plain one's end)
    last = config.training.train_iters

    def alternate(trainer, iteration: int) -> dict:
        begin = (time.perf_counter(), time.process_time())
        if mark and iteration > 2:  # ptdp's iteration before this one, its logging included (1: warm-up)
            seconds["ptdp"].append((begin[0] - mark[0][0], begin[1] - mark[0][1]))
        if not plain:  # ptdp's initial weights, before its first step
            model, opt = plain_from(trainer)
            plain.append(NanoGPTLoop(model, opt, trainer.data.train, args.micro_batch,
                                     trainer.config.optimizer.clip_grad, trainer.config.optimizer.lr, sys.stdout))
        losses["plain"].append(plain[0](iteration))
        mark[:] = [(time.perf_counter(), time.process_time())]
        if 1 < iteration < last:  # the same iterations on both sides (ptdp's last one is not timed)
            seconds["plain"].append((mark[0][0] - begin[0], mark[0][1] - begin[1]))
        return real_step(trainer, iteration)

    steppers.train_step = alternate
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # both sides' log lines
            metrics = loop.train(config)
    finally:
        steppers.train_step = real_step
    losses["ptdp"] = [r["loss"] for r in metrics]
    n = args.iters
    times, cpu = {}, {}
    for who, pairs in seconds.items():
        blocks = [pairs[i:i + n] for i in range(0, len(pairs), n)]
        times[who] = [statistics.mean(w for w, _ in b) for b in blocks]
        cpu[who] = [statistics.mean(c for _, c in b) for b in blocks]
    return losses, times, cpu, plain[0].model


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
    parser.add_argument("--nanogpt", action="store_true", help="nanoGPT's CPU recipe, ptdp's whole training loop "
                        "against a nanoGPT-style loop, every iteration logged (sets the sizes)")
    parser.add_argument("--openai-gelu", action="store_true", help="with --nanogpt: the tanh GeLU on both sides "
                        "(ptdp's only GeLU before the exact one; nanoGPT's is exact)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.nanogpt and args.llama:
        parser.error("--nanogpt is the GPT-2 model (nanoGPT's); drop --llama")
    if args.nanogpt:  # nanoGPT's config/train_shakespeare_char.py as its README runs it on a CPU
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.microbatches = 4, 128, 4, 64, 12, 1

    losses, times, cpu, model = (nanogpt_comparison if args.nanogpt else step_comparison)(args)
    goal = 1.00 if args.nanogpt else 1.03
    ptdp_s, plain_s = statistics.median(times["ptdp"]), statistics.median(times["plain"])
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ptdp"], losses["plain"]))
    result = {
        "benchmark": "overhead", "mode": "nanogpt_loop" if args.nanogpt else "train_step",
        "time_over_plain_pytorch": ptdp_s / plain_s, "goal": goal,
        "ptdp_iteration_s": ptdp_s, "plain_iteration_s": plain_s,
        "ptdp_repeat_s": times["ptdp"], "plain_repeat_s": times["plain"],
        # each repeat pairs two adjacent measurements, so this one is robust to a machine whose load drifts
        "median_paired_ratio": statistics.median(a / b for a, b in zip(times["ptdp"], times["plain"], strict=True)),
        "cpu_time_over_plain_pytorch": statistics.median(cpu["ptdp"]) / statistics.median(cpu["plain"]),
        "median_paired_cpu_ratio": statistics.median(a / b for a, b in zip(cpu["ptdp"], cpu["plain"], strict=True)),
        "ptdp_cpu_iteration_s": statistics.median(cpu["ptdp"]), "plain_cpu_iteration_s": statistics.median(cpu["plain"]),
        "loss_max_rel_diff": diff, "final_loss": losses["ptdp"][-1],
        "model": {"family": "llama" if args.llama else "gpt2", "openai_gelu": args.openai_gelu, "layers": args.layers, "hidden": args.hidden,
                  "heads": args.heads, "seq": args.seq, "micro_batch": args.micro_batch,
                  "microbatches": args.microbatches, "params": sum(p.numel() for p in model.parameters())},
        "iters": args.iters, "repeats": args.repeats, "threads": args.threads, "load_average": os.getloadavg(),
        "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"ptdp  {ptdp_s * 1e3:8.1f} ms/iteration   plain PyTorch {plain_s * 1e3:8.1f} ms/iteration   "
          f"ratio {ptdp_s / plain_s:.3f} (goal <= {goal:.2f})   CPU-time ratio "
          f"{result['cpu_time_over_plain_pytorch']:.3f}   loss max rel diff {diff:.1e}")
    if not math.isfinite(diff) or diff > 1e-3:
        print("warning: the losses differ: the two loops do not compute the same thing")


if __name__ == "__main__":
    main()
