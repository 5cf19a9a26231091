"""Model families: each module describes one architecture through :class:`~moeflow.families.base.Family`."""

from __future__ import annotations

from typing import Any

from moeflow.errors import CheckpointError
from moeflow.families.base import CausalDecoder, ExpertLayout, ExpertSpec, Family, RouterSpec
from moeflow.families.deepseek import DeepSeekV2Family, DeepSeekV3Family
from moeflow.families.dots1 import Dots1Family
from moeflow.families.dsa import DeepSeekV32Family, GlmMoeDsaFamily
from moeflow.families.ernie4_5_moe import Ernie45MoeFamily
from moeflow.families.glm4_moe import Glm4MoeFamily
from moeflow.families.gpt_oss import GptOssFamily
from moeflow.families.hunyuan_v1_moe import HunyuanV1MoeFamily
from moeflow.families.minimax_m2 import MiniMaxM2Family
from moeflow.families.mixtral import MixtralConfig, MixtralFamily
from moeflow.families.olmoe import OlmoeFamily
from moeflow.families.qwen2_moe import Qwen2MoeFamily
from moeflow.families.qwen3_moe import Qwen3MoeFamily
from moeflow.families.qwen3_next import Qwen3NextFamily, Qwen35MoeFamily

FAMILIES: tuple[type[Family], ...] = (MixtralFamily, Qwen3MoeFamily, Qwen2MoeFamily, OlmoeFamily, DeepSeekV2Family,
                                      DeepSeekV3Family, DeepSeekV32Family, GlmMoeDsaFamily, Glm4MoeFamily,
                                      Dots1Family, Ernie45MoeFamily, MiniMaxM2Family, HunyuanV1MoeFamily,
                                      GptOssFamily, Qwen3NextFamily, Qwen35MoeFamily)

__all__ = ["FAMILIES", "Family", "ExpertSpec", "ExpertLayout", "RouterSpec", "CausalDecoder", "MixtralFamily",
           "MixtralConfig", "Qwen3MoeFamily", "Qwen2MoeFamily", "Qwen3NextFamily", "Qwen35MoeFamily", "OlmoeFamily",
           "Dots1Family", "MiniMaxM2Family", "HunyuanV1MoeFamily", "GptOssFamily", "family_class",
           "supported_model_types", "family_for_config"]


def supported_model_types() -> list[str]:
    return sorted(t for fam in FAMILIES for t in fam.model_types)


def family_class(model_type: str | None, source: str = "config.json") -> type[Family]:
    """The family reading config.json's ``model_type`` (None, as in old Mixtral exports: Mixtral)."""
    for fam in FAMILIES:
        if (model_type or "mixtral") in fam.model_types:
            return fam
    raise CheckpointError(f"{source}: model_type {model_type!r} is not supported; supported model types: "
                          f"{', '.join(supported_model_types())}")


def family_for_config(raw: dict[str, Any], source: str = "config.json") -> Family:
    """The family of a parsed config.json, bound to its config."""
    return family_class(raw.get("model_type"), source).from_config_dict(raw, source)
