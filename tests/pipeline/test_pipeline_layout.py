"""Megatron-LM's uneven pipeline layouts: the parser against Megatron's own formulas, one-line
errors for layouts that do not add up, and training with them equivalent to one process (losses, gradient
norms, final weights), GPT and Llama, tied and untied, 1f1b and interleaved, with a checkpoint saved
under one layout string continuing identically under another."""

from __future__ import annotations

import itertools

import pytest
from helpers import TINY, assert_equivalent, assert_same_run, refused_in_process, run_layouts

from ptdp.config import Config, ConfigError, validate
from ptdp.config.validate_pipeline import layout_problem, layout_stages
from ptdp.schedule.layout import (
    LayoutError,
    Stage,
    layout_string,
    parse_layout,
    pipeline_stages,
    stages_from_string,
)


# -- Megatron's formulas, transcribed (transformer_block.get_num_layers_to_build, transformer_layer.
# get_transformer_layer_offset), to check ptdp's stages against ---------------------------------------------
def megatron_build(n, p, v, r, j, first=None, last=None, emb=False, loss=False):
    if first is not None or last is not None:
        left, stages = n - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
        per_rank = left // stages if stages else 0
        if r == 0 and first is not None:
            per_rank = first
        if r == p - 1 and last is not None:
            per_rank = last
        return per_rank // v
    build = (n + emb + loss) // p // v
    return build - (emb and r == 0 and j == 0) - (loss and r == p - 1 and j == v - 1)


