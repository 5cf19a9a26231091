"""The GPU lane's peers stage (benchmarks/peers/run_gpu_peers.py) end to end at its CPU sizes: a tiny Mixtral
written with transformers, converted to GGUF and quantized to Q4_0 (when a CPU llama.cpp build is at hand:
benchmarks/peers/build_llama_cpp.sh /tmp/peers), AWQ-quantized with ``moeflow quantize``, then timed by
llama-bench, moeflow (resident, lru, lru + cpu_compute) and transformers + accelerate (when installed), with the
moeflow / peer ratios per GPU budget in the JSON and the Markdown table."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

LLAMA_BUILD = Path(os.environ.get("LLAMA_CPP_BUILD", "/tmp/peers/llama.cpp/build"))
HAS_LLAMA = (LLAMA_BUILD / "bin" / "llama-bench").is_file() and (LLAMA_BUILD.parent / "convert_hf_to_gguf.py").is_file()


@pytest.fixture
def keep_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_peers_stage_tiny(tmp_path, keep_threads):
    from benchmarks.peers import run_gpu_peers

    engines = ["llama.cpp", "moeflow"] + (["transformers"] if importlib.util.find_spec("accelerate") else [])
    argv = ["--tiny", "--phase", "all", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
            "--llama-build", str(LLAMA_BUILD), "--engines", ",".join(engines), "--threads", "1"]
    if HAS_LLAMA:
        argv += ["--sources", str(LLAMA_BUILD.parent)]  # its own converter (the .peers subset may be absent)
    data = run_gpu_peers.main(argv)
    saved = json.loads((tmp_path / "out" / "peers_gpu.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(data["rows"], default=str))
    rows = {(r["engine"], r["gpu_experts"]): r for r in data["rows"]}
    assert all("error" not in r for r in rows.values()), [r for r in rows.values() if "error" in r]
    # 2 layers x 4 experts: --n-cpu-moe 0 and 1 -> 8 and 4 experts on the "GPU" (moeflow: as many slots)
    expected = {("moeflow AWQ resident", 8), ("moeflow AWQ lru", 4), ("moeflow AWQ lru cpu_compute=auto", 4)}
    if HAS_LLAMA:
        expected |= {("llama.cpp Q4_0", 8), ("llama.cpp Q4_0", 4)}
        assert rows[("llama.cpp Q4_0", 4)]["n_cpu_moe"] == 1 and saved["files_bytes"]["q4_0"] > 0
    else:
        assert "llama.cpp skipped" in data["llama_cpp_skipped"]
    if "transformers" in engines:
        expected |= {("transformers+accelerate fp16", 8), ("transformers+accelerate fp16", 4)}
    assert set(rows) == expected
    assert all(r["pp16"] > 0 and r["tg2"] > 0 for r in rows.values())
    assert rows[("moeflow AWQ lru", 4)]["slots"] == 4 and saved["files_bytes"]["awq"] > 0
    for q in data["ratios"]:  # moeflow / peer at the same number of experts on the GPU
        m, p = rows[(q["moeflow"], q["gpu_experts"])], rows[(q["peer"], q["gpu_experts"])]
        assert q["pp16_ratio"] == pytest.approx(m["pp16"] / p["pp16"]) and q["tg_ratio"] == pytest.approx(
            m["tg2"] / p["tg2"])
    peers = {engine for engine, _ in rows if not engine.startswith("moeflow")}
    assert len(data["ratios"]) == 3 * len(peers)  # resident at 8 experts, both lru rows at 4, per peer
    table = (tmp_path / "out" / "peers_gpu.md").read_text()
    assert "| moeflow AWQ lru | " in table and ("decode ratio" in table) == bool(peers)
