"""dots.llm1 (``dots1``: rednote-hilab's dots.llm1.base / .inst, 142B parameters, 14B active).

GLM-4.5's layer (:mod:`.glm4_moe`: DeepSeek-V3's sigmoid router with ``e_score_correction_bias``, shared experts,
dense first layers) with Qwen3's attention: rotary on the whole head and per-head RMS QK-norm always on, q/k/v
and o biases when ``attention_bias``. transformers' ``Dots1Config`` can mark layers ``sliding_attention``; the released
checkpoints have none (``use_sliding_window`` false), and a config that does is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moeflow.errors import CheckpointError
from moeflow.families.glm4_moe import Glm4MoeConfig, Glm4MoeFamily


@dataclass
class Dots1Config(Glm4MoeConfig):
    partial_rotary_factor: float = 1.0  # dots1 turns the whole head
    use_qk_norm: bool = True  # Dots1Attention always normalises q and k per head
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    model_type: ClassVar[str] = "dots1"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> Dots1Config:
        d = dict(d)
        sliding = [i for i, kind in enumerate(d.get("layer_types") or []) if kind != "full_attention"]
        if d.get("use_sliding_window") and d.get("sliding_window"):
            sliding = sliding or list(range(int(d.get("max_window_layers", 0)), int(d["num_hidden_layers"])))
        if sliding:
            raise CheckpointError(f"{source}: dots1 layers {sliding[:8]} use sliding-window attention, which moeflow "
                                  f"does not support for dots1 (the released dots.llm1 checkpoints use none)")
        d["partial_rotary_factor"] = 1.0  # not a dots1 field: never read one
        d["use_qk_norm"] = True
        d["o_bias"] = bool(d.get("attention_bias", False))  # Dots1Attention's o_proj takes attention_bias too
        return super().from_dict(d, source)  # type: ignore[return-value]


class Dots1Family(Glm4MoeFamily):
    name = "dots1"
    model_types = ("dots1",)
    config: Dots1Config
    config_class = Dots1Config
