"""benchmarks/gpu_loan.sh, the 15-minute GPU loan (issue 36): PLAN=1's limits fit two device commands (call 1 <= 9 min,
call 2 <= 5 min), the header states the later loans' order, and TINY=1 runs call 1 end to end on the CPU: the tiny
AWQ checkpoint and its GGUF, the prebuilt llama.cpp's CPU backends (when ../shared/peers holds it), moeflow loaded
once with its expert backend swapped row by row (tokens = resident after every swap), the ratios and the table.
~40-60 s on 2 cores (call 1 TINY: ~35 s of it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = ROOT / "benchmarks" / "gpu_loan.sh"
COMMAND_LIMIT_S = 600  # one device command
KILL_AFTER_S = 15  # timeout's --kill-after, past each step's limit


def plan(call: str, tmp_path: Path) -> list[tuple[str, int, str]]:
    env = {**os.environ, "PLAN": "1", "OUT": str(tmp_path / call)}
    env.pop("TINY", None)
    done = subprocess.run(["bash", str(SCRIPT), call], env=env, text=True, capture_output=True, check=True)
    steps = []
    for line in done.stdout.splitlines():
        kind, limit, command = line.split(" ", 2)
        steps.append((kind, int(limit), command))
    return steps


def test_the_two_calls_fit_one_loan(tmp_path):
    call1, call2 = plan("call1", tmp_path), plan("call2", tmp_path)
    # call 1 writes the checkpoints in the background while the GPU runs the stack check, the correctness set and the
    # kernels; the llama.cpp step waits for them: the command lasts max(background, steps before) + steps after
    kinds = [kind for kind, _, _ in call1]
    assert kinds.count("plan-background") == 1 and "plan-background" not in [k for k, _, _ in call2]
    bg = kinds.index("plan-background")
    wait = next(i for i, (_, _, c) in enumerate(call1) if "--phase llama" in c)
    before = [limit for kind, limit, _ in call1[:wait] if kind == "plan"]
    after = [limit for _, limit, _ in call1[wait:]]
    background = call1[bg][1]
    for kill in (0, KILL_AFTER_S):
        longest = max(background + kill, sum(before) + kill * len(before)) + sum(after) + kill * len(after)
        assert longest <= (9 * 60 if kill == 0 else COMMAND_LIMIT_S), (call1, kill)
    serial = [limit for _, limit, _ in call2]
    assert sum(serial) <= 5 * 60 and sum(serial) + KILL_AFTER_S * len(serial) <= COMMAND_LIMIT_S, call2
    commands = " ".join(c for _, _, c in call1)
    for needed in ("benchmarks.gpu.stack --cuda", "tests/test_cuda_lane.py",
                   "benchmarks.gpu.kernels --shapes mixtral-8x7b --tokens 1,4,16", "--phase llama", "--phase moeflow",
                   "benchmarks.gpu.headline_report"):
        assert needed in commands, needed
    assert "--family qwen3 --phase moeflow" in " ".join(c for _, _, c in call2)
    # llama.cpp runs before moeflow's process exists (the two never share the GPU)
    assert commands.index("--phase llama") < commands.index("--phase moeflow")


def test_the_header_states_the_later_loans_order():
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    line = next(x for x in header.splitlines() if "serve," in x)
    assert [w.strip(" #.,") for w in line.split(":")[-1].split(",")] == [
        "serve", "engine", "models", "families", "tune", "deltanet", "lookup"]
    assert "benchmarks/results/<gpu>-<date>/" in header


def test_results_dir_and_ratios():
    from benchmarks.gpu import headline_report

    assert headline_report.results_dir("NVIDIA H200", "2026-12-01") == Path("benchmarks/results/h200-2026-12-01")
    assert headline_report.results_dir("NVIDIA H100 80GB HBM3", "2026-12-01").name == "h100-80gb-2026-12-01"
    data = {"llama": [{"n_cpu_moe": 16, "decode_tok_s": 10.0, "ttft_s": 2.0},
                      {"n_cpu_moe": 24, "error": "timeout"}],
            "moeflow": [{"engine": "moeflow AWQ lru", "share": 0.5, "gpu_experts": 128, "n_cpu_moe": 16,
                         "decode_tok_s": 15.0, "ttft_s": 1.0},
                        {"engine": "moeflow AWQ lru", "share": 0.25, "gpu_experts": 64, "n_cpu_moe": 24,
                         "decode_tok_s": 9.0, "ttft_s": 1.0}]}
    assert headline_report.ratios(data) == [{"share": 0.5, "gpu_experts": 128, "moeflow": "moeflow AWQ lru",
                                             "decode_ratio": 1.5, "ttft_ratio": 2.0}]


def test_budgets_match_llama_cpps_n_cpu_moe():
    from benchmarks.gpu import headline as run_gpu_headline

    cfg, _ = run_gpu_headline.family_config("mixtral", tiny=False, layers=None)
    assert run_gpu_headline.budgets(cfg, [0.5, 0.25]) == [
        {"share": 1.0, "n_cpu_moe": 0, "gpu_experts": 256}, {"share": 0.5, "n_cpu_moe": 16, "gpu_experts": 128},
        {"share": 0.25, "n_cpu_moe": 24, "gpu_experts": 64}]
    cfg, _ = run_gpu_headline.family_config("qwen3", tiny=False, layers=None)
    assert cfg["num_hidden_layers"] == 48 and cfg["num_experts"] == 128 and cfg["num_experts_per_tok"] == 8
    assert [b["n_cpu_moe"] for b in run_gpu_headline.budgets(cfg, [0.5, 0.25])] == [0, 24, 36]


def test_call1_runs_end_to_end_on_the_cpu(tmp_path):
    pytest.importorskip("gguf")
    from benchmarks.peers import llama_cpp_prebuilt

    out = tmp_path / "out"
    env = {**os.environ, "TINY": "1", "OUT": str(out), "TMPDIR": str(tmp_path)}
    env.pop("PLAN", None)
    done = subprocess.run(["bash", str(SCRIPT), "call1"], env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (out / "call1.log").read_text()
    collected = re.search(r"(\d+)/\d+ tests collected", log)  # the minimum correctness set resolves to tests
    assert collected and int(collected.group(1)) >= 15, log[-3000:]
    data = json.loads((out / "headline_mixtral.json").read_text())
    assert data["checkpoints"]["gguf_bytes"] > 0 and data["checkpoints"]["awq_bytes"] > 0
    rows = data["moeflow"]
    assert [(r["engine"], r["gpu_experts"]) for r in rows] == [
        ("moeflow AWQ resident", 32), ("moeflow AWQ lru", 16), ("moeflow AWQ lru", 8),
        ("moeflow AWQ lru cpu_compute=auto", 16), ("moeflow AWQ lru cpu_compute=auto", 8)]
    # one load, many rows: every swapped backend decodes the resident tokens
    assert all("error" not in r and r["tokens_equal_resident"] and r["decode_tok_s"] > 0 for r in rows), rows
    assert [r["decode_hit_rate"] < 1 for r in rows[1:]] == [True] * 4 and rows[2]["bytes_h2d"] > 0
    md = (out / "headline.md").read_text()
    assert "| moeflow AWQ lru | 8 | 25% |" in md
    if llama_cpp_prebuilt.find_archive() is None:
        assert "llama-cpp-cuda-sm90.tar.xz" in data["llama_error"]
        return
    llama = {r["n_cpu_moe"]: r for r in data["llama"]}
    assert sorted(llama) == [0, 2, 3] and all(r["decode_tok_s"] > 0 for r in llama.values()), llama
    assert {q["share"] for q in data["ratios"]} == {1.0, 0.5, 0.25} and len(data["ratios"]) == 5
    assert "decode moeflow / llama.cpp" in md and "n_cpu_moe 3" in md


def test_a_llama_cpp_without_cuda_on_a_gpu_records_why_and_runs_no_row(tmp_path, monkeypatch):
    """On the GPU, a prebuilt llama.cpp that lists no CUDA device would run every row on its CPU backends (minutes
    each at full size): the phase records why (the fallback named) and leaves the time to moeflow."""
    import argparse

    from benchmarks.gpu import headline as run_gpu_headline
    from benchmarks.peers import llama_cpp_prebuilt

    monkeypatch.setattr(llama_cpp_prebuilt, "find_archive", lambda: tmp_path / "llama.tar.xz")
    monkeypatch.setattr(llama_cpp_prebuilt, "unpack", lambda archive: tmp_path)
    monkeypatch.setattr(llama_cpp_prebuilt, "list_devices", lambda bin_dir: {"cuda": False, "output": "(none)",
                                                                             "compat_libstdcxx": False})
    ran = []
    monkeypatch.setattr(llama_cpp_prebuilt, "llama_bench", lambda *a, **k: ran.append(k))
    cfg, group = run_gpu_headline.family_config("mixtral", tiny=True, layers=4)
    args = argparse.Namespace(family="mixtral", tiny=True, config=cfg, group=group, checkpoint=None,
                              gguf=tmp_path / "m.gguf", device="cuda", shares=[0.5], prompt_len=16, new_tokens=8,
                              reps=1, threads=2)
    res = run_gpu_headline.Results(tmp_path / "out", "mixtral", {"family": "mixtral"})
    run_gpu_headline.phase_llama(args, res, deadline=float("inf"))
    saved = json.loads((tmp_path / "out" / "headline_mixtral.json").read_text())
    assert ran == [] and saved["llama"] == [] and "no CUDA device" in saved["llama_error"]
    assert "peers-prep" in saved["llama_error"] and saved["llama_devices"]["output"] == "(none)"


def test_the_qwen3_rows_swap_backends_on_one_loaded_model(tmp_path, monkeypatch):
    """Call 2's family through the same runner (in-process, one share): the Qwen3-MoE family's backends (its own
    routing and MoE layer list) swapped on one load, every row decoding the resident tokens."""
    import torch

    from benchmarks.gpu import headline as run_gpu_headline

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    threads = torch.get_num_threads()
    try:
        data = run_gpu_headline.main(["--phase", "all", "--family", "qwen3", "--tiny", "--layers", "4", "--shares",
                                      "0.5", "--prompt-len", "8", "--new-tokens", "4", "--out", str(tmp_path / "o")])
    finally:
        torch.set_num_threads(threads)
    rows = data["moeflow"]
    assert [(r["engine"], r["gpu_experts"]) for r in rows] == [
        ("moeflow AWQ resident", 32), ("moeflow AWQ lru", 16), ("moeflow AWQ lru cpu_compute=auto", 16)]
    assert all("error" not in r and r["tokens_equal_resident"] for r in rows), rows
    assert data["checkpoints"]["gguf"].startswith(str(tmp_path))
    assert (tmp_path / "o" / "headline.md").read_text().count("| moeflow AWQ") >= 3
