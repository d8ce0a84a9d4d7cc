"""The planner's activation count of Gated DeltaNet layers (``ptdp.planner.memory_linear``) against what a layer
really keeps: the bytes of the tensors autograd saves in one bf16 ``GatedDeltaNet`` forward (the rule in fp32),
measured with saved-tensor hooks, each storage once, on shapes whose head widths are below, near and at the
chunk (the chunk's C-wide terms or the per-chunk states dominating); with its core checkpointed as selective
recomputation does, only the core's inputs and output. And through ``ptdp plan``'s per-layer count: a model of
linear layers keeps the same bytes per token at every s, softmax attention more at longer s."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils.checkpoint

from ptdp.config import ModelConfig
from ptdp.config.presets import MODEL_PRESETS
from ptdp.models.flops_linear import linear_shape
from ptdp.models.gated_deltanet import GatedDeltaNet
from ptdp.planner.memory import activation_bytes_per_layer
from ptdp.planner.memory_linear import gdn_bytes_per_token
from ptdp.planner.spec import GPTSpec, ParallelConfig

SHAPES = [dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6),
          dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32),
          dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)]


def _saved_bytes(cfg: ModelConfig, tokens: int, selective: bool) -> int:
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(torch.bfloat16)
    if selective:
        core = layer.core
        layer.core = lambda *a: torch.utils.checkpoint.checkpoint(core, *a, use_reentrant=False)
    x = torch.randn(1, tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(storages.values())


@pytest.mark.parametrize("shape", SHAPES, ids=["narrow", "half-chunk", "chunk-wide"])
@pytest.mark.parametrize("selective", [False, True], ids=["kept", "selective"])
def test_the_count_is_what_a_gated_deltanet_layer_saves(shape, selective):
    cfg = ModelConfig(hidden_size=32, norm_epsilon=1e-6, experimental_attention_variant="gated_delta_net",
                      linear_conv_kernel_dim=4, num_layers=1, linear_attention_freq=None, **shape)
    tokens = 128  # two chunks
    measured = _saved_bytes(cfg, tokens, selective)
    counted = tokens * gdn_bytes_per_token(linear_shape(cfg), selective)
    assert counted == pytest.approx(measured, rel=0.03), (counted, measured)


def test_plan_counts_linear_layers_flat_in_s_and_their_heads_split_over_t():
    cfg = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-next-80b-a3b"]), linear_attention_freq=None)

    def per_token(model: ModelConfig, s: int, t: int = 1) -> float:
        spec = GPTSpec.from_model_config(dataclasses.replace(model, seq_length=s))
        return activation_bytes_per_layer(spec, ParallelConfig(t, 1, 1, micro_batch_size=1)) / s

    assert per_token(cfg, 4096) == per_token(cfg, 65536)
    softmax = dataclasses.replace(cfg, experimental_attention_variant=None)
    assert per_token(softmax, 65536) > 4 * per_token(softmax, 4096)
    # 10·h replicated bytes per token stay whole without sequence parallelism; the rest splits t ways
    h = cfg.hidden_size
    assert per_token(cfg, 4096, 2) - 10 * h == pytest.approx((per_token(cfg, 4096) - 10 * h) / 2)
    mixer = gdn_bytes_per_token(linear_shape(cfg))
    assert mixer > 0 and per_token(cfg, 4096) > mixer
    # the preset's 3 + 1 pattern: per layer the average of three linear layers and one gated softmax one
    mixed = ModelConfig(**MODEL_PRESETS["qwen3-next-80b-a3b"])
    assert softmax.attention_output_gate
    assert per_token(mixed, 4096) == pytest.approx((3 * per_token(cfg, 4096) + per_token(softmax, 4096)) / 4)
    assert per_token(softmax, 4096) != pytest.approx(per_token(cfg, 4096), rel=0.01)
