"""MTP (nextn) layers in GGUF files made by llama.cpp's own ``convert_hf_to_gguf.py`` (and ``llama-quantize``) from
tests/mtp_helpers.py's tiny checkpoints with an MTP layer: GLM-4.5 (``Glm4MoeModel``, glm4moe) and GLM-4.7-Flash
(``Glm4MoeLiteModel``, deepseek2) keep it, and ``from_pretrained(<gguf>, mtp=True)`` reads it: the f32 file's main
and MTP logits equal the safetensors load of the same checkpoint exactly, greedy with speculation is plain greedy,
and on the Q8_0 file too; DeepSeek-V3's conversion (``DeepseekV2Model``) drops it, and ``mtp=True`` is refused
naming the file and ``deepseek2.nextn_predict_layers``.

Needs ``MOEFLOW_LLAMA_CPP_DIR`` as tests/test_gguf_llama_cpp.py does (skipped without it). About 40 s on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from mtp_helpers import make_mtp_checkpoint, mtp_layer_logits  # noqa: E402
from test_gguf_llama_cpp import CONVERT, LLAMA_CPP, QUANTIZE, save_tokenizer  # noqa: E402
from test_gguf_mtp import GLM  # noqa: E402
from test_mtp import SHAPE  # noqa: E402

from moeflow import MoEModel, OffloadConfig  # noqa: E402
from moeflow.errors import CheckpointError  # noqa: E402

pytestmark = [pytest.mark.skipif(
    not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file() or not QUANTIZE.is_file(),
    reason="MOEFLOW_LLAMA_CPP_DIR (llama.cpp sources with build/bin/llama-quantize) not set"),
    pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:.*dequantized into")]

IDS = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
# GLM-4.7-Flash-like: MLA, its dense first layer said by mlp_layer_types (the main layers'), sigmoid router
LITE = dict(num_hidden_layers=3, n_routed_experts=6, num_experts_per_tok=2, q_lora_rank=24, n_shared_experts=1,
            num_key_value_heads=4, norm_topk_prob=True, routed_scaling_factor=1.8,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
KINDS = {"glm4_moe": GLM, "glm4_moe_lite": LITE, "deepseek_v3": dict(SHAPE, num_key_value_heads=4)}
# config.json entries the published checkpoints have that the converter reads and transformers' configs do not keep
PATCH = {"deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc"),
         "glm4_moe_lite": dict(scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1)}


def converted(tmp_path: Path, kind: str, qtype: str | None = None) -> tuple[Path, Path]:
    """(the safetensors checkpoint with an MTP layer, the GGUF llama.cpp's converter (f32) and llama-quantize
    (``qtype``) make of it)."""
    hf, _, _ = make_mtp_checkpoint(tmp_path / "hf", seed=3, kind=kind, **dict(KINDS[kind]))
    save_tokenizer(hf, 97)
    if kind in PATCH:
        config = json.loads((hf / "config.json").read_text())
        config.update(PATCH[kind])
        if kind == "glm4_moe_lite":  # (the main layers' kinds, as published)
            config["mlp_layer_types"] = config["mlp_layer_types"][:3]
        (hf / "config.json").write_text(json.dumps(config))
    script = tmp_path / "convert.py"
    script.write_text(CONVERT.format(src=str(LLAMA_CPP)))
    f32 = tmp_path / "m-f32.gguf"
    subprocess.run([sys.executable, str(script), str(hf), "--outtype", "f32", "--outfile", str(f32)], check=True,
                   capture_output=True)
    if qtype is None:
        return hf, f32
    out = tmp_path / f"m-{qtype}.gguf"
    env = dict(os.environ, LD_LIBRARY_PATH=str(QUANTIZE.parent))
    subprocess.run([str(QUANTIZE), str(f32), str(out), qtype], check=True, capture_output=True, env=env)
    return hf, out


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFLOW_CACHE_DIR", str(tmp_path / "cache"))


def greedy(model: MoEModel, **kw) -> torch.Tensor:
    return model.generate(IDS, max_new_tokens=10, do_sample=False, eos_token_id=[], **kw)


@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_lite"])
def test_converter_f32_mtp_equals_safetensors(tmp_path, kind):
    hf, path = converted(tmp_path, kind)
    st, gg = MoEModel.from_pretrained(hf, mtp=True), MoEModel.from_pretrained(path, mtp=True)
    main_st, mtp_st = mtp_layer_logits(st, IDS)
    main_gg, mtp_gg = mtp_layer_logits(gg, IDS)
    assert torch.equal(main_gg, main_st) and torch.equal(mtp_gg, mtp_st)
    plain = greedy(st)
    assert torch.equal(greedy(gg, num_speculative_tokens=2), plain)


@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_lite"])
def test_converter_q8_0_speculation_is_plain_greedy(tmp_path, kind):
    _, path = converted(tmp_path, kind, "Q8_0")
    for offload in (None, OffloadConfig(policy="lru", gpu_expert_slots=4)):
        model = MoEModel.from_pretrained(path, mtp=True, offload=offload)
        plain = greedy(model)
        assert torch.equal(greedy(model, num_speculative_tokens=2), plain), offload


def test_deepseek_v3_conversion_drops_the_mtp_layer(tmp_path):
    hf, path = converted(tmp_path, "deepseek_v3")
    with pytest.raises(CheckpointError, match=r"m-f32\.gguf: mtp=True .*no deepseek2\.nextn_predict_layers"):
        MoEModel.from_pretrained(path, mtp=True)
    assert torch.equal(greedy(MoEModel.from_pretrained(path)), greedy(MoEModel.from_pretrained(hf)))
