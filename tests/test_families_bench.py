"""The GPU families benchmark (Qwen3-30B-A3B AWQ, gpt-oss-120b MXFP4) runs end to end in its --tiny CPU mode, on
checkpoints written in the published layouts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# a tensor of each checkpoint's published layout, and what the loaded model must make of it
PUBLISHED = {"qwen3_moe": ("model.layers.1.mlp.experts.7.down_proj.qweight", "awq"),
             "gpt_oss": ("model.layers.1.mlp.experts.gate_up_proj_blocks", "mxfp4")}


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_run_gpu_families_tiny(tmp_path, family):
    import run_gpu_families

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