def megatron_offset(n, p, v, r, j, first=None, last=None, emb=False, loss=False):
    if first is not None or last is not None:
        middle_stages = p - (first is not None) - (last is not None)
        f, k = first or 0, last or 0
        middle = n - f - k
        middle_rank = r if first is None else r - 1
        total = f // v + middle // v + k // v
        per_middle = middle // v // middle_stages if middle_stages else 0  # Megatron divides by 0 here (p=2, v>1)
        return j * total if r == 0 else j * total + f // v + middle_rank * per_middle
    total = n + emb + loss
    per_chunk = total // p // v
    return j * (total // v) + r * per_chunk - (emb and not (r == 0 and j == 0))


@pytest.mark.parametrize("n,p,v,kw", [
    (8, 4, 1, dict(first=1, last=1)), (8, 4, 1, dict(first=2)), (8, 4, 1, dict(last=2)),
    (12, 4, 2, dict(first=2, last=2)), (14, 4, 2, dict(first=2)), (8, 2, 2, dict(first=2, last=6)),
    (7, 3, 1, dict(emb=True, loss=True)), (6, 4, 1, dict(emb=True, loss=True)), (7, 4, 2, dict(loss=True)),
    (11, 3, 2, dict(emb=True)), (8, 2, 2, dict()),
])
def test_first_last_and_account_flags_follow_megatron(n, p, v, kw):
    stages = pipeline_stages(n, p, v, kw.get("first"), kw.get("last"), kw.get("emb", False), kw.get("loss", False))
    assert len(stages) == p * v
    for j, r in itertools.product(range(v), range(p)):
        start, count = megatron_offset(n, p, v, r, j, **kw), megatron_build(n, p, v, r, j, **kw)
        assert stages[j * p + r].layers == tuple(range(start, start + count)), (r, j)
    assert [i for s in stages for i in s.layers] == list(range(n))
    assert stages[0].embedding and stages[-1].loss and not any(s.embedding or s.loss for s in stages[1:-1])


def test_first_last_flags_under_a_v_placement_name_the_pipeline_ranks():
    """zbv / v-half / v-min put stages 0 and 2p-1 on rank 0: the first rank's count goes to both."""
    stages = pipeline_stages(12, 2, 2, first=4, last=8, placement="v")
    assert [len(s.layers) for s in stages] == [2, 4, 4, 2]
    assert [len(s.layers) for s in pipeline_stages(12, 2, 2, first=4, last=8)] == [2, 4, 2, 4]


def test_layout_string_as_megatron_parses_it():
    # Megatron's docstring example (without its m): "Ettt|(tt|)*29,m|L" -> [Ettt] + [tt]*29 + [m] + [L]
    assert parse_layout("Ettt|(tt|)*29,t|L") == ["Ettt"] + ["tt"] * 29 + ["t", "L"]
    assert parse_layout("Et*3|(tt|)*2,tL") == ["Ettt", "tt", "tt", "tL"]
    stages = stages_from_string("Et*3|(tt|)*29,t|L", 62, 16)  # DeepSeek-V3's PP16 VPP2, m as a layer
    assert len(stages) == 32 and stages[0] == Stage((0, 1, 2), embedding=True)
    assert stages[1].layers == (3, 4) and stages[-1] == Stage((), loss=True)
    # stage s is chunk s // p of rank s % p: with p=2 rank 0 holds stages 0 and 2
    assert [len(s.layers) for s in stages_from_string("E|ttt|ttt|ttL", 8, 2)] == [0, 3, 3, 2]
    for stages in (pipeline_stages(8, 4, 2, 2, 2), stages_from_string("E|t*4|t*4|L", 8, 4),
                   pipeline_stages(62, 16, 2, layout="Et*3|(tt|)*29,t|L")):
        assert stages_from_string(layout_string(stages), sum(len(s.layers) for s in stages), 4) == stages


@pytest.mark.parametrize("layout,words", [
    ("Et*3|t*3tL", "places 7 transformer layers"), ("Et*3|t*3|t*2|", "the loss L must appear once"),
    ("tEt*3|t*4L", "the embedding E must appear once"), ("Et*4m|t*4L", "places 1 MTP modules"),
    ("Et*4|x|t*4L", "unknown symbol 'x'"), ("Et*4|t*4|L", "has 3 stages, not a multiple"),
])
def test_bad_layout_strings_are_one_line(layout, words):
    """The configuration names the flag (``ptdp.config.validate_pipeline``); the schedule, which knows no flag,
    refuses the same string in its own words."""
    with pytest.raises(ConfigError, match=r"^--pipeline-model-parallel-layout .*" + words.replace("(", r"\(")):
        layout_stages(8, 2, 2, layout=layout)
    with pytest.raises(LayoutError, match=r"^layout "):
        stages_from_string(layout, 8, 2)


@pytest.mark.parametrize("n,p,v,kw", [
    (8, 4, 1, dict(first=3)), (8, 4, 2, dict(last=3)), (8, 3, 1, dict(first=4, last=4)), (8, 4, 1, dict(emb=True)),
    (9, 4, 1, dict()), (8, 4, 1, dict(first=0)),
])
def test_flags_that_do_not_add_up_never_reach_the_schedule_silently(n, p, v, kw):
    """Every layout the configuration refuses either fails the schedule's own check or computes stages (a
    zero-layer stage, say) that Megatron would refuse too: the schedule never places a layer twice or not at
    all."""
    args = (kw.get("first"), kw.get("last"), kw.get("emb", False), kw.get("loss", False))
    assert layout_problem(n, p, v, *args) is not None
    try:
        stages = pipeline_stages(n, p, v, *args)
    except LayoutError:
        return
    assert [i for s in stages for i in s.layers] == list(range(n)) and len(stages) == p * v


def problems(**parallel) -> list[str]:
    config = Config()
    config.model.num_layers = 8
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    return validate(config, config.parallel.pipeline_model_parallel_size)


def test_validation_names_the_flag_for_every_illegal_combination():
    assert problems(pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Et|ttt|ttt|tL") == []
    assert problems(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|ttt|ttt|ttL") == []
    assert problems(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
                    decoder_last_pipeline_num_layers=2) == []
    [line] = problems(pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Et|ttt|ttt|tL",
                      decoder_first_pipeline_num_layers=1)
    assert line.startswith("--pipeline-model-parallel-layout places every layer itself: drop --decoder-first")
    [line] = problems(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|ttt|ttt|ttL",
                      virtual_pipeline_model_parallel_size=3)
    assert "--virtual-pipeline-model-parallel-size is 3" in line
    [line] = problems(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|ttt|ttt|ttL",
                      num_layers_per_virtual_pipeline_stage=2)
    assert line.endswith("drop --num-layers-per-virtual-pipeline-stage")
    [line] = problems(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
                      account_for_loss_in_pipeline_split=True)
    assert "cannot be combined with --account-for-embedding" in line
    [line] = problems(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3)
    assert line.startswith("--decoder-first-pipeline-num-layers 3 leave 5 layers for 3 middle pipeline ranks")
    [line] = problems(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                      decoder_last_pipeline_num_layers=3)
    assert line.startswith("--decoder-last-pipeline-num-layers 3 must be divisible by the virtual pipeline size 2")
    [line] = problems(pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True)
    assert line.startswith("--account-for-embedding-in-pipeline-split: --num-layers 8 + 1 = 9 must be divisible")


def test_cli_reports_every_layout_problem_at_once_with_exit_2(capsys):
    proc = refused_in_process(["train", *TINY, "--pipeline-model-parallel-size", "2",
                               "--pipeline-model-parallel-layout", "Et*3|ttL", "--global-batch-size", "15",
                               "--nproc-per-node", "2"], capsys)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ptdp train: error")]
    assert len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert any("--pipeline-model-parallel-layout 'Et*3|ttL' places 5 transformer layers (t), but --num-layers is 4"
               in line for line in lines), lines
    assert any("--global-batch-size 15" in line for line in lines), lines


# -- equivalence with one process -------------------------------------------------------------------------
RTOL = 1e-4
EIGHT = [*TINY, "--num-layers", "8", "--lr-decay-iters", "6"]  # 3-iteration runs follow the 6-iteration schedule
LLAMA = [*TINY, "--model", "tiny-llama", "--num-layers", "8", "--lr-decay-iters", "6"]
THREE, SIX = ["--train-iters", "3"], ["--train-iters", "6"]


def pp(p: int, *flags: str, v: int | None = None, schedule: str | None = None) -> list[str]:
    out = ["--pipeline-model-parallel-size", str(p), *flags]
    out += ["--virtual-pipeline-model-parallel-size", str(v)] if v else []
    return out + (["--pipeline-schedule", schedule] if schedule else [])


def plan(ckpt) -> dict[str, tuple[int, list[str], str]]:
    """name: (world size, flags, the reference run it must reproduce)."""
    untied = ["--untie-embeddings-and-output-weights"]
    lay = "--pipeline-model-parallel-layout"
    return {
        "ref3": (1, [*EIGHT, *THREE], ""),
        "ref6": (1, [*EIGHT, *SIX], ""),
        # GPT, tied: a layout string under 1f1b, saved at iteration 3 ...
        "layout_1f1b_save": (4, [*EIGHT, *SIX, *pp(4, lay, "Et|ttt|ttt|tL"), "--save", str(ckpt),
                                 "--exit-interval", "3"], "ref3"),
        # ... and continued under another layout string (and schedule): iterations 4-6 as one process's
        "layout_interleaved_resume": (2, [*EIGHT, *SIX, *pp(2, lay, "E|ttt|ttt|ttL", schedule="interleaved"),
                                          "--load", str(ckpt)], "ref6"),
        "first_last_interleaved": (2, [*EIGHT, *THREE, *pp(2, "--decoder-first-pipeline-num-layers", "2",
                                                            "--decoder-last-pipeline-num-layers", "6", v=2)], "ref3"),
        # the embedding and the loss alone on their stages: the tied copy between two layer-less stages
        "ends_alone_1f1b": (4, [*EIGHT, *THREE, *pp(4, lay, "E|t*4|t*4|L")], "ref3"),
        "account_loss_1f1b": (3, [*EIGHT, *THREE, *pp(3, "--account-for-loss-in-pipeline-split")], "ref3"),
        # GPT, untied
        "untied_ref3": (1, [*EIGHT, *THREE, *untied], ""),
        "untied_layout_interleaved": (2, [*EIGHT, *THREE, *untied, *pp(2, lay, "Et|ttt|ttt|tL")], "untied_ref3"),
        # Llama (untied, RMSNorm, SwiGLU, GQA)
        "llama_ref3": (1, [*LLAMA, *THREE], ""),
        "llama_first_last_1f1b": (4, [*LLAMA, *THREE, *pp(4, "--decoder-first-pipeline-num-layers", "1",
                                                           "--decoder-last-pipeline-num-layers", "3")], "llama_ref3"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    layouts = plan(tmp / "ckpt")
    return run_layouts(tmp, {name: (world, flags) for name, (world, flags, _) in layouts.items()}, base=[])


@pytest.mark.parametrize("name", [name for name, (_, _, ref) in plan("ckpt").items() if ref])
def test_layouts_match_single_process(runs, name):
    reference = runs[plan("ckpt")[name][2]]
    assert reference.losses[0] > reference.losses[-1]  # it trains
    got = runs[name]
    expected_iterations = [4, 5, 6] if name.endswith("resume") else [1, 2, 3]
    assert [r["iteration"] for r in got.records] == expected_iterations
    assert_equivalent(got, reference, RTOL)  # losses and grad norms per iteration, then the final weights


def test_uneven_layouts_really_are_uneven(runs):
    """The runs above are not the even split in disguise: their chunks hold different numbers of layers."""
    for name, (_, flags, ref) in plan("ckpt").items():
        if ref and "--pipeline-model-parallel-layout" in flags:
            text = flags[flags.index("--pipeline-model-parallel-layout") + 1]
            assert len({s.count("t") for s in parse_layout(text)}) > 1, name
    assert_same_run(runs["layout_1f1b_save"], runs["ref6"], RTOL)  # also the first half of the 6-iteration run
