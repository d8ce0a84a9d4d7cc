"""A model family: one declaration per family, the way ``ScheduleSpec`` declares a schedule.

A family is a set of values of the model flags (``ModelConfig``, ``MoEConfig``) that one Hugging Face
architecture computes exactly, with the state-dict mapping between the two. Its folder
(``ptdp/models/<family>/``) holds its declaration (``__init__.py``) and its Hugging Face adapter
(``hf.py``); the model it builds is the shared ``GPTModel``, composed from the shared blocks by the flags,
and the model's sharding rules (``GPTModel.sharding_rules``) are what every parallelism reads. A family
with a block the shared ones lack adds the block to ``ptdp/models`` (shared, for the next family too) and
its rule to the model's rules. The registry (``ptdp.models.families``) lists the families; ``ptdp
import``/``export`` and the summary line go through it. Nothing here imports torch.

Adding a family: docs/architecture.md, §"Add a model family".
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ptdp.config import ModelConfig, MoEConfig


@dataclass(frozen=True)
class ModelFamily:
    """One family.

    - ``name``: as the run's summary line prints it; ``hf_model_type``/``hf_architecture``: config.json's
      ``model_type`` and ``architectures`` entry;
    - ``matches(cfg, moe)``: whether a ptdp model is exactly this family (export picks the first family of
      the registry that matches; a family that refuses a near miss says why in ``export_problem``);
    - ``read(config_json, hf_tensors)``: the model flags and ptdp's full tensors of an HF checkpoint; refuses,
      in one line naming the field, what the family cannot compute exactly;
    - ``write(tensors, cfg, moe)``: ptdp's full tensors as HF's; ``hf_config(cfg, moe, bos, eos)``: the
      config.json keyword arguments that make HF compute what ptdp computes;
    - ``presets``: the ``--model`` names of ``ptdp.config.presets`` that are this family;
    - ``hf_model(config_json)`` and ``hf_recipes(cfg, moe, padded_vocab)``: the model flags of a config.json,
      and per ptdp parameter the recipe over HF tensor names that builds it (``ptdp.models.hf_recipe``). A
      family that declares them loads directly (``ptdp train --load HF_DIR``, each rank reading only its
      slices) and exports tensor by tensor; ``read`` is then the same recipes evaluated whole;
    - ``hf_refine(cfg, moe, config_json, tensor_names)``: the model flags the files decide beyond config.json
      (DeepSeek-V3: its MTP modules, counted only when their tensors are there), for ``--load HF_DIR``.
    """

    name: str
    hf_model_type: str
    hf_architecture: str
    matches: Callable[[ModelConfig, MoEConfig], bool]
    read: Callable[[dict, dict], tuple[ModelConfig, MoEConfig, dict]]
    write: Callable[[dict, ModelConfig, MoEConfig], dict]
    hf_config: Callable[[ModelConfig, MoEConfig, int | None, int | None], dict[str, Any]]
    export_problem: Callable[[ModelConfig, MoEConfig], str | None] = lambda cfg, moe: None
    presets: tuple[str, ...] = ()
    hf_model: Callable[[dict], tuple[ModelConfig, MoEConfig]] | None = None
    hf_recipes: Callable[[ModelConfig, MoEConfig, int], dict] | None = None
    hf_refine: Callable[[ModelConfig, MoEConfig, dict, Collection[str]], ModelConfig] | None = None
