"""``--max-position-embeddings`` apart from ``--seq-length`` (Megatron-LM's two flags): a checkpoint records
the positions its model was built for, and a run trains at any ``--seq-length`` up to them. Only a learned
position table makes the number a shape; checkpoints from before the flag count their ``--seq-length``."""

from __future__ import annotations

import dataclasses

from helpers import validated_config

from ptdp.checkpointing.validation import model_mismatch, model_shape
from ptdp.config import ModelConfig, validate
from ptdp.config.presets import MODEL_PRESETS

ROPE = ModelConfig(**{k: v for k, v in MODEL_PRESETS["tiny-llama"].items()})
LEARNED = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4)


def _saved(model: ModelConfig, **changes) -> dict:
    shape = model_shape(dataclasses.replace(model, **changes), 300, 384)
    return shape


def test_a_rotary_checkpoint_trains_at_a_shorter_sequence():
    saved = _saved(ROPE, seq_length=4096, max_position_embeddings=4096)
    assert model_mismatch(saved, dataclasses.replace(ROPE, seq_length=32), 300, 1) is None


def test_a_learned_table_is_a_shape_named_by_the_flag_that_sized_it():
    saved = _saved(LEARNED, seq_length=32, max_position_embeddings=64)
    assert model_mismatch(saved, dataclasses.replace(LEARNED, seq_length=16, max_position_embeddings=64), 300, 1) is None
    problem = model_mismatch(saved, dataclasses.replace(LEARNED, seq_length=16), 300, 1)
    assert "--max-position-embeddings 64 there, 16 here" in problem


def test_checkpoints_from_before_the_flag_count_their_sequence_length():
    saved = _saved(LEARNED, seq_length=16)
    saved.pop("max_position_embeddings")  # written before the field existed
    assert model_mismatch(saved, dataclasses.replace(LEARNED, seq_length=16), 300, 1) is None
    assert "--seq-length 16 there, 32 here" in model_mismatch(saved, dataclasses.replace(LEARNED, seq_length=32), 300, 1)
    assert model_mismatch(saved, dataclasses.replace(LEARNED, seq_length=8, max_position_embeddings=16), 300, 1) is None


def test_a_sequence_longer_than_the_positions_is_refused_in_one_line():
    config = validated_config(["--seq-length", "16", "--max-position-embeddings", "64"])
    config.model = dataclasses.replace(config.model, seq_length=128)
    problems = validate(config, 1)
    assert problems == ["--seq-length 128 is longer than --max-position-embeddings 64, the longest sequence the "
                        "model is built for"]
