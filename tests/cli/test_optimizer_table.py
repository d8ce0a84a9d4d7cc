"""The optimizer table (``ptdp.config.optimizers``) is the one place an ``--optimizer`` is declared: the flag's
choices are its names, the update rules are its entries, what a rule holds after a step is what its spec
declares (and what the start-up line announced), the flags a rule reads are the ones its spec lists, and an
optimizer added as one entry plus its step function trains and keeps only the state it declares -- no
Adam moments by default."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import TINY, validated_config

from ptdp.config import OptimizerConfig
from ptdp.config.optimizers import (
    ALIASES,
    CHOICES,
    REGISTRY,
    SHARED_FLAGS,
    STATE_FIELD_BYTES,
    OptimizerSpec,
    canonical_name,
    optimizer_spec,
)
from ptdp.optim import kinds
from ptdp.planner.memory import memory_per_gpu
from ptdp.planner.spec import GPTSpec, ParallelConfig
from ptdp.train.state import setup
from ptdp.train.step import train_step

ONE_STEP = [*TINY, "--train-iters", "1", "--global-batch-size", "2"]
OPTIMIZER_FIELDS = {f.name: f for f in dataclasses.fields(OptimizerConfig)}


def test_the_optimizer_choices_are_the_tables_names_and_aliases():
    """``--optimizer`` (ptdp train's and ptdp plan's, one field) accepts exactly the table's names and their
    aliases, and every name has a step function, every step function a name."""
    assert OPTIMIZER_FIELDS["optimizer"].metadata["argparse"]["choices"] == CHOICES == [*REGISTRY, *ALIASES]
    assert set(kinds.OPTIMIZERS) == set(REGISTRY)
    assert all(canonical_name(alias) in REGISTRY for alias in ALIASES)
    assert OptimizerConfig(optimizer="dist_muon").kind == "muon" and optimizer_spec("dist_muon") is REGISTRY["muon"]
    with pytest.raises(ValueError, match="choose one of adam, sgd, muon"):
        optimizer_spec("lion")


def test_every_rule_flag_is_declared_by_a_spec():
    """Each spec's flags are ``OptimizerConfig`` fields, and every rule's own flag (``--adam-*``, ``--sgd-*``,
    ``--muon-*``) is some spec's: a new optimizer's flags are part of its entry."""
    for spec in REGISTRY.values():
        assert set(spec.flags) <= set(OPTIMIZER_FIELDS), spec.name
        assert spec.name in OPTIMIZER_FIELDS["optimizer"].metadata["help"]
    declared = {flag for spec in REGISTRY.values() for flag in spec.flags}
    assert {f for f in OPTIMIZER_FIELDS if f.startswith(("adam_", "sgd_", "muon_"))} <= declared
    assert set(SHARED_FLAGS) <= set(OPTIMIZER_FIELDS)


class _Recording:
    """An ``OptimizerConfig`` that notes every field a rule reads."""

    def __init__(self, cfg: OptimizerConfig):
        self._cfg, self.read = cfg, set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._cfg, name)


def _held(state: dict) -> set[str]:
    """The per-element fields of one tensor's torch state (not its step count)."""
    return {k for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}


CASES = {**{name: ["--optimizer", name] for name in REGISTRY},
         "sgd without momentum": ["--optimizer", "sgd", "--sgd-momentum", "0"]}


@pytest.mark.parametrize("case", list(CASES))
def test_each_spec_declares_what_its_optimizer_holds_after_a_step(case):
    """On a tiny GPT in one process: after one training step each parameter's torch state holds exactly
    ``state_fields`` (what checkpoints save), the fields over all parameters are the spec's (Muon: its momentum
    on the hidden matrices, Adam's moments on the rest), the bytes announced before the step are the bytes
    allocated by it, and the flags the rule reads beyond the shared ones are exactly its spec's."""
    config = validated_config([*ONE_STEP, *CASES[case]])
    spec = optimizer_spec(config.optimizer.kind)
    trainer = setup(config)
    optimizer = trainer.optimizer
    announced = optimizer.pending_state_bytes()
    train_step(trainer, 1)
    state = optimizer.state
    seen, allocated = set(), 0
    for param in optimizer.params:
        held = _held(state.get(param, {}))
        assert held == set(optimizer.state_fields(param)), (case, param.shape)
        seen |= held
        allocated += sum(state[param][k].numel() * state[param][k].element_size() for k in held)
    want = set() if spec.stateless_without and not getattr(config.optimizer, spec.stateless_without) else \
        set(spec.state_fields) | set(spec.matrix_fields or ())
    assert seen == want
    assert announced == allocated == STATE_FIELD_BYTES * sum(
        p.numel() * len(optimizer.state_fields(p)) for p in optimizer.params)

    recording = _Recording(config.optimizer)  # the same rule again, its reads noted through one step
    tensors = [kinds.Stepped(p.detach().clone(), p) for p in optimizer.params]
    for s in tensors:
        s.tensor.grad = torch.ones_like(s.tensor)
    kinds.build(tensors, recording, optimizer.placements).step()
    assert recording.read - {"kind", *SHARED_FLAGS} == set(spec.flags), recording.read


def _plain(stepped, cfg, placements, layout):
    """A rule keeping no state: plain gradient descent."""
    return torch.optim.SGD([s.tensor for s in stepped], lr=cfg.lr)


def test_a_new_optimizer_is_one_entry_plus_its_step_function_and_gets_no_adam_state(monkeypatch):
    """An optimizer added as a table entry that declares no state and its step function: checkpoints save
    nothing for it, it trains a step, and the planner charges it no state (fp32 without ZeRO: 8 bytes per
    parameter against AdamW's 16)."""
    monkeypatch.setitem(REGISTRY, "plain", OptimizerSpec("plain", "gradient descent", "nothing", ()))
    monkeypatch.setitem(kinds.OPTIMIZERS, "plain", _plain)
    config = validated_config(ONE_STEP)
    config.optimizer.optimizer = "plain"  # past the parser, whose choices were read at import
    trainer = setup(config)
    assert trainer.optimizer.pending_state_bytes() == 0
    assert all(trainer.optimizer.state_fields(p) == () for p in trainer.optimizer.params)
    before = [p.detach().clone() for p in trainer.optimizer.params]
    train_step(trainer, 1)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.optimizer.params, strict=True))
    assert all(not _held(s) for s in trainer.optimizer.state.values())

    model = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    layout = ParallelConfig(1, 1, 1)
    adam, plain = (memory_per_gpu(model, layout, 8, "fp32", name).model_states for name in ("adam", "plain"))
    assert adam == 2 * plain


@pytest.mark.parametrize(("saved", "runs", "refused"), [
    ("dist_muon", "muon", False), ("muon", "dist_muon", False), ("adam", "muon", True), ("sgd", "adam", True)])
def test_a_checkpoint_of_an_alias_is_its_optimizers_state(saved, runs, refused):
    """The checkpoint's optimizer check compares the table's names: Megatron-LM's ``dist_muon`` saved is
    Muon's state; another optimizer's state is one line naming both."""
    from ptdp.checkpointing.validation import optimizer_mismatch
    from ptdp.config import Config

    config = Config(optimizer=OptimizerConfig(optimizer=runs))
    info = {"contents": ["optimizer"], "config": {"optimizer": {"optimizer": saved}}}
    line = optimizer_mismatch(info, config)
    assert (line is not None) == refused
    assert not refused or f"--optimizer {saved}'s state" in line
