"""benchmarks/gpu_loan.sh, the 15-minute GPU loan (issue 36): PLAN=1's limits fit two device commands (call 1 <= 9 min,
call 2 <= 5 min), the header states the later loans' order, and TINY=1 runs call 1 end to end on the CPU: the tiny
AWQ checkpoint and its GGUF, the prebuilt llama.cpp's CPU backends (when ../shared/peers holds it), moeflow loaded
once with its expert backend swapped row by row (tokens = resident after every swap), the ratios and the table,
then call 2's first step (moeflow on the very GGUF file); the later loan's `gguf` command's plan and its Q4_K_M rows
in-process. ~60-80 s on 2 quiet cores (call 1 TINY and the GGUF step: ~50 s of it; 135 s at load average 8)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


def assert_fits(steps: list[tuple[str, int, str]], seconds: int) -> None:
    """A command that writes its checkpoint in the background while the GPU runs the steps before the llama.cpp
    step, which waits for it: it lasts max(background, steps before) + steps after, <= ``seconds`` by the limits
    and <= one device command with every step's kill-after."""
    kinds = [kind for kind, _, _ in steps]
    assert kinds.count("plan-background") == 1
    wait = next(i for i, (_, _, c) in enumerate(steps) if "--phase llama" in c)
    before = [limit for kind, limit, _ in steps[:wait] if kind == "plan"]
    after = [limit for _, limit, _ in steps[wait:]]
    background = steps[kinds.index("plan-background")][1]
    for kill in (0, KILL_AFTER_S):
        longest = max(background + kill, sum(before) + kill * len(before)) + sum(after) + kill * len(after)
        assert longest <= (seconds if kill == 0 else COMMAND_LIMIT_S), (steps, kill)


def test_the_two_calls_fit_one_loan(tmp_path):
    call1, call2 = plan("call1", tmp_path), plan("call2", tmp_path)
    # call 1 writes the checkpoints in the background while the GPU runs the stack check, the correctness set and the
    # kernels
    assert_fits(call1, 9 * 60)
    assert "plan-background" not in [k for k, _, _ in call2]
    serial = [limit for _, limit, _ in call2]
    assert sum(serial) <= 5 * 60 and sum(serial) + KILL_AFTER_S * len(serial) <= COMMAND_LIMIT_S, call2
    commands = " ".join(c for _, _, c in call1)
    for needed in ("benchmarks.gpu.stack --cuda", "tests/test_cuda_lane.py",
                   "benchmarks.gpu.kernels --shapes mixtral-8x7b --tokens 1,4,16", "--phase llama", "--phase moeflow",
                   "benchmarks.gpu.headline_report"):
        assert needed in commands, needed
    assert "--family qwen3 --phase moeflow" in " ".join(c for _, _, c in call2)
    # call 2 first: moeflow on the very GGUF call 1's llama.cpp rows ran (before the Mixtral files are deleted)
    assert "--family mixtral --phase moeflow" in call2[0][2] and call2[0][2].endswith("--source gguf")
    # llama.cpp runs before moeflow's process exists (the two never share the GPU)
    assert commands.index("--phase llama") < commands.index("--phase moeflow")


def longest(steps: list[tuple[str, int, str]]) -> int:
    """A command's length at its steps' limits (the background step overlapping the steps before the llama.cpp
    step, as in :func:`assert_fits`; a command with none: their sum)."""
    kinds = [kind for kind, _, _ in steps]
    if "plan-background" not in kinds:
        return sum(limit for _, limit, _ in steps)
    wait = next(i for i, (_, _, c) in enumerate(steps) if "--phase llama" in c)
    before = sum(limit for kind, limit, _ in steps[:wait] if kind == "plan")
    return max(steps[kinds.index("plan-background")][1], before) + sum(limit for _, limit, _ in steps[wait:])


def test_the_mixtral_rows_fit_the_fifteen_minutes(tmp_path):
    """The loan is 15 minutes of device time with the machine's start (~90 s) and each call's transfers (~30 s for
    both, a guess): call 1 (the headline) and call 2's first step (moeflow on the very GGUF llama.cpp ran) fit at
    their limits; the rest of call 2 (Qwen3) gets what is left, as the header says."""
    start, transfers = 90, 30
    call1, call2 = plan("call1", tmp_path), plan("call2", tmp_path)
    assert "--source gguf" in call2[0][2]
    assert start + longest(call1) + call2[0][1] + transfers <= 15 * 60
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    total = start + longest(call1) + longest(call2)
    assert f"call 1 (its limits: <= {longest(call1)} s) + call 2 (<= {longest(call2)} s) = {total} s" in header


def test_the_gguf_command_fits_a_later_loan(tmp_path):
    """The later loan's `gguf` command: the GGUF kernels compiled (tests/test_cuda_gguf_kernels.py) while the Q4_K_M
    file is written, then llama.cpp and moeflow on that one file."""
    steps = plan("gguf", tmp_path)
    assert_fits(steps, 9 * 60)
    commands = " ".join(c for _, _, c in steps)
    assert "tests/test_cuda_gguf_kernels.py" in commands and "--phase checkpoints --experts Q4_K_M" in commands
    assert "--phase moeflow" in commands and commands.count("--experts Q4_K_M") == 3 and "--source gguf" in commands


