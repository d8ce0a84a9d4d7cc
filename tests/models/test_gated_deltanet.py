"""The gated delta rule and the Gated DeltaNet layer (``ptdp.models.delta_rule``, ``ptdp.models.gated_deltanet``)
in fp64 on random inputs: the chunked form equals the token-by-token recurrence (any chunk size, a sequence
that no chunk divides, an incoming state, grouped heads); a shard's (A, B) summary gives its final state for
any incoming state; with packed documents the layer's state and convolution restart at every document, so a
packed sample equals its documents run one by one (and differs from the unpacked run: the reset bites); the
convolution's ``context`` is the previous tokens' tail; context parallelism's state passing on packed documents
equals one process, layer by layer (fp64) and in ``ptdp train``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.models import delta_rule
from ptdp.models.documents import DocumentLayout
from ptdp.models.gated_deltanet import GatedDeltaNet


def _inputs(b=2, heads=3, s=37, dk=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = delta_rule.l2norm(torch.randn(b, heads, s, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = delta_rule.l2norm(torch.randn(b, heads, s, dk, generator=g, dtype=torch.float64))
    v = torch.randn(b, heads, s, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(b, heads, s, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(b, heads, s, generator=g, dtype=torch.float64)
    state = torch.randn(b, heads, dk, dv, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_equals_the_recurrence_in_fp64(chunk, with_state):
    q, k, v, g, beta, state = _inputs()
    state = state if with_state else None
    want, want_state = delta_rule.recurrent(q, k, v, g, beta, state)
    got, got_state = delta_rule.chunked(q, k, v, g, beta, state, chunk=chunk)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_state, want_state, rtol=1e-10, atol=1e-12)


def test_a_shard_summary_gives_its_final_state_for_any_incoming_state_and_composes():
    """S_out = A·S + B; two halves' summaries composed are the whole sequence's (the state passing of context
    parallelism rests on this)."""
    q, k, v, g, beta, state = _inputs(s=40)
    A, B = delta_rule.summary(delta_rule.prepare(q, k, v, g, beta, chunk=8))
    for incoming in (state, torch.zeros_like(state), 3 * state):
        _, final = delta_rule.recurrent(q, k, v, g, beta, incoming)
        torch.testing.assert_close(A @ incoming + B, final, rtol=1e-10, atol=1e-12)
    first = delta_rule.summary(delta_rule.prepare(*(x[:, :, :16] for x in (q, k, v, g, beta)), chunk=8))
    second = delta_rule.summary(delta_rule.prepare(*(x[:, :, 16:] for x in (q, k, v, g, beta)), chunk=8))
    torch.testing.assert_close(second[0] @ first[0], A, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(second[0] @ first[1] + second[1], B, rtol=1e-10, atol=1e-12)


CFG = ModelConfig(hidden_size=32, norm_epsilon=1e-6, experimental_attention_variant="gated_delta_net",
                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                  linear_num_value_heads=4)


def _layer(rule=delta_rule.chunked) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(CFG).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    layer.rule = rule
    return layer


class _Masks:
    """A stand-in for the document attention kernel: the layer only asks whether the layout masks attention."""


def test_packed_documents_restart_the_state_and_the_convolution():
    s, bounds = 30, [[0, 7, 8, 21, 30], [0, 30]]
    x = torch.randn(2, s, CFG.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    documents = DocumentLayout(bounds=bounds, attention=_Masks())
    chunked = _layer()(x, documents)
    recurrent = _layer(lambda *a, state=None: delta_rule.recurrent(*a, state))(x, documents)
    torch.testing.assert_close(chunked, recurrent, rtol=1e-10, atol=1e-12)
    layer = _layer()
    for i, row in enumerate(bounds):
        for start, end in zip(row[:-1], row[1:]):
            alone = layer(x[i:i + 1, start:end])
            torch.testing.assert_close(chunked[i:i + 1, start:end], alone, rtol=1e-10, atol=1e-12)
    unpacked = layer(x)
    torch.testing.assert_close(unpacked[1], chunked[1], rtol=1e-10, atol=1e-12)  # one document: no reset
    assert not torch.allclose(unpacked[0, 8:], chunked[0, 8:], atol=1e-6)  # the reset bites


def test_grouped_heads_layer_equals_its_token_by_token_recurrence_in_fp64():
    x = torch.randn(2, 19, CFG.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = _layer(lambda *a, state=None: delta_rule.recurrent(*a, state))(x)
    torch.testing.assert_close(_layer()(x), want, rtol=1e-10, atol=1e-12)


def test_the_convolution_context_is_the_previous_tokens_tail():
    layer = _layer()
    x = torch.randn(2, 12, layer.conv1d.weight.shape[0], dtype=torch.float64)
    whole = layer.conv1d(x)
    torch.testing.assert_close(layer.conv1d(x[:, 5:], context=x[:, 2:5]), whole[:, 5:], rtol=0, atol=0)


def test_value_heads_must_be_a_multiple_of_key_heads_and_the_pattern_reads_like_megatron():
    from ptdp.config import Config, validate
    from ptdp.config.validate_linear import linear_attention_layers

    cfg = dataclasses.replace(CFG, num_layers=8, linear_attention_freq="4")
    assert linear_attention_layers(cfg) == [True, True, True, False] * 2
    assert linear_attention_layers(dataclasses.replace(cfg, linear_attention_freq="([1]*3+[0])*2")) == \
        [True, True, True, False] * 2
    assert linear_attention_layers(dataclasses.replace(cfg, linear_attention_freq=None)) == [True] * 8
    config = Config()
    config.model = dataclasses.replace(cfg, linear_num_value_heads=3, linear_attention_freq="[1,0]")
    errors = validate(config, 1)
    assert any(e.startswith("--linear-num-value-heads 3 must be a multiple") for e in errors), errors
    assert any(e.startswith("--linear-attention-freq") for e in errors), errors


def test_presets_count_their_parameters_and_gdn_flops_per_token_do_not_grow_with_s(capsys):
    """The count of ``ptdp.models.flops`` is the built model's (less the norms it never counts: the final norm
    and the full-attention layers' q/k norms); a model of Gated DeltaNet layers only costs the same FLOPs per
    token at every s, one of softmax attention more at longer s; ``ptdp plan`` runs on the published preset."""
    from ptdp.cli.main import main
    from ptdp.config import MoEConfig
    from ptdp.config.presets import MODEL_PRESETS, MOE_PRESETS
    from ptdp.config.validate_linear import linear_attention_layers
    from ptdp.models import GPTModel
    from ptdp.models.flops import architecture, flops_per_iteration, model_parameter_count, moe_shape

    for name in ("tiny-qwen3-next", "qwen3-next-80b-a3b"):
        cfg, moe = ModelConfig(**MODEL_PRESETS[name]), MoEConfig(**MOE_PRESETS[name])
        vocab = cfg.vocab_size or 128
        with torch.device("meta"):
            model = GPTModel(cfg, vocab, vocab, moe)
        full = cfg.num_layers - sum(linear_attention_layers(cfg))
        uncounted = cfg.hidden_size + full * 2 * cfg.head_dim
        assert sum(p.numel() for p in model.parameters()) - uncounted == model_parameter_count(cfg, vocab,
                                                                                               moe_shape(cfg, moe))

    def per_token(cfg: ModelConfig, s: int) -> float:
        return flops_per_iteration(cfg.num_layers, cfg.hidden_size, s, 1000, 1, False, cfg.ffn_size,
                                   **architecture(cfg)) / s

    linear = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-next-80b-a3b"]), linear_attention_freq=None)
    assert per_token(linear, 1024) == per_token(linear, 32768)
    softmax = dataclasses.replace(linear, experimental_attention_variant=None)
    assert per_token(softmax, 32768) > 2 * per_token(softmax, 1024)
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--gpus", "64", "--global-batch-size", "64"]) == 0
    assert "parameters" in capsys.readouterr().out


@pytest.mark.parametrize("overrides,line", [
    ({"seq_length": 8, "linear_conv_kernel_dim": 4}, "--linear-attention-cp-comm-type state_passing needs each"),
    ({"linear_attention_cp_comm_type": "a2a", "linear_num_key_heads": 3, "linear_num_value_heads": 3},
     "--linear-attention-cp-comm-type a2a needs the key heads"),
])
def test_context_parallel_gdn_refuses_what_it_does_not_compute_in_one_line(overrides, line):
    from helpers import config_errors

    from ptdp.config.presets import MODEL_PRESETS

    errors = config_errors(4, **{**MODEL_PRESETS["tiny-qwen3-next"], "context_parallel_size": 4, **overrides})
    assert any(e.startswith(line) for e in errors), errors
    assert all("\n" not in e for e in errors)


# Two packed samples of 32 tokens, chunks of 8 at c = 2 (rank 0: chunks 0 and 3, rank 1: 1 and 2): boundaries
# inside chunks, one exactly at a chunk's start (8), one a token before a chunk (15: the next chunk's
# convolution tail holds two tokens of the earlier document), a chunk with none (sample 1's [16, 24): its
# (A, B) carries the state through), two in one chunk.
CP_BOUNDS = [[0, 3, 9, 10, 15, 26, 32], [0, 8, 30, 32]]


def _state_passing_documents(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from ptdp.parallel.collectives import all_reduce
    from ptdp.parallel.context.linear import StatePassing

    s, n = 32, 8
    x = torch.randn(2, s, CFG.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = torch.randn(2, s, CFG.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    documents = DocumentLayout(bounds=CP_BOUNDS, attention=_Masks())
    mine = torch.cat([torch.arange(rank * n, (rank + 1) * n), torch.arange((3 - rank) * n, (4 - rank) * n)])

    one, whole = _layer(), x.clone().requires_grad_(True)
    want = one(whole, documents)
    (want * weights).sum().backward()
    recurrent = _layer(lambda *a, state=None: delta_rule.recurrent(*a, state))(x, documents)
    torch.testing.assert_close(want, recurrent, rtol=1e-10, atol=1e-12)

    cp, local = _layer(), x[:, mine].clone().requires_grad_(True)
    cp.sequence_mixer = StatePassing(dist.group.WORLD)
    got = cp(local, documents)
    torch.testing.assert_close(got, want[:, mine], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, recurrent[:, mine], rtol=1e-10, atol=1e-12)
    (got * weights[:, mine]).sum().backward()
    torch.testing.assert_close(local.grad, whole.grad[:, mine], rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(cp.named_parameters(), one.parameters()):
        torch.testing.assert_close(all_reduce(p.grad, dist.group.WORLD), q.grad, rtol=1e-10, atol=1e-12, msg=name)
    # the documents bite: the same shards unpacked give another output
    cp.sequence_mixer = StatePassing(dist.group.WORLD)
    assert not torch.allclose(cp(local.detach(), None), got, atol=1e-6)
    torch.save(True, f"{out}.{rank}")


def test_state_passing_with_packed_documents_equals_one_process_and_the_recurrence(tmp_path):
    """c = 2 ``state_passing`` on packed documents (fp64, two gloo ranks): each rank's output, its input's
    gradient and the parameters' gradients summed over the ranks equal one process's document by document run
    (and the token-by-token recurrence's output), boundaries placed at every kind of spot (``CP_BOUNDS``)."""
    from helpers import pooled_spawn

    pooled_spawn(_state_passing_documents, 2, tmp_path, str(tmp_path / "ok"))
    assert all((tmp_path / f"ok.{r}").exists() for r in range(2))


def test_packed_training_with_state_passing_equals_one_process(tmp_path):
    """``ptdp train`` on a corpus of short documents (several per 16-token sample, chunks of 4 tokens at c = 2)
    with the packing flags: c = 2 ``state_passing`` gives one process's losses and gradient norms per
    iteration and its final weights; without the document mask the run differs."""
    from helpers import assert_equivalent, run_layouts, short_documents

    flags = ["--model", "tiny-qwen3-next", "--num-layers", "4", "--micro-batch-size", "2", "--global-batch-size",
             "4", "--train-iters", "3", "--lr", "1e-2", "--lr-warmup-iters", "0", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--log-interval", "1", *short_documents(tmp_path, 200, longest=9),
             "--reset-position-ids", "--eod-mask-loss"]
    packed = [*flags, "--reset-attention-mask"]
    runs = run_layouts(tmp_path / "runs", {
        "one": (1, packed), "unmasked": (1, flags),
        "c2": (2, [*packed, "--context-parallel-size", "2"])}, base=[])
    assert_equivalent(runs["c2"], runs["one"])
    assert abs(runs["one"].records[-1]["loss"] - runs["unmasked"].records[-1]["loss"]) > 1e-4
