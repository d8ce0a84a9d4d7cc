"""The registry of model families (``ptdp.models.family``): one line per family, in the order export tries
them (the most specific first). A new family adds its folder and one line here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ptdp.models.deepseek_v3 import DEEPSEEK_V3
from ptdp.models.family import ModelFamily
from ptdp.models.gemma3 import GEMMA3
from ptdp.models.gpt2 import GPT2
from ptdp.models.gpt_oss import GPT_OSS
from ptdp.models.llama import LLAMA
from ptdp.models.mixtral import MIXTRAL, QWEN2_MOE
from ptdp.models.qwen3 import QWEN3, QWEN3_MOE
from ptdp.models.qwen3_next import QWEN3_NEXT

if TYPE_CHECKING:
    from ptdp.config import ModelConfig, MoEConfig

FAMILIES: tuple[ModelFamily, ...] = (QWEN3_NEXT, DEEPSEEK_V3, GEMMA3, GPT_OSS, QWEN3_MOE, QWEN3, MIXTRAL, QWEN2_MOE, LLAMA,
                                     GPT2)


def family_for_hf(model_type: str | None) -> ModelFamily | None:
    """The family whose Hugging Face ``model_type`` this is, or None."""
    return next((family for family in FAMILIES if family.hf_model_type == model_type), None)


def family_of(cfg: ModelConfig, moe: MoEConfig) -> ModelFamily | None:
    """The first family that is exactly this model (DeepSeek-V3's also when it would refuse to export it)."""
    return next((family for family in FAMILIES if family.matches(cfg, moe)), None)