def test_the_header_states_the_later_loans_order():
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    line = next(x for x in header.splitlines() if "serve," in x)
    assert [w.strip(" #.,") for w in line.split(":")[-1].split(",")] == [
        "gguf", "serve", "engine", "models", "families", "tune", "deltanet", "lookup"]
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
    # kept outside $OUT for call 2 (the device empties $OUT between commands)
    assert json.loads((tmp_path / "moeflow-loan" / "headline_mixtral.json").read_text())["moeflow"] == rows
    # call 2's first step: moeflow on the very GGUF llama.cpp read (its Q4_0 experts load as AWQ, exactly)
    step = ["-m", "benchmarks.gpu.headline", "--family", "mixtral", "--phase", "moeflow", "--tiny", "--layers", "4",
            "--out", str(out), "--source", "gguf"]
    done = subprocess.run([sys.executable, *step], env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    subprocess.run([sys.executable, "-m", "benchmarks.gpu.headline_report", str(out)], env=env, check=True,
                   capture_output=True, timeout=120)
    data = json.loads((out / "headline_mixtral.json").read_text())
    gguf_rows = [r for r in data["moeflow"] if r["source"] == "gguf"]
    assert [(r["engine"], r["gpu_experts"]) for r in gguf_rows] == [
        ("moeflow GGUF-Q4_0 resident", 32), ("moeflow GGUF-Q4_0 lru", 16), ("moeflow GGUF-Q4_0 lru", 8),
        ("moeflow GGUF-Q4_0 lru cpu_compute=auto", 16), ("moeflow GGUF-Q4_0 lru cpu_compute=auto", 8)]
    # the same weights in the same (tiny: group 32) AWQ format: the AWQ checkpoint's tokens, at every budget
    assert all(r["tokens_equal_resident"] and r["tokens_equal_awq_resident"] for r in gguf_rows), gguf_rows
    assert "group_size=32" in data["moeflow_format_gguf"] and data["moeflow_load_s_gguf"] > 0
    md = (out / "headline.md").read_text()
    assert "| moeflow GGUF-Q4_0 lru | 8 | 25% |" in md and "tokens = AWQ resident: True" in md
    if llama_cpp_prebuilt.find_archive() is None:
        assert "llama-cpp-cuda-sm90.tar.xz" in data["llama_error"]
        return
    llama = {r["n_cpu_moe"]: r for r in data["llama"]}
    assert sorted(llama) == [0, 2, 3] and all(r["decode_tok_s"] > 0 for r in llama.values()), llama
    assert {q["share"] for q in data["ratios"]} == {1.0, 0.5, 0.25} and len(data["ratios"]) == 10
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


def test_the_q4_k_m_rows_read_one_file_in_both_engines(tmp_path, monkeypatch):
    """The later loan's `gguf` command's rows, in-process at tiny size (hidden 256: a K-quant super-block): the
    Q4_K_M file alone, llama.cpp on it (when the prebuilt is there), moeflow loading the same file as GGUF experts
    (Q4_K gate/up, Q4_K / Q6_K down) with its backend swapped row by row, every row decoding the resident tokens."""
    import torch

    from benchmarks.gpu import headline as run_gpu_headline
    from benchmarks.peers import llama_cpp_prebuilt

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    threads = torch.get_num_threads()
    try:
        data = run_gpu_headline.main(["--phase", "all", "--family", "mixtral", "--experts", "Q4_K_M", "--source",
                                      "gguf", "--tiny", "--layers", "2", "--shares", "0.5", "--prompt-len", "8",
                                      "--new-tokens", "4", "--out", str(tmp_path / "o")])
    finally:
        torch.set_num_threads(threads)
    assert data["checkpoints"]["experts"] == "Q4_K_M" and "awq" not in data["checkpoints"]
    assert "down_types=('Q4_K', 'Q6_K')" in data["moeflow_format_gguf"]
    rows = data["moeflow"]
    assert [(r["engine"], r["gpu_experts"]) for r in rows] == [
        ("moeflow GGUF-Q4_K_M resident", 16), ("moeflow GGUF-Q4_K_M lru", 8),
        ("moeflow GGUF-Q4_K_M lru cpu_compute=auto", 8)]
    assert all("error" not in r and r["tokens_equal_resident"] for r in rows), rows
    assert (tmp_path / "o" / "headline_mixtral_Q4_K_M.json").is_file()
    md = (tmp_path / "o" / "headline.md").read_text()
    assert "## mixtral Q4_K_M" in md and "Q4_K_M experts (random blocks)" in md
    if llama_cpp_prebuilt.find_archive() is not None:
        assert [r["engine"] for r in data["llama"]] == ["llama.cpp Q4_K_M"] * 2
        assert all(r["decode_tok_s"] > 0 for r in data["llama"]) and len(data["ratios"]) == 3
