"""The GPU loan's Q4_0 GGUF writer (benchmarks/common/gguf_checkpoint.py): the GGUF holds exactly the synthetic AWQ
checkpoint's weights (Mixtral as ``llama`` with experts, Qwen3-30B-A3B as ``qwen3moe``), and the prebuilt llama.cpp
(../shared/peers, CPU backends) loads a 2-layer file of Mixtral's full hidden width and decodes with it; the
Q4_K_M variant has llama-quantize's expert mixture and both engines read it. ~25 s on 2 cores (the llama.cpp tests
~15 s of it; 35 s at load average 9)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf.quants import dequantize  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from benchmarks.common import gguf_checkpoint  # noqa: E402
from moeflow.quant.awq import dequantize as awq_dequantize  # noqa: E402
from moeflow.quant.awq import pack_int4  # noqa: E402


def _read(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    tensors = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    return tensors, reader.fields


def _state(directory: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for f in directory.glob("*.safetensors"):
        sd.update(load_file(f))
    return sd


def _linear(sd: dict, prefix: str, group: int) -> np.ndarray:
    """An AWQ linear as nn.Linear's [out, in], in fp32 ((q - z) * s exactly)."""
    w = awq_dequantize(sd[f"{prefix}.qweight"], sd[f"{prefix}.qzeros"], sd[f"{prefix}.scales"].float(), group)
    return w.T.numpy()


def test_the_mixtral_gguf_holds_the_awq_checkpoints_weights(tmp_path):
    from benchmarks.common.checkpoint import TINY, write_synthetic_awq_checkpoint

    cfg = {**TINY, "num_hidden_layers": 3}
    write_synthetic_awq_checkpoint(tmp_path / "awq", cfg, group_size=32)
    path = gguf_checkpoint.write_synthetic_gguf(tmp_path / "m.gguf", "mixtral", cfg, group=32)
    g, fields = _read(path)
    sd = _state(tmp_path / "awq")
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert int(fields["llama.expert_count"].parts[-1][0]) == 8
    assert int(fields["llama.expert_used_count"].parts[-1][0]) == 2
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for layer in range(3):
        p = f"model.layers.{layer}"
        for e in range(8):
            for name, w in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
                expected = _linear(sd, f"{p}.block_sparse_moe.experts.{e}.{w}", 32)
                assert np.array_equal(g[f"blk.{layer}.{name}.weight"][e], expected), (layer, e, name)
        # q / k rows in GGML's rope order (convert_hf_to_gguf.py's permute), v / o as stored
        for name, proj, n in (("attn_q", "q", heads), ("attn_k", "k", kv), ("attn_v", "v", None),
                              ("attn_output", "o", None)):
            expected = _linear(sd, f"{p}.self_attn.{proj}_proj", 32)
            expected = gguf_checkpoint.permute_rope_rows(expected, n) if n else expected
            assert np.array_equal(g[f"blk.{layer}.{name}.weight"], expected), (layer, name)
        assert np.array_equal(g[f"blk.{layer}.ffn_gate_inp.weight"], sd[f"{p}.block_sparse_moe.gate.weight"].float())
    assert np.array_equal(g["token_embd.weight"], sd["model.embed_tokens.weight"].float())
    assert np.array_equal(g["output.weight"], sd["lm_head.weight"].float())


