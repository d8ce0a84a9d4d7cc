"""Megatron-Core on the CPU (gloo) for tests/checkpointing/test_megatron_checkpoint.py, run under torchrun.

Jobs (a JSON list, run in one process start): ``save KIND DIR``: build a tiny Megatron-Core GPTModel (KIND ``gpt``: learned positions, LayerNorm, biased
tanh GeLU, tied embedding; ``llama``: RoPE, RMSNorm, SwiGLU, GQA, no biases, untied) at the world's
(t, p), save it as Megatron-LM does (``DIR/iter_0000010`` in torch_dist with the run's args in
``common.pt``, ``DIR/latest_checkpointed_iteration.txt``) and write its logits on fixed tokens to
``DIR/logits.pt``. ``load KIND DIR OUT``: build the same model, load ``DIR``'s save with Megatron-Core's
``dist_checkpointing.load`` and write its logits to ``OUT``. ``train gpt DIR BATCHES``: the GPT-2 style model
at (t, p) with d = world / (t p), wrapped in Megatron-Core's DistributedDataParallel (gradients reduced
while the backward runs, in buckets of ``BUCKET`` elements) and DistributedOptimizer (Adam), two steps on ptdp's first two global batches (``BATCHES``), a save of model and optimizer at
iteration 2 (``fully_reshardable``, in ``DIR/dp_reshardable`` Megatron-LM's default format and in
``DIR/torch`` the torch format's ``distrib_optim.pt``), then the third step; its loss, gradient norm and weights go to ``DIR/next.pt``.

Its import trimmed (``_import_megatron``: eager fusions, no wandb or tensorboard, no multiprocessing manager
per saving rank): each process of these jobs then costs about half the CPU. Stand-ins, for a CPU-only torch
without triton: the few megatron modules that import triton at module level
(none on the GPT path in megatron-core 0.16; stubbed if they are reached) and the CUDA calls of the
checkpoint writer (``torch.cuda.synchronize``, ``current_device``), the tied embedding's ``.cuda()``, the
RNG tracker's fork and the router's Transformer Engine GEMM; for the distributed optimizer, ``Tensor.type()``
naming CUDA types (it accepts ``torch.cuda.FloatTensor`` parameters only) and its ``device='cuda'`` flags
and buffers made on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import queue
import sys
import types

import torch

TOKENS = torch.tensor([[3, 17, 42, 99, 5, 64, 127, 0, 8, 31, 77, 2, 90, 11, 50, 6],
                       [120, 1, 9, 33, 71, 14, 58, 101, 23, 44, 87, 4, 66, 19, 112, 7]])
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 4, 32, 4, 128, 16
TRITON_MODULES = ("megatron.core.transformer.custom_layers.batch_invariant_kernels",
                  "megatron.core.inference.contexts.fused_kv_append_kernel",
                  "megatron.core.inference.contexts.attention_context.triton.tensor_ops")


def _eager(model=None, **_):
    """``torch.compile`` as Megatron's fusions see it while megatron imports: their functions as written."""
    return model if model is not None else (lambda fn: fn)


def _import_megatron() -> None:
    """Megatron-Core's import without what these jobs never use, about half its CPU time (each of the
    jobs' processes pays it): its fused element-wise functions eager (``jit_fuser`` is ``torch.compile``,
    applied at import, which imports dynamo and inductor), no wandb and no tensorboard (imported if
    present, for logging these jobs do not do). Then the writer's results queue: a sync save fills and
    reads it in the saving process itself, but Megatron makes it a spawned multiprocessing manager's (a
    process importing this script and torch again, on every saving rank), so a plain queue stands in."""
    if importlib.util.find_spec("triton") is None:
        for name in TRITON_MODULES:  # the modules, not triton itself (torch would believe triton exists)
            sys.modules.setdefault(name, types.ModuleType(name))
    for name in ("wandb", "torch.utils.tensorboard"):
        sys.modules.setdefault(name, None)  # an ImportError, which megatron catches
    compile_ = torch.compile
    torch.compile = _eager
    try:
        import megatron.core  # noqa: F401
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    finally:
        torch.compile = compile_
    filesystem_async._get_write_results_queue = queue.Queue


def stand_ins() -> None:
    _import_megatron()
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
        torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embedding's first all-reduce moves it
        plain_type = torch.Tensor.type  # the distributed optimizer accepts 'torch.cuda.FloatTensor' params only

        def cuda_type(self, *a, **k):
            name = plain_type(self, *a, **k)
            return name.replace("torch.", "torch.cuda.", 1) if not a and not k else name

        torch.Tensor.type = cuda_type
        for name in ("tensor", "zeros", "empty", "ones"):  # the optimizer's flags and buffers on device='cuda'
            setattr(torch, name, _on_cpu(getattr(torch, name)))


def _on_cpu(factory):
    def make(*a, device=None, **k):
        return factory(*a, device="cpu" if str(device).startswith("cuda") else device, **k)

    return make


