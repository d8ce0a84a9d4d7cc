"""One process with ``--optimizer muon`` is ``torch.optim.Muon`` on the hidden matrices plus
``torch.optim.AdamW`` on the rest, on a GPT and on a Llama model (grouped-query attention, SwiGLU, RMSNorm,
untied output): losses, gradient norms and weights over 10 iterations.

ptdp's defaults are Megatron-Core's (quintic coefficients, fp32-normalised bf16 iterations, spectral scale,
no Nesterov); torch's Muon is matched with the options that select its conventions: ``simple`` coefficients,
Nesterov, and its two learning-rate adjustments (``shape_scaling`` = its default ``original``, ``spectral`` x
0.2 = its ``match_rms_adamw``). The reference is written from the model's own layout, independently of
``ptdp.optim.muon_units``: each fused weight is cut into the separate leaf matrices torch's Muon steps.

Precision: torch's Newton–Schulz runs in bf16, where a difference in the last fp32 bit of an input (the two
sides clip with norms summed in another order) flips a bf16 rounding. So the fp32-tolerance comparison runs
ptdp's ``--muon-fp32-matmul-prec high`` against torch's Muon with its iteration in fp32 (its own function with
the one cast changed) over 10 iterations; ``low`` against the unmodified torch.optim.Muon makes the same first
update without clipping (the same gradients to the bit, the same bf16 iteration: ``tests/optim/test_muon.py`` shows
``low`` is torch's to the bit), after which bf16 rounding noise makes the trajectories drift apart as any two
bf16 runs do: a last-bit difference in an input is a whole bf16 step in some element.
"""

from __future__ import annotations

import pytest
import torch
from helpers import validated_config

from ptdp.models import GPTModel
from ptdp.optim import learning_rate
from ptdp.parallel.tensor.cross_entropy import language_model_loss
from ptdp.train.batches import Microbatches
from ptdp.train.state import setup
from ptdp.train.step import train_step

GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10", "--lr", "2e-2",
       "--lr-warmup-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0.5"]
LLAMA = [*GPT, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
TORCH = ["--optimizer", "muon", "--muon-coefficient-type", "simple", "--muon-nesterov"]
ADJUST = {"shape_scaling": (["--muon-scale-mode", "shape_scaling"], None),
          "match_rms_adamw": (["--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2"], "match_rms_adamw")}


def matrices(name: str, weight: torch.Tensor, cfg) -> list[torch.Tensor]:
    """The independent matrices of one hidden weight, as separate ``nn.Linear`` would hold them: index
    tensors into ``weight.view(-1)`` (rows of the fused layouts of ptdp.models.gpt)."""
    flat = torch.arange(weight.numel()).view(weight.shape)
    if name.endswith("attention.qkv.weight") and weight.dim() == 2:  # GQA: per group a/G q heads, k, v
        d, per = cfg.head_dim, cfg.num_attention_heads // cfg.num_query_groups
        groups = flat.view(cfg.num_query_groups, per + 2, d, -1)
        return [groups[:, :per].reshape(-1, weight.shape[-1]), groups[:, per].reshape(-1, weight.shape[-1]),
                groups[:, per + 1].reshape(-1, weight.shape[-1])]
    if weight.dim() == 3:  # [3, a·d, h] q/k/v, [2, f, h] gate/up
        return list(flat.unbind(0))
    return [flat]


def is_hidden_matrix(name: str, weight: torch.Tensor) -> bool:
    return (weight.dim() >= 2 and not name.endswith("bias") and "layernorm" not in name
            and not name.startswith(("embedding.", "lm_head.")))


class TorchReference:
    """The model trained by torch.optim.Muon (leaf matrices cut from the fused weights) + torch.optim.AdamW."""

    def __init__(self, model: GPTModel, config, adjust_lr_fn: str | None):
        self.model, self.config = model, config
        opt = config.optimizer
        self.leaves: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []  # (leaf, weight, index)
        rest_decay, rest_no_decay = [], []
        for name, p in model.named_parameters():
            if is_hidden_matrix(name, p):
                for index in matrices(name, p, config.model):
                    leaf = torch.nn.Parameter(p.detach().view(-1)[index].clone())
                    self.leaves.append((leaf, p, index))
            elif name.endswith("bias") or "layernorm" in name:
                rest_no_decay.append(p)
            else:
                rest_decay.append(p)
        self.muon = torch.optim.Muon([leaf for leaf, _, _ in self.leaves], lr=opt.lr, weight_decay=opt.weight_decay,
                                     momentum=opt.muon_momentum, nesterov=True, adjust_lr_fn=adjust_lr_fn)
        self.adamw = torch.optim.AdamW([{"params": rest_decay, "weight_decay": opt.weight_decay},
                                        {"params": rest_no_decay, "weight_decay": 0.0}],
                                       lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)

    def step(self, batches: Microbatches, lr: float) -> tuple[float, float]:
        model, m = self.model, batches.num_microbatches
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for k in range(m):
            part = language_model_loss(model(batches.inputs(k)), batches.labels(k)) / m
            part.backward()
            loss += part.item()
        clip = self.config.optimizer.clip_grad or float("inf")  # 0: no clipping (ptdp's --clip-grad 0)
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        with torch.no_grad():
            for leaf, p, index in self.leaves:
                leaf.grad = p.grad.view(-1)[index].clone()
        for opt in (self.muon, self.adamw):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        with torch.no_grad():
            for leaf, p, index in self.leaves:
                p.view(-1)[index] = leaf
        return loss, float(norm)


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` with its iteration in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


# precision: (flags, fp32 iteration on torch's side, iterations)
PRECISIONS = {"fp32": (["--muon-fp32-matmul-prec", "high"], True, 10),
              "torch-bf16": (["--muon-fp32-matmul-prec", "low", "--clip-grad", "0"], False, 1)}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("adjust", list(ADJUST))
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_one_process_equals_torch_muon_and_adamw(model, adjust, precision, monkeypatch):
    flags, adjust_lr_fn = ADJUST[adjust]
    prec, fp32, iterations = PRECISIONS[precision]
    if fp32:
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)
    config = validated_config([*(GPT if model == "gpt" else LLAMA), *TORCH, *flags, *prec])
    trainer = setup(config)
    chunk = trainer.chunks[0]
    reference = GPTModel(config.model, chunk.vocab_size, chunk.embedding.word_embeddings.weight.shape[0])
    reference.load_state_dict(chunk.state_dict())
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    torch_side = TorchReference(reference, config, adjust_lr_fn)
    assert torch_side.leaves and len(torch_side.leaves) > len(list(torch_side.adamw.param_groups[0]["params"]))
    for iteration in range(1, iterations + 1):
        record = train_step(trainer, iteration)
        lr = learning_rate(iteration, config.optimizer, config.training.train_iters)
        batches = Microbatches(trainer.data.train, iteration - 1, trainer.batch_format, trainer.plan.groups,
                               trainer.plan.m)
        loss, norm = torch_side.step(batches, lr)
        assert float(record["loss"]) == pytest.approx(loss, rel=1e-5), iteration
        assert float(record["grad_norm"]) == pytest.approx(norm, rel=1e-5), iteration
    trained = dict(chunk.named_parameters())
    for name, want in reference.named_parameters():
        update = (want - initial[name]).norm()
        assert update > 0, name
        assert (trained[name] - want).norm() <= 1e-4 * update, (name, (trained[name] - want).norm() / update)
