"""Every ``--optimizer``, declared once: its name, the state it keeps, the bytes the planner charges, its flags.

The ``--optimizer`` choices and help (``ptdp.config.schema.OptimizerConfig``), what a checkpoint holds per
parameter and the memory counted at start-up (``ptdp.optim.kinds``), the exchange Muon's step needs
(``ptdp.optim.setup``), the checkpoint's optimizer check (``ptdp.checkpointing.validation``) and the planner's
memory, bound, time and explanation (``ptdp.planner``) all read :data:`REGISTRY`. A new optimizer is one
:class:`OptimizerSpec` entry here plus its step function in ``ptdp.optim.kinds.OPTIMIZERS`` (docs/optimizers.md,
"Adding an optimizer"); the schedules' ``ptdp.schedule.registry`` is the same shape.

Plain names and numbers, no torch: the flag parser and ``ptdp plan`` read it without loading torch, which is
why it lives in the configuration layer (the lowest layer that owns flags) rather than beside the update rules.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every state field is one fp32 tensor shaped like its parameter (or the rank's piece of it), in every precision
# (16-bit runs step fp32 main parameters): 4 bytes per parameter each, what the planner charges and what
# ``ptdp.optim.kinds.pending_state_bytes`` announces.
STATE_FIELD_BYTES = 4

ADAM_FIELDS = ("exp_avg", "exp_avg_sq")  # torch's AdamW: the two moments
MOMENTUM_FIELDS = ("momentum_buffer",)  # torch's SGD and ptdp's Muon: one momentum
ADAM_FLAGS = ("adam_beta1", "adam_beta2", "adam_eps")
MUON_FLAGS = ("muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_scale_mode", "muon_extra_scale_factor",
              "muon_num_ns_steps", "muon_coefficient_type", "muon_fp32_matmul_prec")
# What every rule reads, so no spec lists it: the learning rate (set per step), the decay groups' weight decay,
# the host offload, and the choice itself.
SHARED_FLAGS = ("lr", "weight_decay", "optimizer_cpu_offload", "optimizer")


@dataclass(frozen=True)
class OptimizerSpec:
    """One ``--optimizer``.

    ``state_fields``: the per-element fp32 state it keeps for a parameter it steps -- what a checkpoint stores
    as ``optimizer.<name>.<field>`` beside ``step``. It has no default, so that a new rule states its own (an
    empty tuple when it keeps none) instead of inheriting Adam's moments. ``matrix_fields``: when the hidden
    matrices (``ptdp.optim.muon_units.is_hidden_matrix``) are stepped by a rule of their own -- Muon, with
    AdamW on the rest -- their state; None when one rule steps every parameter. ``stateless_without``: the
    ``OptimizerConfig`` field whose zero means no state at all (SGD without ``--sgd-momentum``); the planner,
    which has no such flag, charges the state. ``flags``: the ``OptimizerConfig`` fields of its own it reads
    (beyond :data:`SHARED_FLAGS`). ``aliases``: Megatron-LM's other names for it, which ``--optimizer`` takes
    too (``dist_muon``). ``exchanges_matrices``: its step orthogonalises each whole hidden matrix on one rank of
    its grid (``ptdp.optim.muon_exchange``), so the run builds that exchange's layout and the planner charges
    its transient buffers and its time. ``help``: the ``--optimizer`` help's words; ``words``: what the
    planner's memory line calls the state.
    """

    name: str
    help: str
    words: str
    state_fields: tuple[str, ...]
    flags: tuple[str, ...] = ()
    matrix_fields: tuple[str, ...] | None = None
    stateless_without: str | None = None
    aliases: tuple[str, ...] = ()
    exchanges_matrices: bool = False

    def fields(self, cfg: object, hidden_matrix: bool = False) -> tuple[str, ...]:
        """The state kept for one parameter under ``cfg`` (an ``OptimizerConfig``: only its
        ``stateless_without`` field is read); ``hidden_matrix``: whether the parameter is a hidden matrix
        (asked only of a spec with ``matrix_fields``)."""
        if self.stateless_without is not None and not getattr(cfg, self.stateless_without):
            return ()
        if hidden_matrix and self.matrix_fields is not None:
            return self.matrix_fields
        return self.state_fields

    @property
    def matrices_apart(self) -> bool:
        """Whether the hidden matrices keep another state than the rest (the planner then counts them apart)."""
        return self.matrix_fields is not None

    @property
    def state_bytes(self) -> int:
        """fp32 state bytes per parameter outside the hidden matrices (per parameter at all for one rule)."""
        return STATE_FIELD_BYTES * len(self.state_fields)

    @property
    def matrix_state_bytes(self) -> int:
        """fp32 state bytes per hidden-matrix parameter: nearly all of a layer's parameters."""
        return STATE_FIELD_BYTES * len(self.state_fields if self.matrix_fields is None else self.matrix_fields)

    @property
    def least_state_bytes(self) -> int:
        """The fewer of the two: what a lower bound of the memory may charge every parameter."""
        return min(self.state_bytes, self.matrix_state_bytes)


REGISTRY: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adam", "AdamW (--adam-*)", "Adam", ADAM_FIELDS, flags=ADAM_FLAGS),
    OptimizerSpec("sgd", "SGD (--sgd-momentum; L2 weight decay)", "SGD momentum", MOMENTUM_FIELDS,
                  flags=("sgd_momentum",), stateless_without="sgd_momentum"),
    OptimizerSpec("muon", "Muon on the 2-D hidden weights (Q, K, V apart; attention output; MLP, gate and up "
                  "apart; each expert's; the router), each orthogonalised whole on one rank, and AdamW (--adam-*) "
                  "on the embeddings, output layer, norms and biases",
                  "Muon's momentum; Adam on the rest", ADAM_FIELDS, flags=(*MUON_FLAGS, *ADAM_FLAGS),
                  matrix_fields=MOMENTUM_FIELDS, aliases=("dist_muon",), exchanges_matrices=True),
)}

ALIASES: dict[str, str] = {alias: s.name for s in REGISTRY.values() for alias in s.aliases}
CHOICES: list[str] = [*REGISTRY, *ALIASES]  # what ``--optimizer`` accepts


def canonical_name(name: str) -> str:
    """The registered name ``name`` spells (an alias's optimizer); any other string unchanged (an old
    checkpoint's record is compared, not refused)."""
    return ALIASES.get(name, name)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The optimizer ``name`` (or an alias of it) names; ValueError listing the choices otherwise."""
    spec = REGISTRY.get(canonical_name(name))
    if spec is None:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(CHOICES)}")
    return spec


def optimizer_help() -> str:
    """The ``--optimizer`` help: each choice with its spec's words."""
    return " ".join(f"{s.name}{_aliases_words(s)}: {s.help}." for s in REGISTRY.values()) + " docs/optimizers.md"


def _aliases_words(spec: OptimizerSpec) -> str:
    return f" (or {', '.join(spec.aliases)}: Megatron-LM's name for it)" if spec.aliases else ""