def run_args(kind: str, t: int, p: int) -> argparse.Namespace:
    """The args pretrain_gpt.py would have saved for this model (Megatron-LM's names)."""
    common = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                  max_position_embeddings=SEQ, padded_vocab_size=VOCAB, norm_epsilon=1e-5, kv_channels=HIDDEN // HEADS,
                  tensor_model_parallel_size=t, pipeline_model_parallel_size=p, global_batch_size=8,
                  micro_batch_size=2, train_iters=20, seed=1234, iteration=10, consumed_train_samples=80,
                  hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=128,
                  rotary_percent=1.0, rotary_base=10000, squared_relu=False, apply_layernorm_1p=False)
    if kind == "gpt":
        return argparse.Namespace(**common, ffn_hidden_size=64, normalization="LayerNorm", swiglu=False,
                                  position_embedding_type="learned_absolute", add_bias_linear=True,
                                  bias_gelu_fusion=True, openai_gelu=False, group_query_attention=False,
                                  num_query_groups=None, untie_embeddings_and_output_weights=False)
    llama = dict(common, ffn_hidden_size=48, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                 add_bias_linear=False, group_query_attention=True, num_query_groups=2,
                 untie_embeddings_and_output_weights=True)
    if kind == "moe":  # Llama-style with 4 SwiGLU experts, top-2
        llama.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_grouped_gemm=False,
                     moe_router_load_balancing_type="none")
    return argparse.Namespace(**llama)


def build(kind: str, t: int, p: int, parallel_output: bool = False):
    """The model; ``parallel_output`` for a loss (the vocabulary-parallel cross entropy wants each rank's
    slice of the logits), gathered logits otherwise."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = run_args(kind, t, p)
    common = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=a.ffn_hidden_size,
                  tensor_model_parallel_size=t, pipeline_model_parallel_size=p, use_cpu_initialization=True,
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                  init_method_std=0.2)
    if kind == "gpt":
        cfg = TransformerConfig(**common, bias_activation_fusion=True)
        spec = get_gpt_layer_local_spec()
    else:
        moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_token_dispatcher_type="allgather",
                   moe_router_load_balancing_type="none") if kind == "moe" else {}
        cfg = TransformerConfig(**common, num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
                                activation_func=F.silu, add_bias_linear=False, **moe)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=moe.get("num_moe_experts"))
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(), parallel_output=parallel_output,
                    position_embedding_type=a.position_embedding_type,
                    share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights)


def logits(model, p: int):
    """The full logits on TOKENS (last stage; None elsewhere), the hidden states passed stage to stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    s = TOKENS.shape[1]
    positions = torch.arange(s).expand_as(TOKENS)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    rank, stage = dist.get_rank(), ps.get_pipeline_model_parallel_rank()
    step = dist.get_world_size() // p
    model.eval()  # (MoE with t > 1 refuses to train without sequence parallelism; nothing here trains)
    with torch.no_grad():
        if stage > 0:
            hidden = torch.empty(s, TOKENS.shape[0], HIDDEN)
            dist.recv(hidden, rank - step)
            model.set_input_tensor(hidden)
        out = model(TOKENS, positions, mask)
        if stage < p - 1:
            dist.send(out.contiguous(), rank + step)
            return None
    return out