def test_the_qwen3_gguf_holds_the_awq_checkpoints_weights(tmp_path):
    from benchmarks.gpu.families import TINY, write_family_checkpoint

    cfg = TINY["qwen3_moe"]
    write_family_checkpoint(tmp_path / "awq", "qwen3_moe", cfg, group_size=32)
    path = gguf_checkpoint.write_synthetic_gguf(tmp_path / "q.gguf", "qwen3", cfg, group=32)
    g, fields = _read(path)
    sd = _state(tmp_path / "awq")
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "qwen3moe"
    E = cfg["num_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for e in range(E):
            for name, w in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
                assert np.array_equal(g[f"blk.{layer}.{name}.weight"][e], _linear(sd, f"{p}.mlp.experts.{e}.{w}", 32))
        for name, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            assert np.array_equal(g[f"blk.{layer}.{name}.weight"], sd[f"{p}.self_attn.{proj}.weight"].float())
        assert np.array_equal(g[f"blk.{layer}.ffn_gate_inp.weight"], sd[f"{p}.mlp.gate.weight"].float())
        assert g[f"blk.{layer}.attn_q_norm.weight"].shape == (cfg["head_dim"],)
    assert np.array_equal(g["output.weight"], sd["lm_head.weight"].float())


def test_a_zero_point_other_than_8_is_refused():
    q = torch.randint(0, 16, (64, 16), dtype=torch.uint8)
    zeros = torch.full((2, 16), 8, dtype=torch.uint8)
    zeros[1, 3] = 7
    with pytest.raises(ValueError, match="zero points other than 8"):
        gguf_checkpoint.awq_to_q4_0(pack_int4(q), pack_int4(zeros), torch.ones(2, 16, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="multiple of Q4_0's block"):
        gguf_checkpoint.awq_to_q4_0(pack_int4(q), pack_int4(zeros), torch.ones(4, 16, dtype=torch.float16), 16)


def test_the_prebuilt_llama_cpp_decodes_a_full_width_mixtral_gguf(tmp_path):
    """2 layers of Mixtral-8x7B's full width (hidden 4096, 32 heads / 8 KV heads, 8 experts top 2) with the expert
    FFN narrowed to 1024 (from 14336) and a 4096-token vocabulary (from 32000) to keep it ~0.3 GB and this test short;
    `python -m benchmarks.common.gguf_checkpoint --layers 2` writes the 2.2 GB full-size pair (llama-bench ran it:
    tg8 1.5 tok/s on 2 busy cores). On the CPU backends of the CUDA build (no GPU here)."""
    from benchmarks.common.checkpoint import MIXTRAL_8X7B
    from benchmarks.peers import llama_cpp_prebuilt as prebuilt

    archive = prebuilt.find_archive()
    if archive is None:
        pytest.skip("no prebuilt llama.cpp: ../shared/peers/llama-cpp-cuda-sm90.tar.xz is absent (or set "
                    "LLAMA_CPP_TARBALL)")
    cfg = {**MIXTRAL_8X7B, "num_hidden_layers": 2, "intermediate_size": 1024, "vocab_size": 4096}
    path = gguf_checkpoint.write_synthetic_gguf(tmp_path / "mixtral-2l.gguf", "mixtral", cfg)
    bin_dir = prebuilt.unpack(archive)
    row = prebuilt.llama_bench(bin_dir, path, ngl=0, n_cpu_moe=0, prompt=8, gen=8, reps=1, threads=2, timeout=300)
    assert row["pp8"] > 0 and row["tg8"] > 0, row
    assert row["model_bytes"] == path.stat().st_size - _data_offset(path)
    assert "CPU" in row["backends"] or "CUDA" in row["backends"]  # (CUDA: the library loads, no device found)


def _data_offset(path: Path) -> int:
    return int(gguf.GGUFReader(path).data_offset)


def test_the_prebuilt_llama_cpp_decodes_a_qwen3moe_gguf_whose_heads_are_wider_than_hidden(tmp_path):
    """Qwen3-30B-A3B's attention is wider than its hidden size (32 heads x 128 = 4096 > 2048): key_length, not
    hidden / heads. A narrow copy of that trait (8 x 128 > 512, 16 experts top 4) through llama-bench."""
    from benchmarks.gpu.families import QWEN3_30B_A3B
    from benchmarks.peers import llama_cpp_prebuilt as prebuilt

    archive = prebuilt.find_archive()
    if archive is None:
        pytest.skip("no prebuilt llama.cpp: ../shared/peers/llama-cpp-cuda-sm90.tar.xz is absent (or set "
                    "LLAMA_CPP_TARBALL)")
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8,
           "num_key_value_heads": 2, "moe_intermediate_size": 256, "num_experts": 16, "num_experts_per_tok": 4,
           "vocab_size": 512}
    path = gguf_checkpoint.write_synthetic_gguf(tmp_path / "qwen3.gguf", "qwen3", cfg)
    row = prebuilt.llama_bench(prebuilt.unpack(archive), path, ngl=0, n_cpu_moe=0, prompt=8, gen=8, reps=1,
                               threads=2, timeout=300)
    assert row["pp8"] > 0 and row["tg8"] > 0 and row["model_bytes"] == path.stat().st_size - _data_offset(path)


def test_the_q4_k_m_file_holds_llama_quantizes_expert_mixture_and_both_engines_read_it(tmp_path):
    """The Q4_K_M variant (random K-quant experts, written without llama-quantize): its expert tensors have the
    block types llama-quantize's Q4_K_M gives the Q4_0 file (`--allow-requantize`, 8 narrow layers: down in Q6_K in
    layers 0, 3, 6, 7), llama-bench decodes it, and moeflow loads it as the GGUF format with both down types, the
    pool's bytes the file's."""
    from benchmarks.common.checkpoint import MIXTRAL_8X7B
    from benchmarks.peers import llama_cpp_prebuilt as prebuilt

    cfg = {**MIXTRAL_8X7B, "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 512}
    path = gguf_checkpoint.write_synthetic_gguf(tmp_path / "m-Q4_K_M.gguf", "mixtral", cfg, experts="Q4_K_M")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "_exps" in t.name}
    more = [layer for layer in range(8) if gguf_checkpoint.use_more_bits(layer, 8)]
    assert more == [0, 3, 6, 7]
    for layer in range(8):
        assert types[f"blk.{layer}.ffn_gate_exps.weight"] == types[f"blk.{layer}.ffn_up_exps.weight"] == "Q4_K"
        assert types[f"blk.{layer}.ffn_down_exps.weight"] == ("Q6_K" if layer in more else "Q4_K")
    g, _ = _read(path)
    w = g["blk.0.ffn_gate_exps.weight"]
    assert np.isfinite(w).all() and 0.003 < float(w.std()) < 0.03 and abs(float(w.mean())) < 0.003, w.std()
    archive = prebuilt.find_archive()
    if archive is not None:
        bin_dir = prebuilt.unpack(archive)
        q4_0 = gguf_checkpoint.write_synthetic_gguf(tmp_path / "m-Q4_0.gguf", "mixtral", cfg)
        requant = tmp_path / "requant.gguf"
        done = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(q4_0), str(requant),
                               "Q4_K_M", "2"], capture_output=True, text=True, timeout=300,
                              env=prebuilt.run_env(bin_dir))
        assert done.returncode == 0, done.stderr[-2000:]
        theirs = {t.name: t.tensor_type.name for t in gguf.GGUFReader(requant).tensors if "_exps" in t.name}
        assert theirs == types
        row = prebuilt.llama_bench(bin_dir, path, ngl=0, n_cpu_moe=0, prompt=8, gen=8, reps=1, threads=2,
                                   timeout=300)
        assert row["pp8"] > 0 and row["tg8"] > 0
    from moeflow import MoEModel, OffloadConfig

    model = MoEModel.from_pretrained(path, device="cpu", kernels="torch", progress=False, cuda_graphs=False,
                                     offload=OffloadConfig(policy="lru", gpu_expert_slots=4))
    try:
        host = model.experts.host
        assert (host.fmt.gate_up_types, host.fmt.down_types) == (("Q4_K",), ("Q4_K", "Q6_K"))
        out = model.generate(torch.tensor([[1, 5, 9, 300]]), max_new_tokens=2, do_sample=False, eos_token_id=[])
        assert out.shape == (1, 6)
    finally:
        model.close()
