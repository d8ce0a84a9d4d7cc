"""DeepSeek-V3-style models in one process: the multi-token prediction loss against a
hand-written reference, the sigmoid router's group-limited choice and the expert-bias update against their
formulas, the flags' one-line refusals, FLOPs and the planner's counts. (Every parallel layout equal to one
process: tests/parallel/test_deepseek_parallel.py; the model against Hugging Face's DeepSeek-V3:
tests/models/test_hf_deepseek.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import refused_in_process

from ptdp.config import Config, ModelConfig, MoEConfig, validate
from ptdp.config.presets import MODEL_PRESETS, MOE_PRESETS
from ptdp.models import GPTModel
from ptdp.models.layers import set_aux_loss_scale
from ptdp.models.moe import TopKRouter, update_expert_biases

V = 100


def tiny(**changes) -> tuple[ModelConfig, MoEConfig]:
    cfg = ModelConfig(**{**MODEL_PRESETS["tiny-deepseek"], "num_layers": 2})
    moe = MoEConfig(**{**MOE_PRESETS["tiny-deepseek"], "moe_layer_freq": "([0]+[1])"})
    return dataclasses.replace(cfg, **changes), moe


def model_of(cfg: ModelConfig, moe: MoEConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    model = GPTModel(cfg, V, 128, moe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "layernorm" in name else torch.randn_like(p) * 0.2)
    return model


def reference_mtp_losses(model: GPTModel, sample: torch.Tensor) -> torch.Tensor:
    """Module k = 1..D from its definition, position by position: at i it embeds t_{i+k} (token 0 past the
    input, as Megatron-Core's rolled ids), and its CE averages over the i whose target t_{i+k+1} exists."""
    b, s = sample.shape[0], sample.shape[1] - 1
    emb, w = model.embedding.word_embeddings.weight, model.output_weight()
    h = model.final_layernorm(model.run_layers(F.embedding(sample[:, :-1], emb)))
    losses = []
    for k, layer in enumerate(model.mtp.layers.values(), start=1):
        tokens = torch.zeros(b, s, dtype=torch.long)
        for i in range(s):
            if i + k <= s - 1:
                tokens[:, i] = sample[:, i + k]
        e = layer.embedding_layernorm(F.embedding(tokens, emb))
        h = layer.final_layernorm(layer.transformer_layer(layer.eh_proj(torch.cat([e, layer.hidden_layernorm(h)], -1))))
        logits = (h @ w.t())[..., :V]
        terms = [F.cross_entropy(logits[j, i], sample[j, i + k + 1]) for j in range(b) for i in range(s - k)]
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_and_gradients_match_a_hand_written_reference(depth):
    cfg, moe = tiny(mtp_num_layers=depth, mtp_loss_scaling_factor=0.3)
    model = model_of(cfg, moe).train()
    sample = torch.randint(0, V, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    x, labels = sample[:, :-1], sample[:, 1:]
    set_aux_loss_scale([model], 1.0)
    logits = model(x, labels=labels)
    main = F.cross_entropy(logits[..., :V].reshape(-1, V), labels.reshape(-1))
    main.backward()  # the MTP loss rides along: its gradient enters through the hidden states
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    got = model.mtp.stats.pop("mtp_losses")

    model.zero_grad()
    want = reference_mtp_losses(model, sample)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the reported LM loss is the main head's only
        torch.testing.assert_close(main, F.cross_entropy(model(x)[..., :V].reshape(-1, V), labels.reshape(-1)))
    (F.cross_entropy(model(x)[..., :V].reshape(-1, V), labels.reshape(-1)) + 0.3 * want.mean()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got_grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0


def test_mtp_is_off_without_labels_and_in_eval():
    cfg, moe = tiny(mtp_num_layers=1)
    model = model_of(cfg, moe)
    x = torch.randint(0, V, (2, cfg.seq_length))
    plain = model(x)
    assert not model.mtp.stats
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x, labels=x), model(x))
    assert not model.mtp.stats and plain.shape == (2, cfg.seq_length, 128)


def reference_route(router: TopKRouter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, Megatron-Core's sigmoid routing: groups ranked by the sum of their top k/g biased scores,
    the best g kept, the top k biased scores among their experts chosen; weights = the unbiased scores of the
    chosen, normalised, times the scaling factor."""
    e, k, groups, g = router.num_experts, router.topk, router.num_groups, router.group_topk
    size = e // groups
    probs, indices = [], []
    for token in x:
        scores = torch.sigmoid(token @ router.weight.t())
        biased = scores + router.expert_bias
        rank = [sorted(biased[j * size:(j + 1) * size].tolist(), reverse=True)[: k // g] for j in range(groups)]
        best = sorted(range(groups), key=lambda j: -sum(rank[j]))[:g]
        allowed = [i for i in range(e) if i // size in best]
        chosen = sorted(allowed, key=lambda i: -biased[i].item())[:k]
        w = scores[chosen] / scores[chosen].sum() * router.scaling_factor
        order = torch.tensor(chosen).argsort()
        indices.append(torch.tensor(chosen)[order])
        probs.append(w[order])
    return torch.stack(probs), torch.stack(indices)


def test_group_limited_sigmoid_router_with_bias_matches_the_formula():
    moe = MoEConfig(num_experts=12, moe_router_topk=4, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
                    moe_router_topk_scaling_factor=2.5)
    torch.manual_seed(0)
    router = TopKRouter(16, moe)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.expert_bias.uniform_(-0.3, 0.3)
    x = torch.randn(40, 16)
    probs, indices, _ = router.eval()(x)
    order = indices.argsort(dim=-1)
    want_probs, want_indices = reference_route(router, x)
    assert torch.equal(indices.gather(1, order), want_indices)
    torch.testing.assert_close(probs.gather(1, order), want_probs)
    # the bias changes the choice, not the weights' formula
    router.expert_bias.zero_()
    assert not torch.equal(router(x)[1].sort(-1).values, want_indices)


def test_expert_bias_update_follows_the_formula():
    moe = MoEConfig(num_experts=6, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    torch.manual_seed(0)
    router = TopKRouter(8, moe)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.05, 0.3, -0.1]))
    start = router.expert_bias.clone()
    for _ in range(3):  # three microbatches of one step
        router(torch.randn(30, 8))
    load = router.tokens_per_expert.clone()
    assert load.sum() == 3 * 30 * 2
    seen = []

    def reduce(counts: torch.Tensor) -> torch.Tensor:  # all layers' counts in one call
        seen.append(counts.clone())
        return counts * 3  # as if three ranks had routed the same tokens: the sign ignores the factor

    update_expert_biases([router], reduce)
    assert torch.equal(seen[0], load.unsqueeze(0))
    want = start + 0.01 * torch.sign(load.double().mean() - load.double()).float()
    assert torch.equal(router.expert_bias, want) and not torch.equal(want, start)
    assert router.tokens_per_expert.sum() == 0  # a new count starts
    router.to(torch.bfloat16)  # --bf16: the weights are cast, the bias stays fp32
    assert router.expert_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16


def test_expert_bias_counts_each_training_forward_once():
    """Training forwards count (a recomputed one does not count again), eval forwards do not."""
    from ptdp.parallel.recompute import checkpoint

    moe = MoEConfig(num_experts=6, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True)
    torch.manual_seed(0)
    router = TopKRouter(8, moe)
    torch.nn.init.normal_(router.weight, std=0.5)
    x, y = torch.randn(30, 8, requires_grad=True), torch.randn(20, 8)
    want = torch.bincount(router(x)[1].flatten(), minlength=6) + torch.bincount(router(y)[1].flatten(), minlength=6)
    router.tokens_per_expert.zero_()
    checkpoint(lambda t: router(t)[0], x).sum().backward()  # forward, then recomputed in the backward
    router(y)
    router.eval()(y)
    assert torch.equal(router.tokens_per_expert, want)


@pytest.mark.parametrize(("changes", "flag"), [
    ({"moe": {"moe_router_score_function": "softmax"}}, "--moe-router-enable-expert-bias"),
    ({"moe": {"moe_router_num_groups": 3}}, "--moe-router-num-groups"),
    ({"moe": {"moe_router_group_topk": 3}}, "--moe-router-group-topk"),
    ({"moe": {"moe_router_topk": 1, "moe_router_group_topk": 2, "moe_router_num_groups": 2}}, "--moe-router-topk"),
    ({"moe": {"moe_router_pre_softmax": True, "moe_router_enable_expert_bias": False}}, "--moe-router-pre-softmax"),
    ({"model": {"qk_pos_emb_head_dim": 3}}, "--qk-pos-emb-head-dim"),
    ({"model": {"group_query_attention": True, "num_query_groups": 2}}, "--multi-latent-attention"),
    ({"model": {"mtp_num_layers": 16}}, "--mtp-num-layers"),
    ({"parallel": {"context_parallel_size": 2, "pipeline_model_parallel_size": 2, "enable_vocab_parallel": True}},
     "--context-parallel-size 2 is not supported"),
    ({"parallel": {"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ett|ttL"}},
     "places 0 MTP modules"),
    ({"parallel": {"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettm|ttL"}},
     "a stage of its own"),
    ({"data": {"reset_position_ids": True}}, "--mtp-num-layers with --reset-position-ids"),
    ({"data": {"reset_attention_mask": True}}, "--mtp-num-layers with --reset-attention-mask"),
    ({"data": {"eod_mask_loss": True}}, "--mtp-num-layers with --eod-mask-loss"),
    ({"parallel": {"pipeline_model_parallel_size": 2, "overlap_moe_expert_parallel_comm": True}},
     "--mtp-num-layers with overlapped forward-backward pairs"),
    ({"parallel": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "dualpipev"}},
     "--mtp-num-layers with overlapped forward-backward pairs"),
])
def test_bad_flag_combinations_are_one_line_each(changes, flag):
    config = Config()
    config.model = ModelConfig(**{**MODEL_PRESETS["tiny-deepseek"], **changes.get("model", {})})
    config.moe = MoEConfig(**{**MOE_PRESETS["tiny-deepseek"], **changes.get("moe", {})})
    for section in ("parallel", "data"):
        for key, value in changes.get(section, {}).items():
            setattr(getattr(config, section), key, value)
    config.training.micro_batch_size, config.training.global_batch_size = 2, 8
    world = config.parallel.context_parallel_size * config.parallel.pipeline_model_parallel_size
    assert not validate(_valid_copy(), 2)
    problems = validate(config, max(world, 2))
    assert len(problems) == 1 and flag in problems[0], problems


def _valid_copy() -> Config:
    config = Config()
    config.model, config.moe = ModelConfig(**MODEL_PRESETS["tiny-deepseek"]), MoEConfig(**MOE_PRESETS["tiny-deepseek"])
    config.training.micro_batch_size, config.training.global_batch_size = 2, 8
    return config


def test_flops_match_torch_flop_counter_and_parameters_the_model():
    """FLOPs of MLA, the sigmoid-routed experts and MTP against torch's FlopCounterMode on the model itself
    (the MTP heads compute all b·s positions, as Megatron-Core's), and the parameter count against the
    model's: DeepSeek-V3's main model is the report's 671B."""
    from torch.utils.flop_counter import FlopCounterMode

    from ptdp.models.flops import architecture, flops_per_iteration, model_parameter_count, moe_shape

    cfg, moe = tiny(mtp_num_layers=2)
    model = model_of(cfg, moe)
    b, s, h = 2, cfg.seq_length, cfg.hidden_size
    x = torch.randint(0, V, (b, s))
    with FlopCounterMode(display=False) as counter:
        model(x, labels=x)
    want = flops_per_iteration(cfg.num_layers, h, s, 128, b, False, cfg.ffn_size, mtp_num_layers=2,
                               moe=moe_shape(cfg, moe), **architecture(cfg)) // 3
    assert counter.get_total_flops() == want
    counted = model_parameter_count(cfg, 128, moe_shape(cfg, moe)) + h  # + the final norm
    assert counted == sum(p.numel() for p in model.parameters())

    v3, v3_moe = ModelConfig(**MODEL_PRESETS["deepseek-v3"]), MoEConfig(**MOE_PRESETS["deepseek-v3"])
    main = model_parameter_count(dataclasses.replace(v3, mtp_num_layers=0), moe=moe_shape(v3, v3_moe)) + v3.hidden_size
    with torch.device("meta"):
        full = GPTModel(v3, v3.vocab_size, v3.vocab_size, v3_moe)
    assert main == sum(p.numel() for n, p in full.named_parameters() if not n.startswith("mtp.")) == 671_026_404_352
    assert model_parameter_count(v3, moe=moe_shape(v3, v3_moe)) + v3.hidden_size == sum(p.numel() for p in full.parameters())


def test_planner_memory_counts_mla_and_the_mtp_modules():
    """The planner's MLA layer on t ranks keeps the down projections and latent norms whole and splits the
    rest; the last pipeline rank holds the MTP modules and their extra logits."""
    from ptdp.planner.memory import layer_parameters_per_rank, parameters_per_rank, rank_memory
    from ptdp.planner.spec import GPTSpec, ParallelConfig

    cfg = ModelConfig(**MODEL_PRESETS["tiny-deepseek"])
    spec = GPTSpec.from_model_config(dataclasses.replace(cfg, vocab_size=V, mtp_num_layers=0))
    with torch.device("meta"):
        layer = GPTModel(dataclasses.replace(cfg, mtp_num_layers=0), V, V).layers["0"]
    total = sum(p.numel() for p in layer.parameters())
    whole = sum(p.numel() for n, p in layer.named_parameters() if "down_proj" in n or "layernorm" in n)
    assert spec.mla_replicated == whole - 2 * cfg.hidden_size  # the layer's own two norms are counted apart
    assert layer_parameters_per_rank(spec, 1) == total
    assert layer_parameters_per_rank(spec, 2) == (total - whole) / 2 + whole

    mtp = dataclasses.replace(spec, mtp_num_layers=2)
    layout = ParallelConfig(1, 2, 1)
    extra = 2 * (total + 2 * cfg.hidden_size ** 2 + 3 * cfg.hidden_size)
    assert parameters_per_rank(mtp, 1, 2, 1, layout) - parameters_per_rank(spec, 1, 2, 1, layout) == extra
    assert parameters_per_rank(mtp, 1, 2, 0, layout) == parameters_per_rank(spec, 1, 2, 0, layout)
    first, last = rank_memory(mtp, layout, 8, "bf16")
    base_first, base_last = rank_memory(spec, layout, 8, "bf16")
    assert first.activations == base_first.activations and last.activations > base_last.activations


def test_a_bad_combination_exits_2_with_one_line(tmp_path, capsys):
    proc = refused_in_process(["train", "--model", "tiny-deepseek", "--train-iters", "1",
                               "--moe-router-score-function", "softmax"], capsys)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "--moe-router-enable-expert-bias" in lines[0], proc.stderr


def test_plan_places_deepseek_v3_on_h800s_with_an_uneven_pipeline():
    """61 layers (a prime) on p = 16: the planner's own balanced layout string, MTP module on the last stage;
    the report's layout (PP 16, EP 64, ZeRO-1, 2,048 H800) is a valid plan that fits with full recomputation."""
    from ptdp.planner.estimate import evaluate
    from ptdp.planner.space import invalid_reason, uneven_layout
    from ptdp.planner.spec import MODEL_PRESETS as SPECS
    from ptdp.planner.spec import ClusterSpec, ParallelConfig, TrainingSpec
    from ptdp.runtime.hardware import accelerator
    from ptdp.schedule.layout import stages_from_string

    h800, h100 = accelerator("h800"), accelerator("h100-80gb")
    assert h800.peak_flops == h100.peak_flops and h800.intra_node_bandwidth < h100.intra_node_bandwidth
    spec = SPECS["deepseek-v3"]
    layout = uneven_layout(spec, 16, None)
    stages = stages_from_string(layout, 61, 16)
    counts = [len(s.layers) for s in stages]
    assert layout.endswith("mL") and max(counts) - min(counts) <= 1 + spec.mtp_num_layers and sum(counts) == 61
    assert uneven_layout(spec, 1, None) is None
    cluster, train = ClusterSpec.of("h800", 2048), TrainingSpec(15360, "bf16")
    report = ParallelConfig(1, 16, 128, recompute_granularity="full", use_distributed_optimizer=True,
                            pipeline_model_parallel_layout=layout, expert_model_parallel_size=64,
                            moe_token_dispatcher_type="alltoall")
    assert invalid_reason(spec, report, cluster, train) is None
    estimate = evaluate(spec, report, cluster, train)
    assert estimate.fits and estimate.memory.total > 20 * 2**30
    overlapped = dataclasses.replace(report, overlap_moe_expert_parallel_comm=True)  # not with MTP yet
    assert "--mtp-num-layers" in invalid_reason(spec, overlapped, cluster, train)
