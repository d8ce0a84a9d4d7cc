"""DeepSeek-V3 with packed documents: multi-latent attention inside documents.

A packed sample through an imported random Hugging Face ``DeepseekV3ForCausalLM`` (MLA with YaRN and its own
softmax scale, values narrower than the keys) with ``--reset-position-ids --reset-attention-mask`` equals its
documents run one by one through HF; ``ptdp train --model tiny-deepseek`` with the packing flags under tensor,
sequence and context parallelism (ring, all-gather, Ulysses) equals one process. (Multi-token prediction
with the packing flags is refused in one line: tests/models/test_deepseek.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_equivalent, run_layouts, short_documents

from ptdp.data.documents import positions
from ptdp.models.documents import DocumentLayout, equal_widths
from ptdp.ops.document_attention import Dense, PerDocument

PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
# tiny-deepseek without its MTP module (refused with the packing flags, below); e = 2 keeps the MoE layers
BASE = ["--model", "tiny-deepseek", "--mtp-num-layers", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", *PACKED]
PLAN = {
    "one": (1, []),
    "t2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "c2-ring": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "c2-allgather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]),
    "c2-ulysses": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
}


@pytest.mark.parametrize("kernel", [PerDocument(), Dense()], ids=lambda k: k.name)
@pytest.mark.parametrize("dv", [3, 8, 11])
def test_equal_widths_gives_the_scaled_attention_of_narrower_or_wider_values(kernel, dv):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, dv)
    bounds = [(0, 5, 16), (0, 16)]
    layout = DocumentLayout(bounds, None, kernel)
    out = layout.attend(q, k, v, 0.0, scale=0.37)
    for i, cu in enumerate(bounds):
        for a, e in zip(cu[:-1], cu[1:]):
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[i, :, a:e], k[i, :, a:e], v[i, :, a:e], is_causal=True, scale=0.37)
            torch.testing.assert_close(out[i, :, a:e], expected, rtol=1e-5, atol=1e-6)
    assert equal_widths(lambda *x: x, q, k, k, None)[0] is q  # plain heads pass through


transformers = pytest.importorskip("transformers")


def test_a_packed_sample_equals_its_documents_run_one_by_one_through_hf_deepseek_v3(tmp_path):
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from helpers import hf_import
    from test_hf_deepseek import V, hf_model

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 0.8, "mscale_all_dim": 0.9, "beta_fast": 8, "beta_slow": 2}
    hf = hf_model(tmp_path / "hf", rope_parameters=yarn)
    model, _, _ = hf_import(tmp_path, tmp_path / "hf")
    tokens = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(2))
    bounds = (0, 7, 8, 19, 24)  # documents of 7, 1, 11 and 5 tokens
    layout = DocumentLayout([bounds], torch.from_numpy(positions(np.asarray(bounds)))[None].long(), PerDocument())
    with torch.no_grad():
        packed = model(tokens, documents=layout)[..., :V]
        for a, e in zip(bounds[:-1], bounds[1:]):
            torch.testing.assert_close(packed[:, a:e], hf(tokens[:, a:e]).logits, rtol=0, atol=1e-5)
        # control: without the layout the later documents see the earlier ones and other positions
        assert not torch.allclose(model(tokens)[:, 8:19, :V], packed[:, 8:19], atol=1e-3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-packing")
    data = short_documents(root, 300)  # documents of 1 to 12 tokens: a few per 16-token sample
    return run_layouts(root / "runs", {name: (world, [*data, *flags]) for name, (world, flags) in PLAN.items()},
                       base=BASE)


@pytest.mark.parametrize("name", sorted(set(PLAN) - {"one"}))
def test_mla_inside_documents_in_every_layout_equals_one_process(runs, name):
    assert_equivalent(runs[name], runs["one"])

