"""Gradients and the optimizer step (``from ptdp.optim import ...``).

(The gradient buffers and their data-parallel reducers live in ``ptdp.parallel.data``.)
``optimizer``: fp32 / mixed-precision / distributed (ZeRO-1) AdamW; ``grad_scaler``: fp16 loss scaling;
``clip_grads``: the global norm; ``lr_schedule``: Megatron's learning rate; ``setup``: the optimizer over
the data-parallel gradients the parallel side built (``ptdp.parallel.gradients``); ``memory``: model-state
bytes per rank, counted and by formula.
"""

from ptdp.optim.clip_grads import clip_grads, global_grad_norm, global_grad_norm_tensor
from ptdp.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from ptdp.optim.lr_schedule import learning_rate
from ptdp.optim.memory import model_state_bytes, model_state_formula_bytes
from ptdp.optim.optimizer import DistributedOptimizer, FP32Optimizer, MegatronOptimizer, build_optimizer
from ptdp.optim.setup import setup_optimizer

__all__ = [
    "ConstantGradScaler", "DistributedOptimizer", "DynamicGradScaler", "FP32Optimizer",
    "MegatronOptimizer", "build_optimizer", "clip_grads",
    "global_grad_norm", "global_grad_norm_tensor", "learning_rate", "model_state_bytes", "model_state_formula_bytes",
    "setup_optimizer",
]
