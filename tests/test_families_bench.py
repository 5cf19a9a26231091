"""The GPU families benchmark (Qwen3-30B-A3B AWQ, gpt-oss-120b MXFP4; Qwen3-Next, MiniMax-M2, DeepSeek-V3.2 and GLM-5
with AWQ experts as `moeflow quantize` writes them) runs end to end in its --tiny CPU mode, on checkpoints written
in the published layouts, and the new families' slices at real shapes are the published models' layers."""

from __future__ import annotations

import json

import pytest
import torch

# a tensor of each checkpoint's published layout, and what the loaded model must make of it
PUBLISHED = {"qwen3_moe": ("model.layers.1.mlp.experts.7.down_proj.qweight", "awq"),
             "gpt_oss": ("model.layers.1.mlp.experts.gate_up_proj_blocks", "mxfp4"),
             "qwen3_next": ("model.layers.1.mlp.experts.7.down_proj.qweight", "awq"),
             "minimax_m2": ("model.layers.1.block_sparse_moe.experts.7.w2.qweight", "awq"),
             "deepseek_v32": ("model.layers.1.mlp.experts.7.down_proj.qweight", "awq"),
             "glm_moe_dsa": ("model.layers.1.mlp.experts.7.down_proj.qweight", "awq")}


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_run_gpu_families_tiny(tmp_path, family):
    from benchmarks.gpu import families as run_gpu_families

    threads = torch.get_num_threads()
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    try:
        result = run_gpu_families.main([
            "--tiny", "--family", family, "--checkpoint", str(ckpt), "--out", str(out), "--budgets", "2,5",
            "--policies", "lru,promoe,mixtral-offloading", "--modes", "never,auto", "--new-tokens", "3",
            "--prompt-len", "6",
        ])
    finally:
        torch.set_num_threads(threads)
    runs = result["runs"]
    assert [(r["budget"], r["policy"], r["mode"]) for r in runs] == [
        (b, p, m) for m in ("never", "auto") for b in (2.0, 5.0) for p in ("lru", "mixtral-offloading")]
    assert all("error" not in r for r in runs), runs
    # the first configuration is the reference; every later one is compared with it and must be equal
    assert [r["tokens_equal_reference"] for r in runs] == [None] + [True] * (len(runs) - 1), runs
    assert [r["slots"] for r in runs] == [2, 2, 5, 5] * 2
    assert sorted(result["auto_over_never"]) == ["lru @ 2", "lru @ 5", "mixtral-offloading @ 2",
                                                 "mixtral-offloading @ 5"]
    assert all(r["tok_per_s"] > 0 and r["ms_per_layer"] > 0 for r in runs)
    assert "needs a trained promoe predictor" in result["skipped_policies"]["promoe"]

    name, kind = PUBLISHED[family]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert name in index["weight_map"]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == family and result["checkpoint"]["bytes"] > 0
    if family == "gpt_oss":
        assert config["quantization_config"]["quant_method"] == "mxfp4"
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
    saved = json.loads((out / f"families_{family}.json").read_text())
    assert len(saved["runs"]) == len(runs) and "| 5.0 | 5 |" in (out / f"families_{family}.md").read_text()

    from moeflow import MoEModel  # the written checkpoint is read as the family's published format
    assert MoEModel.from_pretrained(ckpt, kernels="torch").experts.fmt.kind == kind
    mtime = (ckpt / "config.json").stat().st_mtime_ns
    run_gpu_families.write_family_checkpoint(ckpt, family, run_gpu_families.TINY[family])
    assert (ckpt / "config.json").stat().st_mtime_ns == mtime  # written once, reused


def test_the_new_families_slices_are_the_published_layers_and_fit_the_disk():
    """Qwen3-Next-80B, MiniMax-M2 and DeepSeek-V3.2 at their published shapes, cut to the lane's default slices:
    the configs parse as the families read them, the slices keep the published layer pattern, and each checkpoint
    fits beside stage 3's 25 GB one on the lent machine's 64 GiB disk (the stage removes others when short)."""
    from benchmarks.common import family_writers as fw
    from benchmarks.gpu import deltanet as run_gpu_deltanet
    from moeflow.families import family_for_config

    fams = {f: family_for_config(fw.slice_config(cfg, fw.DEFAULT_LAYERS[f])) for f, cfg in fw.FULL.items()}
    nxt = fams["qwen3_next"].config
    assert nxt.linear_layers == tuple(i for i in range(24) if i % 4 != 3) and nxt.full_layers == (3, 7, 11, 15, 19, 23)
    shape = nxt.deltanet_shape(True)  # the DeltaNet benchmark times these sizes
    assert (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim, shape.conv_kernel) == \
        run_gpu_deltanet.SHAPES["qwen3-next-80b"]
    assert fams["minimax_m2"].moe_layers == tuple(range(10)) and fams["minimax_m2"].num_experts == 256
    assert fams["deepseek_v32"].moe_layers == (3, 4, 5) and fams["deepseek_v32"].num_experts == 256
    glm = fw.slice_config(fw.FULL["glm_moe_dsa"], fw.DEFAULT_LAYERS["glm_moe_dsa"])  # per-layer lists cut with it
    assert fams["glm_moe_dsa"].moe_layers == (3, 4, 5) and len(glm["mlp_layer_types"]) == len(glm["indexer_types"]) == 6
    for f, cfg in fw.FULL.items():
        size = fw.estimated_bytes(fw.slice_config(cfg, fw.DEFAULT_LAYERS[f]))
        assert 15e9 < size < 30e9 < fw.estimated_bytes(cfg), (f, size)