OPTIM = dict(lr=1e-3, min_lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
BUCKET = 6000  # elements: the gradient buffer of a rank's 21,120 parameters falls into several buckets


def train(model, t: int, p: int, directory: str, batches: str) -> None:
    """Megatron's DDP and distributed optimizer: two Adam steps on the first two global batches of
    ``batches``, a torch_dist save at iteration 2 with the optimizer's state, then a third step; its loss,
    gradient norm and full weights (tensor-parallel pieces joined) go to ``DIR/next.pt``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = torch.load(batches)  # [iterations, global batch, seq + 1]: ptdp's samples
    # what Megatron-LM's training loop sets: without it the schedule never reduces the gradients over the
    # data-parallel ranks (each rank would step on its own micro-batches' gradient)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET), model)
    a = OPTIM
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True,
                                                       **{k: a[k] for k in a if k != "min_lr"}), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=a["lr"], max_lr=a["lr"], min_lr=a["min_lr"],
                                        lr_warmup_steps=0, lr_decay_steps=160, lr_decay_style="constant",
                                        start_wd=a["weight_decay"], end_wd=a["weight_decay"], wd_incr_steps=160,
                                        wd_incr_style="constant")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    s = data.shape[-1] - 1
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    positions = torch.arange(s).expand(2, s)

    def forward_step(iterator, model):
        sample = next(iterator)
        out = model(sample[:, :-1], positions, mask, labels=sample[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    def step(i: int):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        mine = data[i].chunk(dp)[dp_rank]
        micro = list(mine.split(2))
        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro),
                                             model=[ddp], num_microbatches=len(micro), seq_length=s,
                                             micro_batch_size=2, forward_only=False)
        _, norm, _ = optimizer.step()
        scheduler.step(increment=data.shape[1])
        loss = torch.stack([x["loss"] for x in losses]).mean().reshape(1)
        dist.all_reduce(loss)  # mean over the data-parallel ranks (each t rank holds the same)
        return loss.item() / (dist.get_world_size() // p), norm

    step(0)
    step(1)
    save = os.path.join(directory, "iter_0000002")
    os.makedirs(save, exist_ok=True)
    model_state = model.sharded_state_dict()
    args = run_args("gpt", t, p)
    args.__dict__.update(OPTIM, use_distributed_optimizer=True, iteration=2, consumed_train_samples=2 * data.shape[1],
                         lr_decay_style="constant", lr_warmup_iters=0, data_parallel_size=dp, transformer_impl="local",
                         overlap_grad_reduce=True, ddp_bucket_size=BUCKET)
    state = {"model": model_state, "args": args, "iteration": 2, "checkpoint_version": 3.0,
             "optimizer": optimizer.sharded_state_dict(model_state, metadata={
                 "distrib_optim_sharding_type": "fully_reshardable"}),
             "opt_param_scheduler": scheduler.state_dict()}
    dist_checkpointing.save(state, save)
    # the same state in Megatron-LM's default format, laid out by the gradient buckets
    other = os.path.join(directory, "dp_reshardable", "iter_0000002")
    os.makedirs(other, exist_ok=True)
    state["optimizer"] = optimizer.sharded_state_dict(model.sharded_state_dict(), metadata={
        "distrib_optim_sharding_type": "dp_reshardable"})
    state["model"] = model.sharded_state_dict()
    dist_checkpointing.save(state, other)
    # and in the torch format: per model-parallel rank its model, args and param groups, and the buffers
    # gathered on data-parallel rank 0 (distrib_optim.pt)
    legacy = os.path.join(directory, "torch", "iter_0000002", f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
                          + (f"_{ps.get_pipeline_model_parallel_rank():03d}" if p > 1 else ""))
    os.makedirs(legacy, exist_ok=True)
    optimizer.save_parameter_state(os.path.join(legacy, "distrib_optim.pt"))
    if dp_rank == 0:
        torch.save({"model": model.state_dict(), "args": args, "iteration": 2, "checkpoint_version": 3.0,
                    "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict()},
                   os.path.join(legacy, "model_optim_rng.pt"))
    if dist.get_rank() == 0:
        for where in (directory, os.path.dirname(other), os.path.join(directory, "torch")):
            with open(os.path.join(where, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("2")
    loss, norm = step(2)
    weights = {}
    for name, value in model.state_dict().items():
        if "_extra_state" in name or not torch.is_tensor(value):
            continue
        parts = [torch.empty_like(value) for _ in range(t)]
        dist.all_gather(parts, value.contiguous(), group=ps.get_tensor_model_parallel_group())
        weights[name] = parts
    if dist.get_rank() == 0:
        torch.save({"loss": loss, "grad_norm": float(norm), "weights": weights}, os.path.join(directory, "next.pt"))


def run_job(job: dict) -> None:
    """One job: ``mode`` (save, load, train), ``kind``, the layout ``t``, ``p`` (d = world / (t p)), ``dir`` and
    ``out`` (load: the logits file; train: the batches file)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    mode, kind, directory, t, p = job["mode"], job["kind"], job["dir"], job["t"], job["p"]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(t, p)
    # replicated weights equal over t (as Megatron seeds them); a load starts from other weights than the save's
    torch.manual_seed((99 if mode == "load" else 7) + 10 * ps.get_pipeline_model_parallel_rank())
    model = build(kind, t, p, parallel_output=mode == "train")
    if mode == "train":
        train(model, t, p, directory, job["out"])
        dist.barrier()
        return
    if mode == "save":
        save = os.path.join(directory, "iter_0000010")
        os.makedirs(save, exist_ok=True)
        state = {"model": model.sharded_state_dict(), "args": run_args(kind, t, p), "iteration": 10,
                 "checkpoint_version": 3.0}
        dist_checkpointing.save(state, save)
        if dist.get_rank() == 0:
            with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("10")
        out = os.path.join(directory, "logits.pt")
    else:
        torch.serialization.add_safe_globals([argparse.Namespace])
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(directory, "release"))
        model.load_state_dict(loaded["model"])
        out = job["out"]
    result = logits(model, p)
    if result is not None and ps.get_tensor_model_parallel_rank() == 0:
        torch.save(result, out)
    dist.barrier()


def main() -> None:
    """``megatron_script.py JOBS.json``: the jobs in order, in one start of Python, torch and megatron."""
    import json

    stand_ins()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # the router's GEMM names it without Transformer Engine
        moe_utils.te_general_gemm = None
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # no dropout: the CUDA RNG streams are never drawn
    with open(sys.argv[1]) as f:
        for job in json.load(f):
            run_job(job)
    dist.destroy_process_group()


if __name__ == "__main__":  # the checkpoint writer starts a multiprocessing manager: spawned children re-import
    main()
